"""The quantization frontier of a ``-m`` sweep: weight bytes against the KLD measured on the evaluated text.

::

    python -m lit_ppl.validate -m model=hf model.path=... data=... compare=unquantized \\
        quant.calibration.path=CALIBRATION.txt 'frontier=glob(*)'
    python -m lit_ppl.report frontier SWEEP_DIR      # again, from the finished jobs

``frontier=glob(*)`` (``conf/frontier/``) runs uniform int8, int4 by round-to-nearest, AWQ and GPTQ, and
``quant=auto`` at three budgets; the auto jobs measure their sensitivity table once (:mod:`lit_ppl.quant.auto.reuse`).
At the end of the sweep :class:`lit_ppl.report.sweep.SweepSummary` writes ``frontier.svg`` and ``frontier.md`` into
the sweep directory: one point per job with a comparison (``compare.kld_mean``), at its packed weight bytes
(``quant.weight_bytes_packed``: int4 two a byte, as a GPU kernel holds it, whatever a CPU kernel holds), the auto
points joined by a line, each budget a dashed level. Jobs without a comparison or results are listed, not drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_ppl.config.quant import QuantConfig
from lit_ppl.errors import UserError
from lit_ppl.report.html import weight_bytes
from lit_ppl.report.svg import frontier_chart, standalone
from lit_ppl.report.sweep import find_jobs, results_path
from lit_ppl.report.tables import markdown_table
from lit_ppl.runtime.files import write_text_atomic

SVG, MARKDOWN = "frontier.svg", "frontier.md"
AUTO, UNIFORM = 0, 1  # series: the auto points are joined, in the line's colour
PLAIN = QuantConfig.method  # the schema's default method (round-to-nearest): a plain int8 point's label omits it


class FrontierError(UserError):
    """A sweep directory with nothing to draw; the message is one line and names it."""


@dataclass
class Point:
    """One job of the sweep: what it quantized and what that cost on the evaluated text."""

    job: str
    label: str
    bytes: float
    kld: float | None  # compare.kld_mean; None: the job had no comparison
    kld_unc: float | None
    ppl: float
    budget: dict[str, float] | None  # quant=auto's budget
    calibration: float | None  # quant=auto: its cost measured on the calibration text
    table_from: str | None  # quant=auto: the job whose sensitivity table it reused
    seconds: float | None  # quantization: calibration or quant=auto's search


def label(results: dict[str, Any]) -> str:
    """A job's point: ``int8``, ``int4 awq``, ``auto@0.02`` (a KLD budget), ``policy``, ``float``."""
    quant = results.get("quant") or {}
    name = quant.get("name")
    if not name:
        return "float"
    if "auto" in quant:
        ((metric, value),) = quant["auto"]["budget"].items()
        return f"auto@{value:g}" if metric == "kld" else f"auto {metric}@{value:g}"
    method = ((results.get("config") or {}).get("quant") or {}).get("method", PLAIN)
    return name if name in ("int8", "policy") and method == PLAIN else f"{name} {method}"


def point(job: str, results: dict[str, Any]) -> Point:
    """The :class:`Point` of one job's ``results.json``."""
    quant, compare = results.get("quant") or {}, results.get("compare") or {}
    auto = quant.get("auto") or {}
    nbytes = weight_bytes(results) or 0.0
    seconds = (auto.get("measurement") or {}).get("seconds") or (quant.get("calibration") or {}).get("seconds")
    source = auto.get("sensitivity_from")
    return Point(
        job=job,
        label=label(results),
        bytes=float(nbytes),
        kld=compare.get("kld_mean"),
        kld_unc=compare.get("kld_mean_unc"),
        ppl=results["ppl"],
        budget=auto.get("budget"),
        calibration=auto.get("measured_calibration"),
        table_from=Path(source).parent.name if source else None,
        seconds=seconds,
    )


def collect(sweep_dir: str | Path, output_subdir: str | None = ".hydra") -> tuple[list[Point], list[str]]:
    """Every finished job's :class:`Point` (in job order), and the jobs without ``results.json``."""
    sweep_dir = Path(sweep_dir)
    points, missing = [], []
    for job_dir in find_jobs(sweep_dir, output_subdir):
        job, path = job_dir.relative_to(sweep_dir).as_posix(), results_path(job_dir, output_subdir)
        if path.is_file():
            points.append(point(job, json.loads(path.read_text())))
        else:
            missing.append(job)
    return points, missing


def svg(points: Sequence[Point]) -> str:
    """The picture: MiB against KLD (log), auto points joined, budgets as dashed levels."""
    drawn = [(p.bytes / 2**20, p.kld, p.label, AUTO if p.budget else UNIFORM) for p in points if p.kld is not None]
    budgets = sorted({v for p in points if p.budget for k, v in p.budget.items() if k == "kld"})
    levels = [(b, f"budget {b:g}") for b in budgets]
    return frontier_chart(
        drawn, AUTO, levels, "weight MiB (packed)", "mean KLD on the evaluated text (nats)", "quantization frontier"
    )


def _number(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(points: Sequence[Point], missing: Sequence[str] = ()) -> str:
    """The table beside the picture, one row per job in the order of bytes."""
    cols = [
        ("point", "point"), ("job", "job"), ("mib", "weight MiB"), ("kld", "KLD (evaluated)"), ("unc", "±"),
        ("ppl", "PPL"), ("budget", "budget"), ("calibration", "KLD (calibration)"), ("met", "met on evaluated"),
        ("table", "table from job"), ("seconds", "quant s"),
    ]  # fmt: skip
    rows = []
    for p in sorted(points, key=lambda p: (p.bytes, p.job)):
        kld_budget = (p.budget or {}).get("kld")
        met = "" if kld_budget is None or p.kld is None else ("yes" if p.kld <= kld_budget else "NO")
        rows.append(
            {
                "point": p.label,
                "job": p.job,
                "mib": f"{p.bytes / 2**20:.4f}",
                "kld": _number(p.kld, ".4g") or "no comparison",
                "unc": _number(p.kld_unc, ".2g"),
                "ppl": f"{p.ppl:.4f}",
                "budget": ", ".join(f"{k} {v:g}" for k, v in (p.budget or {}).items()),
                "calibration": _number(p.calibration, ".4g"),
                "met": met,
                "table": p.table_from or ("measured" if p.budget else ""),
                "seconds": _number(p.seconds, ".1f"),
            }
        )
    rows += [{k: "" for k, _ in cols} | {"job": job, "kld": "no results.json"} for job in missing]
    return markdown_table(cols, rows, {"mib", "kld", "unc", "ppl", "calibration", "seconds"})


def write_frontier(sweep_dir: str | Path, output_subdir: str | None = ".hydra") -> tuple[Path, Path, str]:
    """Write ``frontier.svg`` and ``frontier.md`` into ``sweep_dir``; return their paths and the table.

    Raises:
        FrontierError: no job of the sweep has a comparison to draw.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FrontierError(f"{sweep_dir}: no such sweep directory")
    points, missing = collect(sweep_dir, output_subdir)
    if not any(p.kld is not None and p.kld > 0 for p in points):
        raise FrontierError(
            f"{sweep_dir}: none of its {len(points)} finished jobs measured a KLD above 0: run the sweep with "
            "compare=unquantized (and a quant option per job, e.g. 'frontier=glob(*)')"
        )
    table = markdown(points, missing)
    write_text_atomic(sweep_dir / SVG, standalone(svg(points)))
    write_text_atomic(sweep_dir / MARKDOWN, f"# Quantization frontier\n\n![frontier]({SVG})\n\n{table}")
    return sweep_dir / SVG, sweep_dir / MARKDOWN, table


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lit_ppl.report frontier SWEEP_DIR``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lit_ppl.report frontier", description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", help="a -m sweep's directory (hydra.sweep.dir)")
    args = parser.parse_args(argv)
    try:
        svg_path, md_path, table = write_frontier(args.sweep_dir)
    except FrontierError as err:
        print(f"lit-ppl report: error: {err}", file=sys.stderr)
        return 2
    print(f"{table}\nfrontier: {svg_path} · {md_path}")
    return 0
