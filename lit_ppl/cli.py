"""``lit-ppl validate``: the Hydra entry's evaluation, configured the LightningCLI way (flags and YAML files).

::

    lit-ppl validate                                        # the offline default: built-in model, demo text
    lit-ppl validate --model.path ../shared/data/stories260K --data.path story.txt --eval.seq_len 512
    lit-ppl validate --config configs/cli/stories260k.yaml --trainer.precision bf16-mixed --quant.name int8
    lit-ppl validate --print_config > mine.yaml             # every option, with its default

The option groups mirror the Hydra config: ``--model.*`` is :class:`~lit_ppl.models.ModelSpec`, ``--data.*``
:class:`~lit_ppl.sources.DataSpec`, ``--trainer.*`` Lightning's ``Trainer`` (``--trainer.strategy`` takes lit-ppl's
names ``auto|ddp|fsdp|hsdp``, ``--trainer.precision`` any Lightning precision), ``--eval.*`` and ``--quant.*`` the
``eval=``/``quant=`` groups: ``--eval.mode sliding`` is ``eval=sliding`` and ``--quant.name int4`` is ``quant=int4``,
an option left unset takes that group file's default. jsonargparse checks every value against these signatures.

Every other key of ``conf/validate.yaml`` (``--batch_size``, ``--distributed.timeout_s``, ``--resume.*``, ...) is
an option of the same name and default, read from that file, so a key added there is a flag here too.

The run itself is the Hydra entry's task function, :func:`lit_ppl.validate.main`, called with the equivalent
Hydra-shaped config: the same ``PerplexityModule``/``PerplexityDataModule``, strategy and precision handling,
signal handling and resume, error messages and ``results.json`` — so the two entry points cannot drift apart.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hydra.errors import InstantiationException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf import DictConfig, OmegaConf

from lit_ppl.models import ModelSpec
from lit_ppl.sources import DataSpec
from lit_ppl.strategies import STRATEGIES
from lit_ppl.validate import USER_ERRORS, conf_dir, evaluate
from lit_ppl.validate import main as validate_main

SUBCOMMANDS = ("validate",)
# Ranks that Lightning relaunches re-run this command line; they read the default output dir from here so that
# all ranks of one run agree on it even when they start in different seconds.
OUTPUT_DIR_ENV = "LIT_PPL_OUTPUT_DIR"
# Trainer arguments that evaluate() sets itself: a value given for them would be ignored or would clash.
OWNED_TRAINER_ARGS = (
    "logger",
    "callbacks",
    "use_distributed_sampler",
    "enable_checkpointing",
    "enable_model_summary",
    "inference_mode",
)
# Keys of conf/validate.yaml with a CLI option of their own (a group above, or a Trainer argument).
MAPPED_KEYS = ("defaults", "hydra", "precision", "seed", "output_dir")
PLAIN_TYPES = {bool: bool, int: int, float: float, str: str}


@dataclass
class EvalOptions:
    """How the text is cut into windows (the ``eval=`` group); ``None`` takes ``conf/eval/<mode>.yaml``'s value.

    Attributes:
        mode: ``rolling`` (lm-evaluation-harness), ``sliding`` (strided windows) or ``block``.
        seq_len: most input tokens per window.
        stride: ``sliding`` mode's stride.
        chunk_size: scored positions per output-head chunk (bounds the logits memory).
        deterministic: bit-identical results at any world size (whole batches per rank, exact sums).
    """

    mode: Literal["rolling", "sliding", "block"] = "rolling"
    seq_len: int | None = None
    stride: int | None = None
    chunk_size: int | None = None
    deterministic: bool | None = None


@dataclass
class CalibrationOptions:
    """Calibration text of ``awq``/``gptq`` (``quant.calibration`` in ``conf/quant/awq.yaml``, read by
    :class:`lit_ppl.calibrate.CalibrationSpec`); ``None`` takes the method file's value.

    Attributes:
        path: calibration text (not the evaluated text), read like ``--data.path``.
        format: as ``--data.format``.
        text_field: as ``--data.text_field``.
        document_separator: as ``--data.document_separator``.
        encoding_errors: as ``--data.encoding_errors``.
        limit: only the first N documents.
        cache_dir: token cache (default: ``--data.cache_dir``).
        seq_len: tokens per calibration window.
        tokens: calibration tokens (fewer if the text is shorter).
        batch_size: windows per forward pass.
        grid: AWQ's candidate scales per layer.
        allow_overlap: accept calibration text identical to the evaluated text.
    """

    path: str | None = None
    format: str | None = None
    text_field: str | None = None
    document_separator: str | None = None
    encoding_errors: str | None = None
    limit: int | None = None
    cache_dir: str | None = None
    seq_len: int | None = None
    tokens: int | None = None
    batch_size: int | None = None
    grid: int | None = None
    allow_overlap: bool | None = None


@dataclass
class QuantOptions:
    """Weight quantization (the ``quant=`` group); ``None`` takes the group file's value.

    The group file is ``conf/quant/<name>.yaml``, or with a calibrated ``method`` that method's file (it holds the
    calibration defaults): ``--quant.method=awq`` is ``quant=awq``, ``--quant.method=awq --quant.name=int4`` is
    ``quant=awq quant.name=int4``.

    Attributes:
        name: ``none``, ``int8``, ``int8dq``, ``int4`` or ``policy`` (``None``: ``none``, or the method file's).
        method: ``rtn`` (round-to-nearest), ``awq`` or ``gptq`` (calibrated: CUDA only).
        group_size: ``int4`` group size (32, 64, 128 or 256).
        backend: ``int4`` backend: ``auto``, ``tinygemm``, ``prototype`` or ``intx``.
        head: also quantize the output head (and tied embeddings).
        source: ``local`` (every rank quantizes) or ``rank0`` (rank 0 quantizes and broadcasts).
        rules: ``policy``'s ordered rules, e.g. ``[{role: mlp, config: int8, method: awq}]``.
        calibration: the calibration text of ``awq``/``gptq``.
    """

    name: str | None = None
    method: Literal["rtn", "awq", "gptq"] | None = None
    group_size: int | None = None
    backend: str | None = None
    head: bool | None = None
    source: str | None = None
    rules: list[dict[str, Any]] | None = None
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)


@dataclass
class CompareOptions:
    """Compare with a reference model token by token (the ``compare=`` group).

    Attributes:
        reference: ``None`` (no comparison), a checkpoint path, or ``{path, dtype, quant}`` as in
            ``conf/compare/unquantized.yaml`` (``path: null`` is the same checkpoint, unquantized).
    """

    reference: str | dict[str, Any] | None = None


def _load(group: str, option: str) -> dict[str, Any]:
    """One option file of a Hydra config group, as a plain dict (``{}`` when there is no such file)."""
    path = Path(conf_dir()) / group / f"{option}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}


def _root_defaults() -> dict[str, Any]:
    """``conf/validate.yaml``'s plain keys and the option it picks for each group."""
    root = OmegaConf.to_container(OmegaConf.load(Path(conf_dir()) / "validate.yaml"))
    choices = {k: v for entry in root.pop("defaults") if isinstance(entry, dict) for k, v in entry.items()}
    return {**root, "choices": choices}


# Keys whose YAML default does not show every type they take.
OVERRIDE_TYPES: dict[str, Any] = {
    "batch_size": int | Literal["auto"],
    "distributed.balance": Literal["tokens", "weights", "measured"],
    "distributed.weights": list[float] | None,
}


def _plain_keys(defaults: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``conf/validate.yaml`` that are not config groups or mapped to a Trainer argument."""
    return {k: v for k, v in defaults.items() if k not in (*MAPPED_KEYS, "choices")}


def _add_plain_arguments(parser: LightningArgumentParser, values: dict[str, Any], prefix: str = "") -> None:
    """``--key`` (or ``--section.key``) for each value, typed after its default."""
    for key, value in values.items():
        if isinstance(value, dict):
            _add_plain_arguments(parser, value, f"{prefix}{key}.")
            continue
        kind = OVERRIDE_TYPES.get(f"{prefix}{key}", PLAIN_TYPES.get(type(value), Any))
        parser.add_argument(
            f"--{prefix}{key}", type=kind, default=value, help=f"As {prefix}{key} in conf/validate.yaml."
        )


def _overlay(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``base`` with every value that was actually given (not ``None``) put over it."""
    return {**base, **{k: v for k, v in given.items() if v is not None}}


def _quant(given: dict[str, Any]) -> dict[str, Any]:
    """The ``quant`` group: its file (the calibrated method's, else the name's) with the given values over it."""
    given = dict(given)
    calibration = {k: v for k, v in (given.pop("calibration") or {}).items() if v is not None}
    method = given.get("method")
    base = _load("quant", method if method in ("awq", "gptq") else given["name"] or "none")
    cfg = _overlay(base, given)
    if calibration or "calibration" in base:
        cfg["calibration"] = {**(base.get("calibration") or {}), **calibration}
    return cfg


class PerplexityCLI(LightningCLI):
    """LightningCLI for ``lit-ppl validate``: parses the options, then builds the Hydra-shaped config.

    ``run=False``: Lightning's own subcommands would call ``trainer.validate`` on objects the CLI built; here
    the Hydra entry's code builds and runs them from :attr:`hydra_config`, so both entries share one code path.
    """

    def __init__(self, args: list[str] | None = None) -> None:
        defaults = _root_defaults()
        trainer = _load("trainer", defaults["choices"].get("trainer", "default"))
        super().__init__(
            trainer_defaults={**trainer, "precision": defaults["precision"]},
            seed_everything_default=defaults["seed"],
            save_config_callback=None,
            parser_kwargs={"prog": "lit-ppl validate", "description": __doc__.split("\n\n")[0]},
            args=args,
            run=False,
            auto_configure_optimizers=False,
            load_from_checkpoint_support=False,
        )

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Only the Trainer comes from LightningCLI's core: the module and datamodule are built from the Hydra config.
        parser.add_lightning_class_args(Trainer, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        defaults = _root_defaults()
        parser.add_class_arguments(ModelSpec, "model", instantiate=False)
        parser.add_class_arguments(DataSpec, "data", instantiate=False)
        parser.add_class_arguments(EvalOptions, "eval", instantiate=False)
        parser.add_class_arguments(QuantOptions, "quant", instantiate=False)
        parser.add_class_arguments(CompareOptions, "compare", instantiate=False)
        _add_plain_arguments(parser, _plain_keys(defaults))
        parser.add_argument(
            "--output_dir",
            type=str | None,
            default=None,
            help=f"Where results.json goes (default: ${OUTPUT_DIR_ENV} or outputs/cli/<date>/<time>).",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: list[str] | None) -> None:
        # LightningCLI warns when both sys.argv and args are set; main() always passes args (minus the subcommand).
        self.config = parser.parse_args(args)

    def instantiate_classes(self) -> None:
        self.hydra_config = to_hydra_config(self.config)


def to_hydra_config(ns: Any) -> DictConfig:
    """The Hydra config (``conf/validate.yaml``'s shape) that the parsed CLI options describe."""
    opts = ns.as_dict()
    trainer = dict(opts["trainer"])
    strategy, precision = trainer.pop("strategy"), trainer.pop("precision")
    if strategy not in STRATEGIES:
        raise ValueError(f"--trainer.strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    signature = inspect.signature(Trainer.__init__).parameters
    given = {
        k: v for k, v in trainer.items() if k in ("accelerator", "devices", "num_nodes") or v != signature[k].default
    }
    if isinstance(given["devices"], str) and given["devices"].isdigit():
        given["devices"] = int(given["devices"])  # jsonargparse reads --trainer.devices=2 as str (a valid type)
    for key, value in given.items():
        if key in OWNED_TRAINER_ARGS:
            raise ValueError(f"--trainer.{key} is set by lit-ppl itself; leave it out")
        if not isinstance(value, str | int | float | bool | type(None) | list):
            raise ValueError(f"--trainer.{key}={value!r}: only plain values are passed on to the Trainer")
    ev = opts["eval"]
    output_dir = opts["output_dir"] or os.environ.get(OUTPUT_DIR_ENV) or time.strftime("outputs/cli/%Y-%m-%d/%H-%M-%S")
    cfg = {
        "model": {"_target_": "lit_ppl.models.ModelSpec", **opts["model"]},
        "data": {"_target_": "lit_ppl.sources.DataSpec", **opts["data"]},
        "eval": _overlay(_load("eval", ev["mode"]), ev),
        "trainer": given,
        "strategy": {"name": strategy},
        "quant": _quant(opts["quant"]),
        "compare": opts["compare"],
        "precision": str(precision),
        "seed": int(opts["seed_everything"]),
        "output_dir": output_dir,
        **{k: opts[k] for k in _plain_keys(_root_defaults())},
    }
    return OmegaConf.create(cfg)


def validate(args: list[str]) -> dict[str, Any]:
    """Parse ``lit-ppl validate``'s options and evaluate in this process; return ``results.json``'s content."""
    return evaluate(PerplexityCLI(args).hydra_config)


def main(argv: list[str] | None = None) -> None:
    """The ``lit-ppl`` console script: ``lit-ppl validate [--config FILE.yaml] [--group.key VALUE ...]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: lit-ppl {{{','.join(SUBCOMMANDS)}}} [-h] [--config FILE.yaml] [--group.key VALUE ...]")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    try:
        cfg = PerplexityCLI(argv[1:]).hydra_config
    except ValueError as err:  # a value jsonargparse's types admit but lit-ppl does not (e.g. the strategy)
        print(f"lit-ppl: error: {err}", file=sys.stderr)
        sys.exit(1)
    os.environ[OUTPUT_DIR_ENV] = cfg.output_dir  # inherited by the ranks Lightning relaunches
    try:
        # Hydra's decorated main runs its task function directly on a config passed to it: the same signal
        # handling, resume, exit codes and one-line errors as `python -m lit_ppl.validate`.
        validate_main(cfg)
    except InstantiationException as err:
        # Hydra's own entry prints these without a traceback; report the cause (ModelSpec/DataSpec's check).
        if not isinstance(err.__cause__, USER_ERRORS):
            raise
        print(f"lit-ppl: error: {err.__cause__}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
