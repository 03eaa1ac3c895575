"""Module sizes and the import graph of lit_ppl, from the source alone (nothing is imported).

Prints every ``lit_ppl`` module's line count, the lit_ppl-internal imports each one makes when it is imported
(module-level statements, including those under ``if``/``try`` and in class bodies, but not those inside a
function, which run lazily, nor under ``if TYPE_CHECKING:``), and every import cycle among them. An import names
its target module only (``from lit_ppl import x`` is ``lit_ppl.x`` when that is a module, ``lit_ppl`` otherwise);
the parent packages Python initializes on the way are not counted as edges.

    python benchmarks/imports.py                        # this checkout's lit_ppl/
    python benchmarks/imports.py --before /tmp/orig     # also the sizes of another tree, side by side
    python benchmarks/imports.py --max-lines 300        # modules above this are flagged (default 300)

Exit status: 1 when there is an import cycle (in the tree checked, not the ``--before`` one), else 0. Standard
library only: it runs without the project's virtual environment.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lit_ppl"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``package`` under ``root`` (subpackages included)."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.Module) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """The import statements run when the module is imported, and those inside functions (lazy)."""
    eager: list[ast.stmt] = []
    lazy: list[ast.stmt] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                (lazy if in_function else eager).append(child)
            elif isinstance(child, ast.If) and _type_checking(child.test):
                for stmt in child.orelse:  # the body never runs; an else branch does
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function)
            else:
                function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                visit(child, in_function or function)

    visit(tree, False)
    return eager, lazy


def targets(node: ast.stmt, here: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ``modules`` an import statement in module ``here`` names."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the package holding `here`
            anchor = here.split(".") if is_package else here.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    for name in names:
        # `import lit_ppl.a.b` names lit_ppl.a.b; an unknown tail (a class, a function) falls back to its module.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != here:
            found.add(name)
    return found


def analyse(root: Path, package: str = PACKAGE) -> dict[str, dict]:
    """Per module: ``lines``, ``imports`` (module-level, internal), ``lazy`` (inside functions), ``error``."""
    files = find_modules(root, package)
    names = set(files)
    out: dict[str, dict] = {}
    for name, path in files.items():
        text = path.read_text(encoding="utf-8")
        info: dict = {"lines": len(text.splitlines()), "imports": set(), "lazy": set(), "error": None}
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError as err:
            info["error"] = f"syntax error line {err.lineno}: {err.msg}"
        else:
            eager, lazy = import_nodes(tree)
            is_package = path.name == "__init__.py"
            info["imports"] = set().union(*(targets(n, name, is_package, names) for n in eager))
            info["lazy"] = set().union(*(targets(n, name, is_package, names) for n in lazy)) - info["imports"]
        out[name] = info
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_through(c, graph) for c in sorted(components)]


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One closed path ``[a, b, ..., a]`` inside a strongly connected component (breadth-first from its first)."""
    members, start = set(component), component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    return component


def short(name: str, package: str = PACKAGE) -> str:
    return name.removeprefix(package + ".") if name != package else name


def size_table(after: dict[str, dict], before: dict[str, dict] | None, max_lines: int) -> list[str]:
    rows = ["| module | lines |" if before is None else "| module | before | after | change |"]
    rows.append("|---|---:|" if before is None else "|---|---:|---:|---:|")
    for name in sorted(set(after) | set(before or {})):
        now = after[name]["lines"] if name in after else None
        flag = " **over**" if now is not None and now > max_lines else ""
        shown = "—" if now is None else f"{now}{flag}"
        if before is None:
            rows.append(f"| {short(name)} | {shown} |")
            continue
        then = before[name]["lines"] if name in before else None
        change = "new" if then is None else "removed" if now is None else f"{now - then:+d}" if now != then else ""
        rows.append(f"| {short(name)} | {'—' if then is None else then} | {shown} | {change} |")
    total = sum(m["lines"] for m in after.values())
    if before is None:
        rows.append(f"| **{len(after)} modules** | {total} |")
    else:
        total_before = sum(m["lines"] for m in before.values())
        rows.append(
            f"| **{len(before)} → {len(after)} modules** | {total_before} | {total} | {total - total_before:+d} |"
        )
    return rows


def graph_lines(info: dict[str, dict]) -> list[str]:
    lines = []
    for name in sorted(info):
        m = info[name]
        deps = ", ".join(short(d) for d in sorted(m["imports"])) or "-"
        lazy = f"   (lazy: {', '.join(short(d) for d in sorted(m['lazy']))})" if m["lazy"] else ""
        lines.append(f"{short(name)} -> {deps}{lazy}" + (f"   [{m['error']}]" if m["error"] else ""))
    return lines


def summary(info: dict[str, dict], max_lines: int, label: str) -> tuple[list[str], bool]:
    """Summary lines for one tree, and whether it has a cycle."""
    graph = {n: m["imports"] for n, m in info.items()}
    found = cycles(graph)
    edges = sum(len(d) for d in graph.values())
    lazy = sum(len(m["lazy"]) for m in info.values())
    big = sorted(((m["lines"], n) for n, m in info.items() if m["lines"] > max_lines), reverse=True)
    leaves = sum(not d for d in graph.values())
    lines = [
        f"{label}: {len(info)} modules, {sum(m['lines'] for m in info.values())} lines, {edges} module-level "
        f"internal imports ({leaves} modules import no other), {lazy} lazy (inside functions)",
        f"{label}: over {max_lines} lines: " + (", ".join(f"{short(n)} ({k})" for k, n in big) or "none"),
    ]
    lines += [f"{label}: unparsable {short(n)}: {m['error']}" for n, m in sorted(info.items()) if m["error"]]
    lines += [f"{label}: CYCLE {' -> '.join(short(n) for n in c)}" for c in found] or [f"{label}: no import cycle"]
    return lines, bool(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree holding lit_ppl/ (default: this checkout)")
    parser.add_argument("--before", type=Path, help="another tree (e.g. a `git worktree` of HEAD) to compare sizes")
    parser.add_argument("--max-lines", type=int, default=300, help="flag modules longer than this (default 300)")
    args = parser.parse_args(argv)
    after = analyse(args.root)
    if not after:
        parser.error(f"no {PACKAGE}/ under {args.root}")
    before = analyse(args.before) if args.before else None
    print("## Module sizes (lines)\n")
    print("\n".join(size_table(after, before, args.max_lines)))
    print("\n## Import graph (module-level lit_ppl imports; lazy ones in parentheses)\n")
    print("\n".join(graph_lines(after)))
    print("\n## Summary\n")
    if before is not None:
        print("\n".join(summary(before, args.max_lines, "before")[0]))
    lines, cyclic = summary(after, args.max_lines, "after" if before is not None else str(args.root))
    print("\n".join(lines))
    return 1 if cyclic else 0


if __name__ == "__main__":
    sys.exit(main())
