"""``lit-ppl validate``: the Hydra entry's evaluation, configured the LightningCLI way (flags and YAML files).

::

    lit-ppl validate                                        # the offline default: built-in model, demo text
    lit-ppl validate --model.path ../shared/data/stories260K --data.path story.txt --eval.seq_len 512
    lit-ppl validate --config configs/cli/stories260k.yaml --trainer.precision bf16-mixed --quant.name int8
    lit-ppl validate --print_config > mine.yaml             # every option, with its default

The options are the schema's keys (:mod:`lit_ppl.config`) with their types and allowed values, ``--trainer.*``
Lightning's ``Trainer``. jsonargparse parses them; Hydra composes ``conf/`` from the overrides they stand for:
``--eval.mode sliding`` is ``eval=sliding``, ``--quant.name int4`` ``quant=int4`` (``--quant.method awq``
``quant=awq``), ``--trainer.strategy tp`` ``strategy=tp``, ``--logger csv`` ``logger=csv``, then ``key=value``
for every option given; an option left unset takes its group file's value (``conf/validate.yaml``'s outside a
group). The run is the Hydra entry's task function, :func:`lit_ppl.validate.main`, on that config: the same
objects, checks, signal handling and resume, error messages and ``results.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import time
from typing import Any, Literal

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_ppl import config
from lit_ppl.config.guard import guarded_composition
from lit_ppl.config.options import given, hydra_value, leaf_fields, option_type, options
from lit_ppl.data.sources import DataSpec
from lit_ppl.errors import LitPplError
from lit_ppl.model.spec import ModelSpec
from lit_ppl.quant.methods import METHODS
from lit_ppl.run import USER_ERRORS, evaluate, exit_for
from lit_ppl.validate import conf_dir
from lit_ppl.validate import main as validate_main

SUBCOMMANDS = ("validate",)
# Ranks that Lightning relaunches re-run this command line; they read the default output dir from here so that
# all ranks of one run agree on it even when they start in different seconds.
OUTPUT_DIR_ENV = "LIT_PPL_OUTPUT_DIR"
# Options that are not the schema key of the same name (LightningCLI's, or mapped), and keys set from those options.
MAPPED_OPTIONS = ("config", "trainer", "seed_everything", "logger", "output_dir")
MAPPED_KEYS = ("trainer", "strategy", "logger", "precision", "seed", "output_dir")

EvalOptions = options(config.EvalConfig, __name__, keep=("mode",))
QuantOptions = options(config.QuantConfig, __name__)
CalibrationOptions = {f.name: f.type for f in dataclasses.fields(QuantOptions)}["calibration"]
CompareOptions = options(config.CompareConfig, __name__)
ParallelOptions = options(config.ParallelConfig, __name__)
GROUPS = {"model": ModelSpec, "data": DataSpec, "eval": EvalOptions, "quant": QuantOptions}
GROUPS |= {"compare": CompareOptions, "parallel": ParallelOptions}


def quant_preset(name: str | None, method: str | None) -> str:
    """The ``conf/quant/`` file ``--quant.name``/``--quant.method`` select: the method's own, else the name's."""
    return method if method in METHODS and METHODS[method].preset else name or "none"


def compose_validate(overrides: list[str], hydra: bool = False) -> DictConfig:
    """``conf/validate.yaml`` composed by Hydra with ``overrides``, checked by lit-ppl's guard as the Hydra entry's is.
    ``hydra``: keep the ``hydra`` node (its ``runtime.choices`` name each group's option)."""
    try:
        with guarded_composition(), initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            return compose("validate", overrides=overrides, return_hydra_config=hydra)
    except (HydraException, OmegaConfBaseException) as err:
        raise config.ConfigError(config.error_line(err)) from None


@functools.cache
def _defaults() -> dict[str, Any]:
    """The config Hydra composes without overrides (unresolved): every option's default comes from it."""
    return OmegaConf.to_container(compose_validate([], hydra=True))


class PerplexityCLI(LightningCLI):
    """LightningCLI for ``lit-ppl validate``: parses the options, then has Hydra compose the config they describe.

    ``run=False``: Lightning's own subcommands would call ``trainer.validate`` on objects the CLI built; here
    the Hydra entry's code builds and runs them from :attr:`hydra_config`, so both entries share one code path.
    """

    def __init__(self, args: list[str] | None = None) -> None:
        defaults = _defaults()
        super().__init__(
            trainer_defaults={**defaults["trainer"], "precision": defaults["precision"]},
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
        defaults = _defaults()
        for key, cls in GROUPS.items():
            parser.add_class_arguments(cls, key, instantiate=False)
        parser.add_argument(
            "--logger",
            type=Literal[config.LOGGERS],
            default=defaults["hydra"]["runtime"]["choices"]["logger"] or "none",
            help="An experiment logger, as logger= of the Hydra entry (conf/logger/).",
        )
        for key, f, kind in leaf_fields(config.ValidateConfig, skip=(*GROUPS, *MAPPED_KEYS)):
            doc = f.metadata.get("doc") or f"as {key} in conf/validate.yaml"
            default = functools.reduce(dict.__getitem__, key.split("."), defaults)
            parser.add_argument(f"--{key}", type=option_type(f, kind), default=default, help=f"{doc}.")
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
        # Checked by the schema as the Hydra entry's config is.
        self.hydra_config = compose_validate(overrides(self.config, self.parser.get_defaults()))
        config.check(self.hydra_config)


def _trainer_args(trainer: dict[str, Any]) -> dict[str, Any]:
    """The Trainer arguments to pass on: the device counts, and every other one given (refused if lit-ppl sets it)."""
    signature = inspect.signature(Trainer.__init__).parameters
    passed = {
        k: v for k, v in trainer.items() if k in ("accelerator", "devices", "num_nodes") or v != signature[k].default
    }
    if isinstance(passed["devices"], str) and passed["devices"].isdigit():
        passed["devices"] = int(passed["devices"])  # jsonargparse reads --trainer.devices=2 as str (a valid type)
    for key, value in passed.items():
        if key in config.OWNED_TRAINER_ARGS:
            raise LitPplError(f"--trainer.{key} is set by lit-ppl itself; leave it out")
        if not isinstance(value, str | int | float | bool | type(None) | list):
            raise LitPplError(f"--trainer.{key}={value!r}: only plain values are passed on to the Trainer")
    return passed


def overrides(ns: Any, defaults: Any) -> list[str]:
    """The Hydra overrides that the parsed options ``ns`` describe: each group's option, then ``key=value`` for the
    Trainer's arguments, precision, seed, output dir and every other option given (not at its default)."""
    opts = ns.as_dict()
    trainer = dict(opts["trainer"])
    strategy, precision = trainer.pop("strategy"), trainer.pop("precision")
    if strategy not in config.STRATEGY_NAMES:
        raise LitPplError(f"--trainer.strategy={strategy!r} is not one of {', '.join(config.STRATEGY_NAMES)}")
    quant, logger = opts["quant"], opts["logger"]
    groups = {"eval": opts["eval"]["mode"], "strategy": strategy, "quant": quant_preset(quant["name"], quant["method"])}
    if logger != "none":  # none is conf/validate.yaml's logger: null
        groups["logger"] = logger
    output_dir = opts["output_dir"] or os.environ.get(OUTPUT_DIR_ENV) or time.strftime("outputs/cli/%Y-%m-%d/%H-%M-%S")
    values = {f"trainer.{k}": v for k, v in _trainer_args(trainer).items()}
    values |= {"precision": str(precision), "seed": int(opts["seed_everything"]), "output_dir": output_dir}
    values |= given({k: v for k, v in opts.items() if k not in MAPPED_OPTIONS}, defaults.as_dict())
    return [*(f"{k}={v}" for k, v in groups.items()), *(f"++{k}={hydra_value(v)}" for k, v in values.items())]


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
