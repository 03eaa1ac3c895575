"""Everything checkable before a weight loads, as one typed :class:`Plan`.

:func:`preflight` converts the composed config to its typed schema once, checks it against the world (ranks,
devices, the model's own config) and builds the small objects every later step reads: the rank layout, the model
and data specs, the batch plan, the quantization node. A run that cannot work stops here, in seconds, with one
line; :func:`lit_ppl.run.evaluate` then only builds and runs.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lit_ppl.config.guard import check_output_location, check_targets, construct
from lit_ppl.config.numbers import number_keys, progress_keys
from lit_ppl.config.quant import QuantConfig, quant_config
from lit_ppl.config.schema import ParallelConfig, ValidateConfig
from lit_ppl.config.values import REFERENCE_DTYPES
from lit_ppl.data import autobatch, balance
from lit_ppl.data.batch_plan import BatchPlan
from lit_ppl.data.sources import DataSpec
from lit_ppl.errors import LitPplError
from lit_ppl.model.nll import auto_chunk
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel import tensor_parallel
from lit_ppl.parallel.layout import Layout, resolve
from lit_ppl.quant.quantizer import check_layout
from lit_ppl.runtime.precision import Precision, device_type
from lit_ppl.runtime.verbosity import set_verbose


@dataclass(frozen=True)
class Reference:
    """``compare.reference`` read and checked: which model, its quantization and its weights' dtype (``None``: the
    run's precision)."""

    model: ModelSpec
    quant: QuantConfig
    dtype: torch.dtype | None


@dataclass
class Plan:
    """One evaluation, checked: what every later step is built from."""

    cfg: ValidateConfig  # the typed config, converted once
    config: dict[str, Any]  # the same, resolved to plain containers: results.json's "config"
    output_dir: Path
    devices: int  # trainer.devices as a number (processes on this node)
    layout: Layout
    model: ModelSpec
    data: DataSpec
    limits: tuple[int, int | None]  # the model's (vocabulary, positions)
    batch: BatchPlan
    quant: QuantConfig  # every default from the schema (lit_ppl.quant reads it as it is)
    breakdown: bool  # per-document and per-position sums: kept only when a report reads them
    model_identity: dict[str, Any]  # the weights' files with their times (lit_ppl.model.spec.ModelSpec.identity)
    precision: Precision  # decoded once: the weights' dtype, whether it casts them
    device: str  # where the run computes: cuda or cpu
    chunk_size: int  # scored positions per output-head chunk (eval.chunk_size=auto resolved)
    reference: Reference | None  # a live comparison's reference model (compare.reference), checked

    @property
    def deterministic(self) -> bool:
        return self.cfg.eval.deterministic

    def progress_config(self) -> dict[str, Any]:
        """What saved progress must match (:func:`lit_ppl.config.numbers.progress_keys`, the weights' files with
        their times) and what its states hold."""
        return {
            **progress_keys(self.config),
            "breakdown": self.breakdown,
            "per_token": self.cfg.report.per_token,  # rows written before a resume must exist after it
            "model_identity": self.model_identity,
        }

    def agreement(self) -> dict[str, Any]:
        """What every rank must share, without paths (a node may read its own copy of the files): the number keys,
        the weights' file names and sizes, the layout and the batch plan (:mod:`lit_ppl.evaluation.agreement`)."""
        numbers = number_keys(self.config)
        run = self.cfg
        return {
            **{k: v for k, v in numbers.items() if k not in ("model", "data")},
            "model": {k: v for k, v in numbers["model"].items() if k != "path"},
            "model_files": self.model_identity["names_digest"],
            "data": {k: v for k, v in numbers["data"].items() if k != "path"},
            "eval": dataclasses.asdict(run.eval),
            "layout": self.layout.describe(),
            "batch_size": run.batch_size,
            "balance": [run.distributed.balance, run.distributed.weights],
        }


def check_output_dir(path: str, key: str = "output_dir") -> Path:
    """Fail before hours of evaluation, not after, if results cannot be written (or would land in a system
    directory)."""
    check_output_location(key, path)
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise LitPplError(f"{key}={path!r} is not writable: {err.strerror or err}") from err
    return out


def resolve_reference(reference: Any, model: ModelSpec, precision: Precision) -> Reference | None:
    """The live reference of ``compare.reference`` (a path, or ``{path, dtype, quant}``), checked against the
    candidate: the same tokenizer and vocabulary, a dtype the run's precision can hold. ``None`` without one, or for
    a saved reference (``store``), which is read instead."""
    if not reference or (isinstance(reference, dict) and reference.get("store")):
        return None
    ref = {"path": reference} if isinstance(reference, str) else dict(reference)
    path = ref.get("path") or model.path
    # gguf_file is the candidate's file, not the reference's (a reference FILE.gguf sets its own from its path).
    spec = dataclasses.replace(model, path=path, gguf_file=None) if path != model.path else model
    if spec is model and model.stored_quantization() is not None:  # else: the stored model against itself, KL 0
        raise LitPplError(
            f"model.path={model.path!r} is stored quantized ({model.stored_quantization()['name']}): it has no "
            "unquantized version to compare with; set compare.reference.path=the float checkpoint"
        )
    name = ref.get("dtype")
    if name is not None and name not in REFERENCE_DTYPES:
        raise LitPplError(f"compare.reference.dtype={name!r} is not one of {', '.join(REFERENCE_DTYPES)}")
    dtype = getattr(torch, name) if name else None
    if dtype is not None and precision.casts_weights and dtype != precision.weights:
        raise LitPplError(
            f"compare.reference.dtype={dtype} cannot hold under precision={precision.name}, which casts every "
            "weight to its dtype; use a mixed precision (e.g. bf16-mixed) or 32-true for the run"
        )
    if spec is not model and (
        spec.limits()[0] != model.limits()[0] or spec.tokenizer().fingerprint != model.tokenizer().fingerprint
    ):
        raise LitPplError(f"the reference {path} has another tokenizer or vocabulary than {model.path}")
    return Reference(spec, quant_config(ref.get("quant") or {"name": "none"}), dtype)


def check_outputs(typed: ValidateConfig) -> None:
    """A saved reference is read alone (no reference model besides), and a run saving one scores one model."""
    reference = typed.compare.reference
    store = reference.get("store") if isinstance(reference, dict) else None
    if store and (
        reference.get("path") or reference.get("dtype") or (reference.get("quant") or {}).get("name", "none") != "none"
    ):
        raise LitPplError(
            f"compare.reference.store={store!r} with compare.reference.path, dtype or quant: a saved reference is "
            "read as it was saved; give either the store (compare=saved) or a reference model (compare=unquantized)"
        )
    if typed.save_reference and reference:
        raise LitPplError(
            f"save_reference={typed.save_reference!r} with compare: a saved reference is one model's; save it in a "
            "run without compare (compare=none)"
        )
    if typed.save_reference:
        directory = Path(typed.save_reference).expanduser()
        # A run that died before its manifest was written leaves only lit-ppl's own hidden files (its lock).
        mine = ("manifest.json", ".lit_ppl")
        foreign = directory.is_dir() and any(not p.name.startswith(mine) for p in directory.iterdir())
        if directory.is_file() or (foreign and not (directory / "manifest.json").exists()):
            raise LitPplError(
                f"save_reference={typed.save_reference!r} is a file or a directory holding other files; give a new "
                "or empty directory (or one a previous save_reference run wrote)"
            )
        check_output_dir(str(directory), "save_reference")


def resolve_layout(name: str, p: ParallelConfig, devices: int, num_nodes: int) -> Layout:
    """The rank layout of ``parallel`` (its values set by the ``strategy`` preset), checked against the world."""
    if name == "hsdp" and num_nodes < 2:
        raise LitPplError("strategy=hsdp replicates across nodes: it needs trainer.num_nodes >= 2")
    return resolve(p.dp_replicate, p.dp_shard, p.tp, devices * num_nodes, num_nodes, p.tp_across_nodes)


def count_devices(accelerator: str, devices: Any) -> int:
    """``trainer.devices`` as a number: ``-1``/``auto`` (every GPU) and a list of GPU ids counted here, not by
    Lightning, because the layout is checked before the Trainer exists."""
    on_gpu = device_type(accelerator) == "cuda"
    if isinstance(devices, list) and devices:
        return len(devices)
    if devices in (-1, "-1", "auto"):
        if not on_gpu:
            raise LitPplError(
                f"trainer.devices={devices} means every GPU, but this run is on the CPU; give the number of processes "
                "(e.g. trainer.devices=2)"
            )
        return torch.cuda.device_count()
    if isinstance(devices, bool) or not str(devices).isdigit() or int(devices) < 1:
        raise LitPplError(f"trainer.devices={devices!r} must be a positive integer, -1 or auto (every GPU), or a list")
    return int(devices)


def check_devices(accelerator: str, devices: int) -> None:
    """``trainer.devices`` GPUs must exist; Lightning's own message ("No supported gpu backend found!") says less."""
    if accelerator not in ("gpu", "cuda"):
        return  # CPU "devices" are processes: more than the cores is slow but valid
    visible = torch.cuda.device_count()
    if devices > visible:
        raise LitPplError(
            f"trainer.accelerator={accelerator} trainer.devices={devices}, but {visible} CUDA devices are visible "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use trainer.devices<={visible} or "
            "trainer.accelerator=cpu"
        )


def check_deterministic(batch_size: int | str, compile_decoder: bool, tp: int = 1) -> None:
    """What deterministic mode cannot promise the same bits for, refused before anything loads."""
    if tp > 1:
        raise LitPplError(
            f"parallel.tp={tp} with eval.deterministic=true: tensor parallelism splits every matmul's sum over the "
            "group, so its bits differ from tp=1's (by ~1e-9 relative in PPL); use parallel.tp=1 (ddp, fsdp, hsdp)"
        )
    if batch_size == "auto":
        raise LitPplError(
            "batch_size=auto with eval.deterministic=true: the probed size can differ between machines and world "
            "sizes, and a window's batch decides its bits; give a number"
        )
    if compile_decoder:
        raise LitPplError(
            "compile=true with eval.deterministic=true: the kernels torch.compile generates for a batch shape depend "
            "on the shapes a rank compiled before; use compile=false"
        )


def preflight(cfg: DictConfig) -> Plan:
    """Check ``cfg`` (the schema, the targets, the layout, the model's config) and return the run's :class:`Plan`."""
    set_verbose(cfg.get("verbose", False))  # the libraries' lines hidden (or shown) from the first check on
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    check_targets(plain, plain.get("allow_any_target", False))  # the entries checked it already; not Python callers
    typed: ValidateConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ValidateConfig), plain))
    out = check_output_dir(typed.output_dir)
    trainer, dist = typed.trainer, typed.distributed
    accelerator, num_nodes = str(trainer["accelerator"]), int(trainer["num_nodes"])
    devices = count_devices(accelerator, trainer["devices"])
    layout = resolve_layout(typed.strategy.name, typed.parallel, devices, num_nodes)
    deterministic = typed.eval.deterministic
    balance.check(dist.balance, dist.weights, layout.kind, deterministic, devices * num_nodes, num_nodes)
    check_devices(accelerator, devices)
    if deterministic:
        check_deterministic(typed.batch_size, typed.compile, layout.tp)
    model = construct(plain["model"])
    limits = model.limits()  # reads the checkpoint's config: fails fast on a path that is not a causal LM
    if layout.tp > 1:  # the model's numbers and plan, from its config: before any weights load
        model_config = model.config()
        layout.check_model(tensor_parallel.widths(model_config))
        tensor_parallel.check_plan(model_config)
    if limits[1] is not None and typed.eval.seq_len > limits[1]:
        raise LitPplError(
            f"eval.seq_len={typed.eval.seq_len} exceeds the model's maximum of {limits[1]} positions; "
            f"use eval.seq_len<={limits[1]}"
        )
    data = construct(plain["data"])  # its paths checked before Lightning is imported (by the precision's name)
    precision = Precision.of(typed.precision)
    quant = quant_config(plain["quant"])
    if quant.name != "none" and precision.weights == torch.float64:
        raise LitPplError(
            f"quant={quant.name} with precision={typed.precision}: torchao's quantized weights take bfloat16, "
            "float16 or float32 inputs, not float64; use precision=32-true (or bf16-true)"
        )
    check_layout(quant, layout)
    check_outputs(typed)
    autobatch.check_layout(typed.batch_size, layout)
    if typed.batch_size == "auto":
        autobatch.read_cache(Path(typed.autobatch.cache).expanduser())  # one it would overwrite is refused now
    batch = BatchPlan(typed.batch_size, dist.balance, dist.weights, dataclasses.asdict(typed.autobatch))
    breakdown = bool(typed.report.per_document) or typed.report.plots or typed.report.html
    reference = resolve_reference(typed.compare.reference, model, precision)
    path = "compare" if typed.compare.reference else "nll"
    chunk = auto_chunk(typed.eval.chunk_size, limits[0], typed.eval.chunk_budget_mb, path)
    facts = (model.identity(), precision, device_type(accelerator), chunk, reference)
    return Plan(typed, plain, out, devices, layout, model, data, limits, batch, quant, breakdown, *facts)
