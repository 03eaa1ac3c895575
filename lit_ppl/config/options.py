"""The schema as the Lightning CLI's options (:mod:`lit_ppl.cli`), and the values given back as Hydra overrides.

Each field of a schema dataclass is a jsonargparse option of the field's type and allowed values; each value given
on the command line goes back to Hydra as ``++key=value``, so that Hydra composes the CLI's config from ``conf/``
exactly as it composes the Hydra entry's.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator
from typing import Any, Literal

from lit_ppl.config.fields import nested_schema, schema_fields


def option_type(f: dataclasses.Field, kind: Any) -> Any:
    """The jsonargparse type of a schema field: its allowed values as a Literal, its union, or its own type."""
    choices = f.metadata.get("choices", ())
    if choices:
        allowed = Literal[choices]  # Literal[("a", "b")] is Literal["a", "b"]
        return allowed | None if type(None) in typing.get_args(kind) else allowed
    return f.metadata.get("union", kind)


def options(schema: type, module: str, keep: tuple[str, ...] = ()) -> type:
    """A dataclass of ``schema``'s fields for jsonargparse (in ``module``), each ``None`` by default: an option left
    unset takes the group file's value. Fields named in ``keep`` (the one that picks the file) keep the schema's
    default."""
    specs: list[tuple[str, Any, Any]] = []
    lines = [(schema.__doc__ or "").strip(), "", "Attributes:"]
    for f, kind in schema_fields(schema):
        inner = nested_schema(kind)
        if inner is not None:
            nested = options(inner, module)
            specs.append((f.name, nested, dataclasses.field(default_factory=nested)))
        elif f.name in keep:
            specs.append((f.name, option_type(f, kind), f.default))
        else:
            specs.append((f.name, option_type(f, kind) | None, None))
        lines.append(f"    {f.name}: {f.metadata.get('doc') or f.name}")
    name = schema.__name__.replace("Config", "Options")
    cls = dataclasses.make_dataclass(name, specs)
    cls.__doc__, cls.__module__ = "\n".join(lines), module  # jsonargparse's help reads the Attributes
    return cls


def leaf_fields(schema: type, skip: tuple[str, ...], prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """``(dotted key, field, type)`` of each leaf of ``schema`` outside the top-level fields named in ``skip``."""
    for f, kind in schema_fields(schema):
        key = f"{prefix}{f.name}"
        if prefix or f.name not in skip:
            inner = nested_schema(kind)
            yield from leaf_fields(inner, skip, f"{key}.") if inner is not None else [(key, f, kind)]


def given(values: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of each value that is not its default, following the nesting of ``defaults``.

    >>> dict(given({"eval": {"seq_len": 64, "stride": None}, "seed": 0}, {"eval": {"seq_len": None}, "seed": 0}))
    {'eval.seq_len': 64}
    """
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            yield from given(value, default, f"{prefix}{key}.")
        elif value != default:
            yield f"{prefix}{key}", value


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar. A string is quoted, so that it stays the one string it is whatever it
    holds (``123``, a comma, a quote); a backslash is doubled only where Hydra reads one, before a quote.

    >>> print(hydra_value("a b,c"), hydra_value("123"), hydra_value("it's\\\\"), hydra_value([1.5, None, True]))
    'a b,c' '123' 'it\\'s\\\\' [1.5,null,true]
    >>> print(hydra_value([{"role": "mlp", "config": "int8"}]))
    [{role:'mlp',config:'int8'}]
    """
    if isinstance(value, str):
        body = re.sub(r"(\\*)'", lambda m: 2 * m[1] + "\\'", value)
        return f"'{body}{(len(body) - len(body.rstrip(chr(92)))) * chr(92)}'"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(hydra_value, value)) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
