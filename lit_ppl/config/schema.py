"""The typed schema of the Hydra config tree: one dataclass per node, :class:`ValidateConfig` the whole config.

OmegaConf types scalars, lists, dicts and nested dataclasses; each field's metadata
(:func:`lit_ppl.config.values.meta`) adds what it cannot: allowed values, a ``check`` function, the union the
Lightning CLI offers, the schema of an untyped node's contents, and the field's line of ``--help``. The ``quant``
and ``compare`` nodes are in :mod:`lit_ppl.config.quant`; :mod:`lit_ppl.config` registers the schema with Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import MISSING

from lit_ppl.config.quant import CompareConfig, QuantConfig
from lit_ppl.config.values import (
    BALANCES,
    DATA_FORMATS,
    ENCODING_ERRORS,
    EVAL_MODES,
    PATHS,
    PER_DOCUMENT_FORMATS,
    PRECISIONS,
    STRATEGY_NAMES,
    check_batch_size,
    check_calibration,
    check_logger,
    check_non_negative,
    check_paths,
    check_positive,
    check_rank_count,
    check_step_count,
    check_trainer,
    meta,
)


@dataclass
class ModelConfig:
    """``model``: :class:`lit_ppl.model.spec.ModelSpec`'s fields (the schema test keeps them equal)."""

    _target_: str = field(
        default="lit_ppl.model.spec.ModelSpec",
        metadata=meta("the class built from this node (lit_ppl only, see allow_any_target)"),
    )
    # No default here (ModelSpec's is builtin): model=hf's `path: ???` must stay required, and a merge keeps an
    # existing value under ???.
    path: str = field(default=MISSING, metadata=meta("builtin, a Hugging Face checkpoint directory or a hub id"))
    gguf_file: str | None = field(
        default=None, metadata=meta("the GGUF file in the directory or hub repository model.path (or path=FILE.gguf)")
    )
    trust_remote_code: bool = field(default=False, metadata=meta("run the checkpoint's own Python code"))
    revision: str | None = field(default=None, metadata=meta("hub revision (branch, tag or commit)"))
    seed: int = field(default=0, metadata=meta("built-in model: initialisation seed"))
    hidden_size: int = field(default=64, metadata=meta("built-in model: width"))
    num_layers: int = field(default=2, metadata=meta("built-in model: depth"))
    num_heads: int = field(default=4, metadata=meta("built-in model: attention heads"))
    max_positions: int = field(default=2048, metadata=meta("built-in model: context length"))


@dataclass
class DataConfig:
    """``data``: :class:`lit_ppl.data.sources.DataSpec`'s fields (the schema test keeps them equal)."""

    _target_: str = field(
        default="lit_ppl.data.sources.DataSpec", metadata=meta("the class built from this node (lit_ppl only)")
    )
    path: Any = field(
        default=MISSING,  # as model.path: data=text's `path: ???` stays required
        metadata=meta(
            "a file, directory, glob or list of them", check=check_paths, union=PATHS, shown="str | list[str] | null"
        ),
    )
    format: str = field(default="auto", metadata=meta("auto: by extension", choices=DATA_FORMATS))
    hub_name: str | None = field(default=None, metadata=meta("a hub dataset, read when path is empty"))
    hub_config: str | None = field(default=None, metadata=meta("the hub dataset's configuration"))
    split: str = field(default="train", metadata=meta("the hub dataset's split"))
    text_field: str = field(default="text", metadata=meta("the text column of json/parquet/hub rows"))
    join_rows: bool = field(default=False, metadata=meta("join all rows before splitting into documents"))
    document_separator: str | None = field(default=None, metadata=meta("a regex splitting each text into documents"))
    encoding_errors: str = field(default="strict", metadata=meta("how invalid UTF-8 is read", choices=ENCODING_ERRORS))
    limit: int | None = field(default=None, metadata=meta("only the first N documents"))
    num_proc: int | None = field(
        default=None, metadata=meta("processes for the first tokenization (null: this process's CPUs)")
    )
    cache_dir: str | None = field(default=None, metadata=meta("token store (null: $LIT_PPL_CACHE or ~/.cache/lit_ppl)"))


@dataclass
class EvalConfig:
    """``eval``: how the text is cut into windows."""

    mode: str = field(
        default="rolling",
        metadata=meta(
            "lm-eval rolling windows, HF strided windows, disjoint blocks, or llama-perplexity chunks",
            choices=EVAL_MODES,
        ),
    )
    seq_len: int = field(default=512, metadata=meta("most input tokens per window"))
    stride: int | None = field(default=None, metadata=meta("sliding mode's stride"))
    chunk_size: Any = field(
        default="auto",
        metadata=meta(
            "scored positions per output-head chunk, or auto: the most whose logits fit in chunk_budget_mb",
            check=check_batch_size,
            union=int | Literal["auto"],
            shown="int | auto",
        ),
    )
    chunk_budget_mb: int = field(
        default=256,
        metadata=meta("chunk_size=auto: MiB of logits per chunk, both models' when comparing", check=check_positive),
    )
    deterministic: bool = field(default=False, metadata=meta("bit-identical at any world size"))


@dataclass
class StrategyConfig:
    """``strategy``: which preset of conf/strategy/ (it also sets ``parallel``)."""

    name: str = field(default="auto", metadata=meta("set by strategy=NAME", choices=STRATEGY_NAMES))


@dataclass
class ParallelConfig:
    """``parallel``: the rank layout, world = dp_replicate x dp_shard x tp (-1: the rest of the world size)."""

    dp_replicate: int = field(
        default=-1, metadata=meta("data-parallel replicas", check=check_rank_count, shown="int >= 1 | -1")
    )
    dp_shard: int = field(
        default=1, metadata=meta("data-parallel shards (FSDP)", check=check_rank_count, shown="int >= 1 | -1")
    )
    tp: int = field(default=1, metadata=meta("tensor-parallel ranks", check=check_rank_count, shown="int >= 1 | -1"))
    tp_across_nodes: bool = field(default=False, metadata=meta("let a tensor-parallel group span nodes"))


@dataclass
class AutobatchConfig:
    """``autobatch``: the search of ``batch_size=auto``."""

    max_memory_gb: float | None = field(default=None, metadata=meta("null: 90% of free CUDA memory / half the RAM"))
    max_batch: int = field(default=1024, metadata=meta("largest batch tried"))
    cache: str = field(default="~/.cache/lit_ppl/autobatch.json", metadata=meta("where found batch sizes are kept"))


@dataclass
class DistributedConfig:
    """``distributed``: collectives and work sharing."""

    timeout_s: float = field(
        default=300.0, metadata=meta("every collective gives up after this many seconds", check=check_positive)
    )
    balance: str = field(
        default="tokens", metadata=meta("how work is shared between ranks of unequal speed", choices=BALANCES)
    )
    weights: list[float] | None = field(
        default=None, metadata=meta("balance=weights: relative speed per node or per rank")
    )


@dataclass
class ResumeConfig:
    """``resume``: preemption-safe progress in ``${output_dir}/progress``."""

    enabled: bool = field(default=True, metadata=meta("save progress and resume a rerun"))
    save_every: int = field(
        default=200, metadata=meta("steps between saves (0: only on a signal)", check=check_non_negative)
    )
    check_every: int = field(
        default=10, metadata=meta("steps between cross-rank checks for SIGUSR1/SIGTERM", check=check_step_count)
    )


@dataclass
class ReportConfig:
    """``report``: extra outputs next to results.json."""

    per_document: str | None = field(
        default=None, metadata=meta("also write per_document.{csv,parquet}", choices=PER_DOCUMENT_FORMATS)
    )
    plots: bool = field(default=True, metadata=meta("nll_by_position.png"))
    html: bool = field(
        default=True, metadata=meta("report.html: the numbers, charts and the text shaded token by token (offline)")
    )
    per_token: bool = field(
        default=False, metadata=meta("also write per_token.npy (float64 NLL per token, corpus order) and its index")
    )


@dataclass
class ValidateConfig:
    """The whole config of ``python -m lit_ppl.validate`` (``conf/validate.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata=meta("model=builtin|demo|hf"))
    data: DataConfig = field(default_factory=DataConfig, metadata=meta("data=demo|alice|text|wikitext2"))
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=meta("eval=rolling|sliding|block|llamacpp"))
    trainer: dict[str, Any] = field(
        default_factory=dict, metadata=meta("Lightning Trainer arguments", check=check_trainer)
    )
    strategy: StrategyConfig = field(default_factory=StrategyConfig, metadata=meta("strategy=NAME"))
    parallel: ParallelConfig = field(
        default_factory=ParallelConfig, metadata=meta("set by strategy=NAME, each overridable")
    )
    quant: QuantConfig = field(
        default_factory=QuantConfig,
        metadata=meta("quant=none|int8|int8dq|int4|policy|awq|gptq|auto", check=check_calibration),
    )
    compare: CompareConfig = field(default_factory=CompareConfig, metadata=meta("compare=none|unquantized|saved"))
    save_reference: str | None = field(
        default=None, metadata=meta("write this run's hidden states and head here, for compare=saved")
    )
    logger: dict[str, Any] | None = field(
        default=None, metadata=meta("logger=none|csv|tensorboard|mlflow|wandb", check=check_logger)
    )
    precision: str = field(default="32-true", metadata=meta("Lightning precision", choices=PRECISIONS))
    batch_size: Any = field(
        default=8,
        metadata=meta(
            "windows per step, or auto: the largest that fits",
            check=check_batch_size,
            union=int | Literal["auto"],
            shown="int | auto",
        ),
    )
    compile: bool = field(default=False, metadata=meta("torch.compile the decoder"))
    autobatch: AutobatchConfig = field(default_factory=AutobatchConfig, metadata=meta())
    seed: int = field(default=0, metadata=meta("Lightning's seed_everything"))
    verbose: bool = field(
        default=False, metadata=meta("also Lightning's banner, tips and library deprecation warnings")
    )
    allow_any_target: bool = field(default=False, metadata=meta("let _target_ name classes outside lit_ppl"))
    output_dir: str = field(default=MISSING, metadata=meta("results.json goes here"))
    distributed: DistributedConfig = field(default_factory=DistributedConfig, metadata=meta())
    resume: ResumeConfig = field(default_factory=ResumeConfig, metadata=meta())
    report: ReportConfig = field(default_factory=ReportConfig, metadata=meta())
