"""The documentation site: ``mkdocs build --strict`` passes (no broken link, missing page or stale anchor), its
generated references list every config key of the schema and every ``results.json`` key of
:data:`lit_ppl.report.keys.RESULT_KEYS`, that table matches what real runs write, and README.md's links land.

Every command of README.md and docs/ composing is tests/test_config.py's ``test_readme_commands_compose``.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from lit_ppl.config.schema import ValidateConfig
from lit_ppl.report.keys import RESULT_KEYS


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built once for this module, as CI builds it: strict, from the checkout's code."""
    out = tmp_path_factory.mktemp("site")
    env = os.environ | {"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _first_cells(page: Path, skip_tables: int = 0) -> set[str]:
    """The code in the first cell of every table row of a built page (the key column), after ``skip_tables``."""
    text = page.read_text(encoding="utf-8").split("</table>", skip_tables)[-1]
    return {html.unescape(c) for c in re.findall(r"<tr>\s*<td><code>(.*?)</code></td>", text)}


def _schema_keys(schema: type, prefix: str = "") -> typing.Iterator[str]:
    """Every key below ``schema``, walked here from the dataclasses themselves (not with the hook's walker): nested
    dataclasses, and the schema an untyped field's metadata names (``quant.rules[]``, ``compare.reference``)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, kind = f"{prefix}{f.name}", hints[f.name]
        inner = [a for a in (kind, *typing.get_args(kind)) if dataclasses.is_dataclass(a)]
        if inner:
            yield from _schema_keys(inner[0], f"{key}.")
            continue
        yield key
        listed = f.metadata.get("schema")
        if listed is not None:
            yield from _schema_keys(
                listed, f"{key}[]." if typing.get_origin(kind) is list or "list" in str(f.type) else f"{key}."
            )


def test_site_builds_strict_and_the_config_reference_lists_every_schema_key(site):
    keys = list(_schema_keys(ValidateConfig))
    assert {"model.path", "quant.rules[].role", "compare.reference.quant.calibration.path", "trainer"} <= set(keys)
    shown = _first_cells(site / "reference" / "config" / "index.html", skip_tables=1)  # after the groups
    missing = [k for k in keys if k not in shown]
    assert not missing, missing


def test_the_results_reference_lists_every_key(site):
    shown = _first_cells(site / "reference" / "results" / "index.html")
    missing = [r.key for r in RESULT_KEYS if r.key not in shown]
    assert not missing, missing
    assert len({r.key for r in RESULT_KEYS}) == len(RESULT_KEYS)  # no key listed twice


def test_readme_links_land(site):
    """README.md's relative links name files that exist, and anchors into the site that its pages have."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", text)
    assert len(links) >= 10
    for target, anchor in links:
        assert (ROOT / target).exists(), target
        if anchor:
            page = site / Path(target).relative_to("docs").with_suffix("") / "index.html"
            if target == "docs/index.md":
                page = site / "index.html"
            assert f'id="{anchor}"' in page.read_text(encoding="utf-8"), f"{target}#{anchor}"


def test_every_file_the_docs_name_exists():
    """Every path into the checkout that README.md and docs/ write in code (`lit_ppl/config/guard.py`,
    `benchmarks/startup.py`) exists: a file moved or removed leaves no stale pointer behind."""
    named = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        named |= set(re.findall(r"`((?:lit_ppl|tests|benchmarks|conf|configs|slurm|docs|\.ci)/[\w./-]*)`", text))
    assert len(named) > 20, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


# Keys the docs name on purpose as wrong: the example of an unknown key's one-line error.
WRONG_ON_PURPOSE = {"eval.strid"}


def test_every_key_the_docs_name_exists():
    """Every dotted key README.md and docs/ write in code (`quant.group_size`, `eval.stride=512`) below a config
    node is a key of the schema, or of results.json (`compare.kld_mean`, or below a node its table describes
    whole, such as `quant.calibration.gptq`)."""
    keys = set(_schema_keys(ValidateConfig))
    nodes = {k.split(".")[0] for k in keys} - {"trainer", "logger"}  # those two take their library's arguments
    whole = {r.key for r in RESULT_KEYS if r.type.startswith("dict")}
    named, unknown = 0, []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for key in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+|\[\d+\])+)(?:=[^`]*)?`", path.read_text(encoding="utf-8")):
            if key.split(".")[0] not in nodes:
                continue
            named += 1
            key = re.sub(r"\[\d+\]", "[]", key)
            parents = {".".join(key.split(".")[:i]) for i in range(1, key.count(".") + 1)}
            if not (
                key in keys or any(p.match(key) for _, p in PATTERNS) or parents & whole or key in WRONG_ON_PURPOSE
            ):
                unknown.append(f"{path.relative_to(ROOT)}: {key}")
    assert named > 100, named
    assert not unknown, unknown


# ------------------------------------------------------------------------------------------------------------------
# RESULT_KEYS against what real runs write

# Documented keys no run below writes, and where they are written.
NOT_WRITTEN_HERE = {"quant.auto": "quant=auto runs only (tests/test_auto.py)"}


def _pattern(key: str) -> re.Pattern:
    """A table key as a regex: ``*`` is a percentile's number (``kld_p*``: ``kld_p99.9``), ``[]`` literal."""
    return re.compile(re.escape(key).replace(r"\*", r"[0-9]+(\.[0-9]+)?") + "$")


PATTERNS = [(r, _pattern(r.key)) for r in RESULT_KEYS]


def _written(value: dict[str, Any], prefix: str = "") -> typing.Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of a results document, descending only into the nodes the table lists keys of."""
    for name, v in value.items():
        key = f"{prefix}{name}"
        yield key, v
        if isinstance(v, dict) and any(r.key.startswith(f"{key}.") for r in RESULT_KEYS):
            yield from _written(v, f"{key}.")
        elif isinstance(v, list) and any(r.key.startswith(f"{key}[].") for r in RESULT_KEYS):
            for element in v:
                yield from _written(element, f"{key}[].")


def _type_ok(value: Any, declared: str) -> bool:
    for kind in declared.split(" | "):
        base = kind.split("[")[0]
        if (
            (base == "null" and value is None)
            or (base == "bool" and isinstance(value, bool))
            or (base == "int" and isinstance(value, int) and not isinstance(value, bool))
            or (base == "float" and isinstance(value, int | float) and not isinstance(value, bool))
            or (base == "str" and isinstance(value, str))
            or (base == "list" and isinstance(value, list))
            or (base == "dict" and isinstance(value, dict))
        ):
            return True
    return False


@pytest.mark.slow
def test_result_keys_are_what_real_runs_write(compose, tmp_path):
    """Three runs of the built-in model write every key but ``NOT_WRITTEN_HERE``: a plain one saving a reference
    with per-token files, ``quant=int8`` against that saved reference, and against a live int8 reference. Every
    key they write is in the table with its type, and every key of the table is written."""
    from lit_ppl.run import evaluate

    ref = tmp_path / "ref"
    runs = [
        evaluate(
            compose(
                "eval.seq_len=64",
                f"save_reference={ref}",
                "report.per_token=true",
                "report.per_document=csv",
                f"output_dir={tmp_path / 'a'}",
            )
        ),
        evaluate(
            compose(
                "eval.seq_len=64",
                "quant=int8",
                "compare=saved",
                f"compare.reference.store={ref}",
                f"output_dir={tmp_path / 'b'}",
            )
        ),
        evaluate(
            compose(
                "eval.seq_len=64",
                "quant=int8",
                "compare=unquantized",
                "compare.reference.quant.name=int8",
                f"output_dir={tmp_path / 'c'}",
            )
        ),
    ]
    written: dict[str, list[Any]] = {}
    for result in runs:
        for key, value in _written(result):
            written.setdefault(key, []).append(value)
    unlisted, mistyped = [], []
    for key, values in written.items():
        row = next((r for r, p in PATTERNS if p.match(key)), None)
        if row is None:
            unlisted.append(key)
        else:
            mistyped += [f"{key}={v!r} is not {row.type}" for v in values if not _type_ok(v, row.type)]
    assert not unlisted, f"results.json keys missing from lit_ppl/report/keys.py: {unlisted}"
    assert not mistyped, mistyped
    never = [r.key for r, p in PATTERNS if r.key not in NOT_WRITTEN_HERE and not any(p.match(k) for k in written)]
    assert not never, f"listed in lit_ppl/report/keys.py but written by none of the runs: {never}"
