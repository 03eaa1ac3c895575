"""MkDocs hooks: the config reference and the results.json reference, generated from the code at every build.

A page holds a marker (``<!-- lit-ppl:config-reference -->``, ``<!-- lit-ppl:results-reference -->``) where the
table goes; nothing generated is checked in, so the pages cannot drift from the schema
(:mod:`lit_ppl.config.schema`, :mod:`lit_ppl.config.quant`) or from :data:`lit_ppl.report.keys.RESULT_KEYS`.
The config tables walk the schema with the functions ``python -m lit_ppl.validate --help`` uses
(:mod:`lit_ppl.config.help`), so a key's type, value and meaning read the same in both.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CONFIG_MARKER = "<!-- lit-ppl:config-reference -->"
RESULTS_MARKER = "<!-- lit-ppl:results-reference -->"


def _cell(text: Any) -> str:
    """A value inside a Markdown table cell, as code (Python-Markdown's tables keep a code span's pipes)."""
    text = str(text).replace("`", "'")
    return f"`{text}`" if text else ""


def _text(text: str) -> str:
    """Prose inside a Markdown table cell: pipes escaped."""
    return text.replace("|", "\\|")


def _value(value: Any) -> str:
    """A default as YAML's flow style writes it (``[none, int8, int4]``), as --help does for scalars."""
    from lit_ppl.config.help import _shown

    if isinstance(value, list | dict):
        import yaml

        return yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return _shown(value)


def _composed() -> dict[str, Any]:
    """``python -m lit_ppl.validate``'s config with no overrides, unresolved (``output_dir`` stays Hydra's)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lit_ppl.validate import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return OmegaConf.to_container(compose("validate"))


def config_rows(schema: type, node: dict[str, Any] | None, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    """``(key, type, value, meaning)`` of every key below ``schema``: nested nodes and the nodes an untyped field's
    metadata names (``quant.rules[]``, ``compare.reference``) walked, their value from ``node`` else the schema."""
    import dataclasses

    from omegaconf import MISSING

    from lit_ppl.config.fields import nested_schema, schema_fields, type_name
    from lit_ppl.config.values import LOGGERS, TRAINER_ARGS

    node = node if isinstance(node, dict) else {}
    for f, kind in schema_fields(schema):
        key, doc = f"{prefix}{f.name}", f.metadata.get("doc", "")
        inner, listed = nested_schema(kind), f.metadata.get("schema")
        if key == "trainer":
            yield (
                key,
                "dict",
                _value(node.get(f.name) or {}),
                f"{doc}; `+trainer.ARG=value` for any of: " + ", ".join(f"`{a}`" for a in TRAINER_ARGS),
            )
        elif key == "logger":
            yield (
                key,
                " | ".join(LOGGERS),
                "none",
                f"{doc}: `logger=NAME`; `logger.KEY` the chosen logger's arguments",
            )
        elif inner is not None:
            yield from config_rows(inner, node.get(f.name), f"{key}.")
        elif listed is not None:  # an untyped node checked against a schema: a list of them, or one
            yield key, type_name(f, kind), _value(node.get(f.name, f.default)), doc
            yield from config_rows(listed, None, f"{key}[]." if "list" in str(f.type) else f"{key}.")
        else:
            if f.name in node:
                value = node[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING
            yield key, type_name(f, kind), _value(value), doc


def config_reference() -> str:
    """The config groups and one table per top-level node: every key, its type, its value with no overrides, its
    meaning."""
    from lit_ppl.config.schema import ValidateConfig
    from lit_ppl.validate import conf_dir

    composed = _composed()
    groups = sorted(p for p in Path(conf_dir()).iterdir() if p.is_dir() and p.name != "hydra" and "_" not in p.name)
    lines = ["## Config groups", "", "| group | options |", "|---|---|"]
    for group in groups:
        options = sorted(p.stem for p in group.glob("*.yaml"))
        lines.append(f"| `{group.name}` | {', '.join(f'`{o}`' for o in options)} |")
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in config_rows(ValidateConfig, composed, ""):
        top = row[0].split(".")[0]
        sections.setdefault(top if "." in row[0] else "top-level keys", []).append(row)
    for title, rows in sections.items():
        lines += ["", f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [f"| `{k}` | {_cell(t)} | {_cell(v)} | {_text(m)} |" for k, t, v, m in rows]
    return "\n".join(lines) + "\n"


def results_reference() -> str:
    """``results.json``'s keys, type and meaning, in the order :data:`RESULT_KEYS` lists them."""
    from lit_ppl.report.keys import RESULT_KEYS

    lines = ["| key | type | meaning |", "|---|---|---|"]
    lines += [f"| `{r.key}` | {_cell(r.type)} | {_text(r.meaning)} |" for r in RESULT_KEYS]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    # Here, not at import: MkDocs restores sys.path once it has loaded the hooks. The checkout's lit_ppl, not an
    # installed copy.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if RESULTS_MARKER in markdown:
        markdown = markdown.replace(RESULTS_MARKER, results_reference())
    return markdown
