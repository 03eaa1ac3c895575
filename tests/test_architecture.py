"""The package's rooms and their one-way imports, as docs/architecture.md ("Architecture of the code") draws them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_ppl"
# Bottom up: a room may import only itself and the rooms before it.
ORDER = (
    ("errors", "runtime"),
    ("config",),
    ("metrics",),
    ("parallel",),
    ("model",),
    ("data",),
    ("quant",),
    ("evaluation",),
    ("report",),
    ("doctor",),
    ("preflight", "run", "validate", "cli", "fetch", "__init__"),
)
LEVEL = {room: i for i, rooms in enumerate(ORDER) for room in rooms}
REPORT_MAY_IMPORT = {"errors", "runtime", "config", "metrics", "report"}


def _room(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "lit_ppl" and len(parts) > 1 and parts[1] in LEVEL:
                out.add(parts[1])
    return out


def _modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "conf" not in p.relative_to(PACKAGE).parts[:1]]


def test_every_room_is_in_the_order():
    rooms = {_room(p) for p in _modules()} - {"assets"}
    assert rooms <= set(LEVEL), rooms - set(LEVEL)


def test_imports_go_one_way():
    wrong = []
    for path in _modules():
        room = _room(path)
        for other in _imports(path):
            if LEVEL[other] > LEVEL[room] or (room == "report" and other not in REPORT_MAY_IMPORT):
                wrong.append(f"{path.relative_to(ROOT)} imports lit_ppl.{other}")
    assert not wrong, wrong


def test_the_top_holds_only_the_entries_and_the_orchestrator():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8 and set(top) == set(ORDER[-1]) | {"errors"}, top
    assert all(len(p.read_text().splitlines()) <= 350 for p in _modules())


def test_architecture_page_names_every_room():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("# Architecture of the code") :]
    for room in {_room(p) for p in _modules() if p.parent != PACKAGE} - {"assets"}:
        assert f"  {room}/" in section, room
    # Every module of a room is named on the page, so a newcomer finds it from the map.
    unnamed = [
        str(p.relative_to(ROOT))
        for p in _modules()
        if p.parent != PACKAGE and not p.stem.startswith("__") and not re.search(rf"\b{p.stem}\b", section)
    ]
    assert not unnamed, unnamed


def test_every_package_is_installed():
    """pyproject.toml lists the packages by name: a room (or a room inside one) left out would be missing from a
    plain ``pip install .``, though every test that runs from the checkout would pass."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
