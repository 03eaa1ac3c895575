"""Walking the config schema: its fields and types, checks over a resolved node, one line for OmegaConf's errors.

Each function takes the dataclass it starts from (``root``: :class:`lit_ppl.config.schema.ValidateConfig` for the
whole config, :class:`lit_ppl.config.quant.RuleConfig` for one rule), so the whole config and one of its untyped
nodes are checked and explained alike. :func:`lit_ppl.config.check` and :func:`lit_ppl.config.error_line` apply
them to the whole config.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from lit_ppl.config.values import LOGGER_ARGS, TRAINER_ARGS, ConfigError, unknown_key

# ---------------------------------------------------------------------------------------------------------------
# Reading the schema


def schema_fields(schema: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """``(field, resolved type)`` of each field of a schema dataclass."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        yield f, hints[f.name]


def nested_schema(kind: Any) -> type | None:
    """The schema dataclass a field of type ``kind`` holds (``X`` and ``X | None`` alike), or ``None``."""
    if dataclasses.is_dataclass(kind):
        return kind
    inner = [a for a in typing.get_args(kind) if a is not type(None)]
    return inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else None


def node_schema(root: type, path: str) -> type | None:
    """The schema of the node at dotted ``path`` below ``root`` (``""``: ``root``; ``quant.rules[0]``: a rule)."""
    schema: type | None = root
    for part in [p for p in re.sub(r"\[\d+\]", "", path).split(".") if p]:
        found = {f.name: (f, kind) for f, kind in schema_fields(schema)}.get(part) if schema else None
        # An untyped field (a union) names the schema its nodes are checked against in its metadata.
        schema = None if found is None else nested_schema(found[1]) or found[0].metadata.get("schema")
    return schema


def valid_keys(root: type, path: str, node: Any = None) -> tuple[str, ...]:
    """The keys the node at ``path`` may hold: its schema's fields, Trainer or logger arguments, else ``node``'s."""
    schema = node_schema(root, path)
    if schema is not None:
        return tuple(f.name for f in dataclasses.fields(schema))
    if path == "trainer":
        return tuple(TRAINER_ARGS)
    if path == "logger" and isinstance(node, DictConfig):
        return ("_target_", *LOGGER_ARGS.get(str(node.get("_target_")), ()))
    return tuple(str(k) for k in node) if isinstance(node, DictConfig) else ()


def type_name(f: dataclasses.Field, kind: Any) -> str:
    """The type of a field as --help and the error lines print it."""
    choices = f.metadata.get("choices", ())
    if choices:
        optional = type(None) in typing.get_args(kind)
        return " | ".join(str(c) for c in choices) + (" | null" if optional else "")
    return f.metadata.get("shown") or str(f.type).replace("None", "null")


# ---------------------------------------------------------------------------------------------------------------
# Checking a resolved node


def typed_copy(schema: type, value: dict[str, Any], key: str) -> dict[str, Any]:
    """``value`` merged into ``schema``'s defaults, as a plain dict: unknown keys and wrong types raise ConfigError.

    ``key`` is where ``value`` sits in the config (``quant.rules[0]``), for the error line.
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), value)
    except OmegaConfBaseException as err:
        raise ConfigError(omegaconf_line(err, schema, prefix=key)) from None
    return OmegaConf.to_container(merged)


def check_fields(schema: type, plain: dict[str, Any], prefix: str) -> None:
    """Allowed values and the ``check`` functions of ``schema``'s fields over ``plain`` (a resolved node)."""
    known = {f.name for f in dataclasses.fields(schema)}
    for name in plain:
        if name not in known:  # the root is untyped when Hydra merges it (+foo=1 passes composition)
            raise ConfigError(
                unknown_key(f"{prefix}{'.' if prefix else ''}{name}", [f.name for f in dataclasses.fields(schema)])
            )
    for f, kind in schema_fields(schema):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = plain.get(f.name)
        choices = f.metadata.get("choices", ())
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(str(c) for c in choices)}")
        if f.metadata.get("check"):
            f.metadata["check"](key, value)
        inner = nested_schema(kind)
        if inner is not None and isinstance(value, dict):
            check_fields(inner, value, key)


# ---------------------------------------------------------------------------------------------------------------
# One line for OmegaConf's errors


def omegaconf_line(err: OmegaConfBaseException, root: type, prefix: str = "") -> str:
    """One line for OmegaConf's error on a key of a node of schema ``root`` (``prefix``: where that node sits in
    the config, ``""`` for the whole config)."""
    key = str(err.full_key or err.key or "")
    full_key = ".".join(p for p in (prefix, key) if p)
    msg = next(iter(str(err.msg or err).splitlines()), type(err).__name__)
    if isinstance(err, MissingMandatoryValue):
        return f"{full_key} is required: set {full_key}=VALUE"
    if isinstance(err, ConfigKeyError | ConfigAttributeError):
        parent, _, name = key.rpartition(".")
        valid = valid_keys(root, parent, err.parent_node)
        if name in valid:  # a free-form node (trainer, logger, compare.reference) that lacks the key so far
            return f"{full_key} is not in this config yet: add it with +{full_key}=VALUE"
        return unknown_key(full_key, valid)
    if isinstance(err, ValidationError):
        value = "null" if err.value is None else repr(err.value)
        return f"{full_key}={value} is not {_expected(root, key)}"
    return f"{full_key}: {msg}" if full_key else msg


def _expected(root: type, key: str) -> str:
    """``of type int`` for a schema key (dotted, below ``root``), from its field."""
    parent, _, name = key.rpartition(".")
    schema = node_schema(root, parent.split("[")[0])
    for f, kind in schema_fields(schema) if schema else ():
        if f.name == name.split("[")[0]:
            return f"of type {type_name(f, kind)}"
    return "of the type this key takes"
