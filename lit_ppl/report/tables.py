"""The tables of ``python -m lit_ppl.report``: formatted cells, the terminal (Rich), Markdown and CSV.

The rows are :func:`lit_ppl.report.runs.compare_runs`'s (raw numbers); :func:`format_row` turns them into the text
shown in the terminal and in Markdown alike, while CSV keeps the raw numbers. :func:`markdown_table` and
:func:`to_csv` take any rows (a sweep's summary uses them too).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_ppl.runtime.files import write_text_atomic

COLUMNS = (
    ("run", "run"),
    ("ppl", "PPL"),
    ("ci95", "95% CI"),
    ("delta_ppl", "ΔPPL"),
    ("delta_pct", "ΔPPL %"),
    ("ci_overlap", "CI overlap"),
    ("tokens", "tokens"),
    ("world_size", "world"),
    ("batch_size", "batch"),
    ("strategy", "strategy"),
    ("precision", "precision"),
    ("quant", "quant"),
    ("tokens_per_s", "tok/s"),
    ("kld_mean", "mean KLD"),
    ("same_top", "top-1 agree"),
)


def _fmt(key: str, value: Any) -> str:
    """A row value as text, the same in the terminal and in Markdown."""
    if value is None:
        return "—"
    if key == "ci_overlap":
        return "yes" if value else "NO"
    if key == "delta_ppl":
        return f"{value:+.6f}"
    if key == "delta_pct":
        return f"{value:+.4f}%"
    if key == "ppl":
        return f"{value:.6f}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key == "tokens":
        return f"{value:,}"
    if key == "kld_mean":
        return f"{value:.4g}"  # quantized models' KLDs span 1e-7..1: fixed decimals would print zeros
    if key == "same_top":
        return f"{100 * value:.3f}%"
    return str(value)


def format_row(row: dict[str, Any]) -> dict[str, str]:
    """The displayed text of each column of ``COLUMNS`` for one row of :func:`compare_runs`."""
    out = {key: _fmt(key, row.get(key)) for key, _ in COLUMNS if key != "ci95"}
    out["ci95"] = f"[{row['ci95_low']:.4f}, {row['ci95_high']:.4f}]"
    return out


def visible_columns(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """``COLUMNS`` less the comparison columns when no run has a comparison (they would be all dashes)."""
    has_compare = any(r.get("kld_mean") is not None for r in rows)
    return [(k, h) for k, h in COLUMNS if has_compare or k not in ("kld_mean", "same_top")]


def markdown_table(
    columns: Sequence[tuple[str, str]], rows: Sequence[Mapping[str, str]], right: Collection[str]
) -> str:
    """A GitHub-flavoured Markdown table of already formatted cells.

    Args:
        columns: ``(key, header)`` of each column, in order.
        rows: the text of each row's cells, by key.
        right: the keys of the right-aligned (numeric) columns; the others are left-aligned.

    Returns:
        The table, one line per row after the header and alignment lines; ``|`` in a cell is escaped.
    """

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    lines = [line([h for _, h in columns]), "|" + "|".join("---:" if k in right else ":---" for k, _ in columns) + "|"]
    lines += [line([row[k] for k, _ in columns]) for row in rows]
    return "\n".join(lines) + "\n"


def runs_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table of :func:`compare_runs`'s rows (numbers right-aligned)."""
    cols = visible_columns(rows)
    left = {"run", "strategy", "precision", "quant", "ci_overlap"}
    return markdown_table(cols, [format_row(row) for row in rows], {k for k, _ in cols if k not in left})


def to_csv(rows: Sequence[Mapping[str, Any]], path: str | Path, fields: Sequence[str] | None = None) -> Path:
    """Write rows as CSV with raw (unformatted) numbers, atomically; empty cells for ``None``.

    Floats keep full precision: the ``str`` of a Python float reads back as the same float.

    Args:
        rows: :func:`compare_runs`'s rows, or any rows of scalars.
        path: the file to write.
        fields: the columns, in order; default the first row's keys, or ``COLUMNS``' without rows. No columns
            write an empty file.

    Returns:
        ``path``.
    """
    if fields is None:
        fields = list(rows[0]) if rows else [k for k, _ in COLUMNS]
    out = io.StringIO()
    if fields:
        writer = csv.DictWriter(out, fieldnames=list(fields), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return write_text_atomic(path, out.getvalue())


def print_runs_table(rows: Sequence[dict[str, Any]], console: Any = None) -> None:
    """Print :func:`compare_runs`'s rows as a Rich table."""
    from rich.console import Console
    from rich.table import Table

    # A pipe or a CI log reports 80 columns, which would wrap every cell of this wide table.
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)
    table = Table(title=f"lit-ppl report · {len(rows)} run{'s' if len(rows) != 1 else ''} · Δ vs {rows[0]['run']}")
    for key, header in visible_columns(rows):
        table.add_column(header, justify="left" if key in ("run", "strategy", "precision", "quant") else "right")
    for row in rows:
        text = format_row(row)
        if row["ci_overlap"] is False:
            text["ci_overlap"] = "[bold red]NO[/]"
        table.add_row(*(text[k] for k, _ in visible_columns(rows)))
    console.print(table)
