"""The typed schema of the Hydra config tree, registered in Hydra's ``ConfigStore``, and its checks.

``conf/validate.yaml``'s defaults list starts with ``base_validate`` (:class:`ValidateConfig`), so every group
option, preset and ``key=value`` override is merged into these typed nodes while Hydra composes: an unknown key
(``eval.strid=128``, ``+eval.frobnicate=1``) or a value of the wrong type (``eval.seq_len=x``) fails there, before
anything is built. The YAML files stay the presets users read; the schema says what each key is.

OmegaConf 2.3 types scalars, lists, dicts and nested dataclasses, but not unions (``batch_size`` is an int or
``auto``), allowed values (``eval.mode``), nor the keyword arguments of Lightning's ``Trainer`` and loggers.
:func:`check` checks those right after composition, from the metadata of the same fields, and
:func:`error_line` turns Hydra's and OmegaConf's multi-line composition errors into one line naming the valid
keys. ``python -m lit_ppl.validate --help`` is rendered from the same fields (:func:`help_text`).

This module is the config's public face; the parts live in :mod:`lit_ppl.config.values` (allowed values, Trainer
and logger arguments, per-value checks), :mod:`lit_ppl.config.schema` and :mod:`lit_ppl.config.quant` (the
dataclasses), :mod:`lit_ppl.config.fields` (walking the schema, one-line errors), :mod:`lit_ppl.config.help` and
:mod:`lit_ppl.config.options` (the Lightning CLI's options, given back as Hydra overrides).

Torch-free on purpose: ``--help`` and ``--cfg job`` import this module, never torch or Lightning.
"""

from __future__ import annotations

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_ppl.config.fields import check_fields, nested_schema, omegaconf_line, schema_fields
from lit_ppl.config.guard import check_targets
from lit_ppl.config.help import help_resolver, help_text
from lit_ppl.config.quant import CompareConfig, QuantConfig
from lit_ppl.config.schema import EvalConfig, ParallelConfig, ValidateConfig
from lit_ppl.config.values import LOGGERS, OWNED_TRAINER_ARGS, STRATEGY_NAMES, ConfigError

# What the entries (lit_ppl.validate, lit_ppl.cli) use as ``config.NAME``; the rest is in the modules above.
__all__ = [
    "LOGGERS",
    "OWNED_TRAINER_ARGS",
    "SCHEMA_NAME",
    "STRATEGY_NAMES",
    "CompareConfig",
    "ConfigError",
    "EvalConfig",
    "ParallelConfig",
    "QuantConfig",
    "ValidateConfig",
    "check",
    "error_line",
    "help_text",
    "nested_schema",
    "register",
    "schema_fields",
]

SCHEMA_NAME = "base_validate"  # the first entry of conf/validate.yaml's defaults list


def register() -> None:
    """Put the schema in Hydra's ConfigStore and the ``--help`` renderer in OmegaConf's resolvers (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=ValidateConfig)
    OmegaConf.register_new_resolver("lit_ppl_help", help_resolver, replace=True)


def check(cfg: DictConfig) -> None:
    """Check a composed config against the schema: what composition could not (unions, allowed values, Trainer and
    logger arguments, values left ``???``, interpolations that resolve to the wrong type). Raises ConfigError."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        raise ConfigError(omegaconf_line(err, ValidateConfig)) from None
    plain.pop("hydra", None)
    check_targets(plain, plain.get("allow_any_target", False))  # a _target_ is an import and a call
    check_fields(ValidateConfig, plain, "")


def error_line(err: BaseException) -> str:
    """One line for an error raised while Hydra composed the config (unknown key, wrong type, missing option)."""
    from hydra.errors import MissingConfigException, OverrideParseException

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, MissingConfigException):
            first = str(seen).strip().splitlines()[0]
            return f"{first} (valid options: {', '.join(seen.options)})" if seen.options else first
        if isinstance(seen, OverrideParseException):
            return str(seen).strip().splitlines()[0]
        if isinstance(seen, OmegaConfBaseException):
            return omegaconf_line(seen, ValidateConfig)
        if isinstance(seen, yaml.MarkedYAMLError) and seen.problem_mark is not None:
            mark = seen.problem_mark
            return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({seen.problem})"
        seen = seen.__cause__ or seen.__context__
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


register()
