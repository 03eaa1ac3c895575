"""Compare finished runs: a table of their ``results.json``, exports, and a check that runs which should agree do.

::

    python -m lit_ppl.report RUN_DIR [RUN_DIR ...] [--markdown OUT.md] [--csv OUT.csv] [--plots] [--html OUT.html]

It also writes one self-contained HTML page of the runs (their table, and the frontier of weight bytes against
measured KLD), ``runs.html`` in the runs' common directory unless ``--html`` names another file.

The first run is the baseline of the ΔPPL columns. Runs that share the model, the data, the window (mode, seq_len,
stride), the precision and the quantization must give the same perplexity whatever their world size, strategy,
batch size or node count: every such pair whose PPL differs by more than ``--rel`` (relative) or whose token
counts differ is printed as a ``MISMATCH`` line.

Exit status: 0 when every checked pair agrees, 1 on a mismatch, 2 when a run cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_ppl.config.numbers import number_keys
from lit_ppl.errors import UserError
from lit_ppl.report.results import SCHEMA_VERSION, batch_size, quant_name
from lit_ppl.report.tables import print_runs_table, runs_markdown, to_csv
from lit_ppl.runtime.files import write_text_atomic

RESULTS = "results.json"
REQUIRED = ("ppl", "ppl_ci95", "tokens", "world_size", "strategy", "precision", "config")


class ReportError(UserError):
    """A run that cannot be reported on; the message is one line and names the file."""


def load_run(path: str | Path) -> dict[str, Any]:
    """Read a run's ``results.json`` and check it is a version this code understands.

    Args:
        path: the run directory, or the ``results.json`` file itself.

    Returns:
        The results, plus ``run`` (the path as given, without ``results.json``) and ``results_path``.

    Raises:
        ReportError: the file is missing, unreadable, not JSON, of another schema version or lacks a key.
    """
    path = Path(path)
    file = path if path.name == RESULTS or path.is_file() else path / RESULTS
    if not file.is_file():
        hint = "no such directory" if not file.parent.exists() else "a run directory holds one once its run finished"
        raise ReportError(f"{file}: no results.json ({hint})")
    try:
        results = json.loads(file.read_text())
    except OSError as err:
        raise ReportError(f"{file}: cannot read it: {err.strerror or err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ReportError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(results, dict):
        raise ReportError(f"{file}: expected a JSON object, found {type(results).__name__}")
    found = results.get("schema_version")
    if found != SCHEMA_VERSION:
        raise ReportError(f"{file}: schema_version {found!r}, but this lit-ppl reads version {SCHEMA_VERSION}")
    missing = [k for k in REQUIRED if k not in results]
    if missing:
        raise ReportError(f"{file}: lacks {', '.join(missing)}")
    label = str(file.parent) if path.name == RESULTS or path.is_file() else str(path)
    return {**results, "run": label, "results_path": str(file)}


def intervals_overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether the closed intervals ``a`` and ``b`` share a point."""
    return a[0] <= b[1] and b[0] <= a[1]


def compare_runs(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run, the first run being the baseline of ΔPPL and of the interval overlap.

    Args:
        runs: results as returned by :func:`load_run`.

    Returns:
        Rows with the keys of :data:`lit_ppl.report.tables.COLUMNS` (plus ``ci95_low``/``ci95_high``,
        ``num_nodes``, ``batch_size``); raw numbers, ``None`` where a value does not apply (the baseline's Δ, a
        run without a comparison).
    """
    rows = []
    base = runs[0] if runs else None
    for i, run in enumerate(runs):
        lo, hi = run["ppl_ci95"]
        compare = run.get("compare") or {}
        first = i == 0
        delta = None if first else run["ppl"] - base["ppl"]
        rows.append(
            {
                "run": run.get("run", f"run {i}"),
                "ppl": run["ppl"],
                "ci95_low": lo,
                "ci95_high": hi,
                "delta_ppl": delta,
                "delta_pct": None if first else 100.0 * delta / base["ppl"],
                "ci_overlap": None if first else intervals_overlap((lo, hi), base["ppl_ci95"]),
                "tokens": run["tokens"],
                "world_size": run["world_size"],
                "num_nodes": run.get("num_nodes", 1),
                "strategy": run["strategy"],
                "batch_size": batch_size(run),
                "precision": run["precision"],
                "quant": quant_name(run),
                "tokens_per_s": run.get("tokens_per_s"),
                "kld_mean": compare.get("kld_mean"),
                "same_top": compare.get("same_top"),
            }
        )
    return rows


def agreement_key(run: dict[str, Any]) -> str:
    """What decides a run's numbers: model, data, window, precision, quantization; never the parallel layout.

    Two runs with the same key must give the same PPL and token count whatever their world size, strategy,
    batch size or number of nodes.
    """
    cfg = run.get("config", {})
    known = {
        "model": cfg.get("model", run.get("model")),
        "data": cfg.get("data"),
        "eval": cfg.get("eval") or {k: run.get(k) for k in ("mode", "seq_len", "stride")},
        "precision": run["precision"],
        "quant": cfg.get("quant", {"name": quant_name(run)}),
    }
    return json.dumps(number_keys(known), sort_keys=True, default=str)


def agreement_groups(runs: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Indices of the runs that must agree, grouped by :func:`agreement_key`; only groups of two or more."""
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(agreement_key(run), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def describe(run: dict[str, Any]) -> str:
    """A run's name and parallel layout, e.g. ``runs/a (world 2 · ddp · batch 8 · 1 node)``."""
    nodes = run.get("num_nodes", 1)
    layout = f"world {run['world_size']} · {run['strategy']} · batch {batch_size(run)} · {nodes} node"
    return f"{run.get('run', '?')} ({layout}{'s' if nodes != 1 else ''})"


def consistency(runs: Sequence[dict[str, Any]], rel: float = 1e-6) -> list[str]:
    """``MISMATCH`` lines for runs that should agree but do not; empty when all agree.

    Each run of a group (see :func:`agreement_groups`) is checked against the group's first run.

    Args:
        runs: results as returned by :func:`load_run`.
        rel: the largest relative PPL difference still counted as agreement.
    """
    problems = []
    for group in agreement_groups(runs):
        a = runs[group[0]]
        for j in group[1:]:
            b = runs[j]
            diff = abs(b["ppl"] - a["ppl"]) / abs(a["ppl"]) if a["ppl"] else abs(b["ppl"])
            why = []
            if not diff <= rel:  # also catches NaN
                why.append(f"PPL {a['ppl']:.9g} vs {b['ppl']:.9g} (relative difference {diff:.2e} > {rel:g})")
            if a["tokens"] != b["tokens"]:
                why.append(f"tokens {a['tokens']:,} vs {b['tokens']:,}")
            if why:
                problems.append(f"MISMATCH {describe(a)} vs {describe(b)}: {'; '.join(why)}")
    return problems


def common_parent(paths: Sequence[str | Path]) -> Path:
    """The deepest directory containing every path (where a sweep's plot goes)."""
    parts = [Path(p).resolve().parts for p in paths]
    shared = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        shared.append(level[0])
    return Path(*shared) if shared else Path.cwd()


def write_plots(runs: Sequence[dict[str, Any]], out_dir: str | Path | None = None) -> list[Path]:
    """``nll_by_position.png`` next to each run's results that has the statistics; ``sweep.png`` for 2+ runs.

    Args:
        runs: results as returned by :func:`load_run`.
        out_dir: where ``sweep.png`` goes; default the deepest directory holding every run (a Hydra sweep's root).
    """
    from lit_ppl.report import plots

    written = []
    for run in runs:
        if run.get("nll_by_position"):
            path = Path(run["results_path"]).parent / "nll_by_position.png"
            written.append(plots.plot_nll_by_position(run["nll_by_position"], path, title=run["run"]))
    if len(runs) > 1:
        where = Path(out_dir) if out_dir else common_parent([Path(r["results_path"]).parent for r in runs])
        written.append(plots.plot_sweep(runs, where / "sweep.png"))
    return written


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lit_ppl.report",
        description="Compare runs' results.json; check that runs differing only in parallel layout agree.",
        epilog="exit status: 0 all agree, 1 a mismatch, 2 a run cannot be read",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or results.json files)")
    parser.add_argument("--markdown", metavar="OUT.md", help="also write the table as Markdown")
    parser.add_argument("--csv", metavar="OUT.csv", help="also write the table as CSV (raw numbers)")
    parser.add_argument("--plots", action="store_true", help="write PNG plots next to the results")
    parser.add_argument("--plots-dir", metavar="DIR", help="where sweep.png goes (default: the runs' common parent)")
    parser.add_argument(
        "--html", metavar="OUT.html", help="the HTML page's path (default: runs.html in the runs' common parent)"
    )
    parser.add_argument("--rel", type=float, default=1e-6, help="relative PPL tolerance of the check (default 1e-6)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    args = parse_args(argv)
    try:
        runs = [load_run(p) for p in args.runs]
    except ReportError as err:
        print(f"lit-ppl report: error: {err}", file=sys.stderr)
        return 2
    rows = compare_runs(runs)
    print_runs_table(rows)
    try:
        if args.markdown:
            write_text_atomic(args.markdown, runs_markdown(rows))
            print(f"markdown: {args.markdown}")
        if args.csv:
            print(f"csv: {to_csv(rows, args.csv)}")
        if args.plots:
            for path in write_plots(runs, args.plots_dir):
                print(f"plot: {path}")
        from lit_ppl.report.html import write_runs_page

        page = args.html or common_parent([Path(r["results_path"]).parent for r in runs]) / "runs.html"
        print(f"html: {write_runs_page(page, runs, rows)}")
    except OSError as err:
        print(f"lit-ppl report: error: cannot write {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    problems = consistency(runs, args.rel)
    groups = agreement_groups(runs)
    for line in problems:
        print(line)
    if problems:
        return 1
    if groups:
        checked = sum(len(g) for g in groups)
        print(
            f"consistency: OK, {checked} runs in {len(groups)} group{'s' if len(groups) != 1 else ''} of the same "
            f"model, data, window, precision and quant agree (PPL within {args.rel:g} relative, same tokens)"
        )
    else:
        print("consistency: no two runs share model, data, window, precision and quant; nothing to check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
