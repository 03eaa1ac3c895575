"""``lit-ppl validate``: the Hydra entry's evaluation, configured the LightningCLI way (flags and YAML files).

::

    lit-ppl validate                                        # the offline default: built-in model, demo text
    lit-ppl validate --model.path ../shared/data/stories260K --data.path story.txt --eval.seq_len 512
    lit-ppl validate --config configs/cli/stories260k.yaml --trainer.precision bf16-mixed --quant.name int8
    lit-ppl validate --print_config > mine.yaml             # every option, with its default

Every option comes from the typed schema of the Hydra config (:mod:`lit_ppl.config`), so the two entries cannot
drift apart: ``--model.*`` is :class:`~lit_ppl.model.spec.ModelSpec` and ``--data.*``
:class:`~lit_ppl.data.sources.DataSpec`
(the schema mirrors both), ``--trainer.*`` Lightning's ``Trainer`` (``--trainer.strategy`` takes the names of
``conf/strategy/``, ``--trainer.precision`` any Lightning precision), ``--eval.*``, ``--quant.*`` and
``--parallel.*`` the ``eval=``/``quant=``/``strategy=`` groups: ``--eval.mode sliding`` is ``eval=sliding``,
``--quant.name int4`` is ``quant=int4``, ``--trainer.strategy tp`` is ``strategy=tp``, and an option left unset
takes that group file's default. ``--logger csv`` is ``logger=csv``. Every other key of the schema
(``--batch_size``, ``--distributed.timeout_s``, ``--resume.*``, ...) is an option of the same name, type and
allowed values, defaulting to ``conf/validate.yaml``'s value. jsonargparse checks each value's type, and the
assembled config is checked against the schema as the Hydra entry's is.

The run itself is the Hydra entry's task function, :func:`lit_ppl.validate.main`, called with the equivalent
Hydra-shaped config: the same ``PerplexityModule``/``PerplexityDataModule``, strategy and precision handling,
signal handling and resume, error messages and ``results.json``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time
import typing
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_ppl import config
from lit_ppl.data.sources import DataSpec
from lit_ppl.errors import LitPplError
from lit_ppl.model.spec import ModelSpec
from lit_ppl.run import USER_ERRORS, evaluate, exit_for
from lit_ppl.validate import conf_dir
from lit_ppl.validate import main as validate_main

SUBCOMMANDS = ("validate",)
# Ranks that Lightning relaunches re-run this command line; they read the default output dir from here so that
# all ranks of one run agree on it even when they start in different seconds.
OUTPUT_DIR_ENV = "LIT_PPL_OUTPUT_DIR"
# Schema keys with options of their own: a group (built from its file and options) or a Trainer argument.
GROUP_KEYS = ("model", "data", "eval", "trainer", "strategy", "parallel", "quant", "compare", "logger")
MAPPED_KEYS = ("precision", "seed", "output_dir")


def _cli_type(f: dataclasses.Field, kind: Any) -> Any:
    """The jsonargparse type of a schema field: its allowed values as a Literal, its union, or its own type."""
    choices = f.metadata.get("choices", ())
    if choices:
        allowed = Literal[choices]  # Literal[("a", "b")] is Literal["a", "b"]
        return allowed | None if type(None) in typing.get_args(kind) else allowed
    return f.metadata.get("union", kind)


def _options(schema: type, keep: tuple[str, ...] = ()) -> type:
    """A dataclass of ``schema``'s fields for jsonargparse, each ``None`` by default: an option left unset takes the
    group file's value. Fields named in ``keep`` (the one that picks the file) keep the schema's default."""
    specs: list[tuple[str, Any, Any]] = []
    lines = [(schema.__doc__ or "").strip(), "", "Attributes:"]
    for f, kind in config.schema_fields(schema):
        inner = config.nested_schema(kind)
        if inner is not None:
            nested = _options(inner)
            specs.append((f.name, nested, dataclasses.field(default_factory=nested)))
        elif f.name in keep:
            specs.append((f.name, _cli_type(f, kind), f.default))
        else:
            specs.append((f.name, _cli_type(f, kind) | None, None))
        lines.append(f"    {f.name}: {f.metadata.get('doc') or f.name}")
    name = schema.__name__.replace("Config", "Options")
    options = dataclasses.make_dataclass(name, specs)
    options.__doc__, options.__module__ = "\n".join(lines), __name__  # jsonargparse's help reads the Attributes
    return options


EvalOptions = _options(config.EvalConfig, keep=("mode",))
QuantOptions = _options(config.QuantConfig)
CalibrationOptions = {f.name: f.type for f in dataclasses.fields(QuantOptions)}["calibration"]
CompareOptions = _options(config.CompareConfig)
ParallelOptions = _options(config.ParallelConfig)


def _load(group: str, option: str) -> dict[str, Any]:
    """One option file of a Hydra config group, as a plain dict (``{}`` when there is no such file)."""
    path = Path(conf_dir()) / group / f"{option}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}


def _preset() -> tuple[dict[str, Any], dict[str, Any]]:
    """``conf/validate.yaml`` over the schema's defaults (as Hydra composes it before any group), and the option it
    picks for each group."""
    root = OmegaConf.load(Path(conf_dir()) / "validate.yaml")
    entries = OmegaConf.to_container(root.pop("defaults"))
    root.pop("hydra", None)
    choices = {k: v for entry in entries if isinstance(entry, dict) for k, v in entry.items()}
    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(config.ValidateConfig), root)), choices


def _plain_fields(schema: type, prefix: str = "") -> typing.Iterator[tuple[str, dataclasses.Field, Any]]:
    """``(dotted key, field, type)`` of each schema leaf that is neither a group nor mapped to a Trainer argument."""
    for f, kind in config.schema_fields(schema):
        key = f"{prefix}{f.name}"
        if not prefix and f.name in (*GROUP_KEYS, *MAPPED_KEYS):
            continue
        inner = config.nested_schema(kind)
        if inner is not None:
            yield from _plain_fields(inner, f"{key}.")
        else:
            yield key, f, kind


def _select(values: dict[str, Any], key: str) -> Any:
    """``values["a"]["b"]`` for ``key="a.b"``."""
    for part in key.split("."):
        values = values[part]
    return values


def _overlay(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``base`` with every value that was actually given (not ``None``) put over it."""
    return {**base, **{k: v for k, v in given.items() if v is not None}}


def _quant(given: dict[str, Any]) -> dict[str, Any]:
    """The ``quant`` group: its file (the calibrated method's, else the name's) with the given values over it."""
    given = dict(given)
    nested = {
        key: {k: v for k, v in (given.pop(key) or {}).items() if v is not None} for key in ("calibration", "gptq")
    }
    method = given.get("method")
    base = _load("quant", method if method in ("awq", "gptq") else given["name"] or "none")
    cfg = _overlay(base, given)
    for key, values in nested.items():  # the nodes' given keys over the file's
        if values or key in base:
            cfg[key] = {**(base.get(key) or {}), **values}
    return cfg


class PerplexityCLI(LightningCLI):
    """LightningCLI for ``lit-ppl validate``: parses the options, then builds the Hydra-shaped config.

    ``run=False``: Lightning's own subcommands would call ``trainer.validate`` on objects the CLI built; here
    the Hydra entry's code builds and runs them from :attr:`hydra_config`, so both entries share one code path.
    """

    def __init__(self, args: list[str] | None = None) -> None:
        defaults, choices = _preset()
        trainer = _load("trainer", choices.get("trainer", "default"))
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
        defaults, choices = _preset()
        parser.add_class_arguments(ModelSpec, "model", instantiate=False)
        parser.add_class_arguments(DataSpec, "data", instantiate=False)
        parser.add_class_arguments(EvalOptions, "eval", instantiate=False)
        parser.add_class_arguments(QuantOptions, "quant", instantiate=False)
        parser.add_class_arguments(CompareOptions, "compare", instantiate=False)
        parser.add_class_arguments(ParallelOptions, "parallel", instantiate=False)
        parser.add_argument(
            "--logger",
            type=Literal[config.LOGGERS],
            default=choices.get("logger") or "none",
            help="An experiment logger, as logger= of the Hydra entry (conf/logger/).",
        )
        for key, f, kind in _plain_fields(config.ValidateConfig):
            doc = f.metadata.get("doc") or f"as {key} in conf/validate.yaml"
            parser.add_argument(f"--{key}", type=_cli_type(f, kind), default=_select(defaults, key), help=f"{doc}.")
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
    """The Hydra config (the schema's shape, checked as the Hydra entry checks it) that the parsed options describe."""
    opts = ns.as_dict()
    trainer = dict(opts["trainer"])
    strategy, precision = trainer.pop("strategy"), trainer.pop("precision")
    if strategy not in config.STRATEGY_NAMES:
        raise LitPplError(f"--trainer.strategy={strategy!r} is not one of {', '.join(config.STRATEGY_NAMES)}")
    signature = inspect.signature(Trainer.__init__).parameters
    given = {
        k: v for k, v in trainer.items() if k in ("accelerator", "devices", "num_nodes") or v != signature[k].default
    }
    if isinstance(given["devices"], str) and given["devices"].isdigit():
        given["devices"] = int(given["devices"])  # jsonargparse reads --trainer.devices=2 as str (a valid type)
    for key, value in given.items():
        if key in config.OWNED_TRAINER_ARGS:
            raise LitPplError(f"--trainer.{key} is set by lit-ppl itself; leave it out")
        if not isinstance(value, str | int | float | bool | type(None) | list):
            raise LitPplError(f"--trainer.{key}={value!r}: only plain values are passed on to the Trainer")
    ev = opts["eval"]
    output_dir = opts["output_dir"] or os.environ.get(OUTPUT_DIR_ENV) or time.strftime("outputs/cli/%Y-%m-%d/%H-%M-%S")
    cfg = {
        "model": {"_target_": "lit_ppl.model.spec.ModelSpec", **opts["model"]},
        "data": {"_target_": "lit_ppl.data.sources.DataSpec", **opts["data"]},
        "eval": _overlay(_load("eval", ev["mode"]), ev),
        "trainer": given,
        "strategy": {"name": strategy},
        "parallel": _overlay(_load("strategy", strategy)["parallel"], opts["parallel"]),  # the preset's layout
        "quant": _quant(opts["quant"]),
        "compare": opts["compare"],
        "logger": _load("logger", opts["logger"]) or None,
        "precision": str(precision),
        "seed": int(opts["seed_everything"]),
        "output_dir": output_dir,
        **{k: opts[k] for k in {key.split(".")[0] for key, _, _ in _plain_fields(config.ValidateConfig)}},
    }
    try:
        typed = OmegaConf.merge(OmegaConf.structured(config.ValidateConfig), cfg)
    except OmegaConfBaseException as err:
        raise config.ConfigError(config.error_line(err)) from None
    config.check(typed)
    return typed


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
        line, code = exit_for(err) if isinstance(err, USER_ERRORS) else (f"lit-ppl: error: {err}", 1)
        print(line, file=sys.stderr)
        sys.exit(code)
    os.environ[OUTPUT_DIR_ENV] = cfg.output_dir  # inherited by the ranks Lightning relaunches
    # Hydra's decorated main runs its task function directly on a config passed to it: the same signal handling,
    # resume, exit codes and one-line errors as `python -m lit_ppl.validate`.
    validate_main(cfg)


if __name__ == "__main__":
    main()
