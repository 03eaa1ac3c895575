"""``report.html``: one self-contained page per run, and one comparing runs (``python -m lit_ppl.report``).

Everything is inline — CSS, the script that shades the text, SVG charts (:mod:`lit_ppl.report.svg`) — so a page
opens offline from a cluster's filesystem. A run's page shows the headline numbers, the evaluated text with each
token shaded by its NLL (or its KLD against the reference) and its values on hover, the NLL by position, the KLD
histogram and KLD by the reference's top-1 probability, and for ``quant=auto`` the per-layer choice and the
frontier of bytes against KLD. The text is the bounded sample :mod:`lit_ppl.evaluation.pages` kept, so the page
stays a few hundred KB at any corpus size.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from html import escape
from importlib.resources import files
from pathlib import Path
from typing import Any

from lit_ppl.report.results import quant_name
from lit_ppl.report.summary import noise_floor_rows
from lit_ppl.report.svg import bar_chart, label, line_chart, points_chart
from lit_ppl.runtime.files import write_text_atomic

POSITION_BINS = 128  # a longer window's positions are averaged in this many bins


def _asset(name: str) -> str:
    return files("lit_ppl.report").joinpath(name).read_text(encoding="utf-8")


def page(title: str, sections: Sequence[str], data: Any = None) -> str:
    """A whole HTML document: inline style, ``sections``, and ``data`` (JSON) with the script that reads it."""
    payload = ""
    if data is not None:
        inline = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # "</" would end the script early
        payload = f'<script type="application/json" id="lit-ppl-data">{inline}</script>'
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_asset('report.css')}</style></head>"
        f"<body><h1>{escape(title)}</h1>{''.join(sections)}{payload}"
        f"<script>{_asset('report.js')}</script></body></html>\n"
    )


def table(rows: Sequence[Sequence[Any]], head: Sequence[str] | None = None, cls: str = "") -> str:
    """An HTML table of already formatted cells."""
    out = [f'<table class="{cls}">']
    if head:
        out.append("<tr>" + "".join(f"<th>{escape(str(h))}</th>" for h in head) + "</tr>")
    out += ["<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows]
    return "".join(out) + "</table>"


def section(title: str, *body: str, note: str = "") -> str:
    text = f'<p class="note">{escape(note)}</p>' if note else ""
    return f"<section><h2>{escape(title)}</h2>{text}{''.join(body)}</section>"


def _num(v: Any, digits: int = 4) -> str:
    return "—" if v is None else f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


def headline(r: dict[str, Any]) -> str:
    """The run's main numbers (and the comparison's)."""
    lo, hi = r["ppl_ci95"]
    rows = [
        ("model", r.get("model")),
        ("text", (r.get("data") or {}).get("source")),
        ("windows", f"{r['mode']} · seq_len {r['seq_len']}"),
        ("token perplexity", f"{r['ppl']:.4f}  (95% interval {lo:.4f} – {hi:.4f})"),
        ("mean NLL (nats)", f"{r['nll_mean']:.4f} ± {r['nll_stderr']:.4f}"),
        ("word · byte perplexity", f"{_num(r.get('word_ppl'))} · {_num(r.get('byte_ppl'))}"),
        (
            "tokens · words · bytes · documents",
            f"{r['tokens']:,} · {r['words']:,} · {r['bytes']:,} · {r['documents']:,}",
        ),
        ("layout", f"{r['world_size']} × {r['strategy']} · {r['precision']} · quant {quant_name(r)}"),
        ("seconds · tokens/s", f"{r['seconds']:.2f} · {r.get('tokens_per_s') or 0:,.0f}"),
    ]
    c = r.get("compare")
    if c:
        rows += [
            ("PPL(Q) / PPL(reference)", f"{c['ppl']:.4f} / {c['ppl_base']:.4f} = {c['ppl_ratio']:.5f}"),
            ("mean KLD, KL(reference ‖ Q)", f"{c['kld_mean']:.6g} ± {c['kld_mean_unc']:.2g}"),
            *noise_floor_rows(c.get("noise_floor")),
            ("mean reverse KLD, KL(Q ‖ reference)", f"{c['kld_rev_mean']:.6g} ± {c['kld_rev_mean_unc']:.2g}"),
            ("KLD 99% · max", f"{c['kld_p99']:.4g} · {c['kld_max']:.4g}"),
            ("same top-1", f"{100 * c['same_top']:.2f}%"),
        ]
    return section("Headline", table([(k, "—" if v is None else v) for k, v in rows], cls="headline"))


def positions(stats: dict[str, Sequence[float]] | None) -> str:
    """Mean NLL by position in the window (binned for long windows)."""
    if not stats:
        return ""
    total, count = stats["sum"], stats["count"]
    width = max(1, math.ceil(len(total) / POSITION_BINS))
    xs, ys = [], []
    for start in range(0, len(total), width):
        n = sum(count[start : start + width])
        xs.append(start + (min(width, len(total) - start) - 1) / 2)
        ys.append(sum(total[start : start + width]) / n if n else math.nan)
    note = "A curve that falls with position: the model uses the longer context." + (
        f" Each point averages {width} positions." if width > 1 else ""
    )
    chart = line_chart(xs, ys, "position in the window", "mean NLL (nats)", "Mean NLL by position")
    return section("NLL by position", chart, note=note)


def buckets_section(c: dict[str, Any]) -> str:
    """KLD by the reference's top-1 probability: a chart of both directions and the table behind it."""
    rows, labels, fwd, rev = [], [], [], []
    for b in c["kld_by_top_p"]:
        lo, hi = b["top_p"]
        name = f"[{lo:g}, {hi:g}{']' if hi == 1 else ')'}"
        labels.append(name)
        fwd.append(b["kld_mean"])
        rev.append(b["kld_rev_mean"])
        same = "—" if b["same_top"] is None else f"{100 * b['same_top']:.1f}%"
        rows.append(
            (
                name,
                f"{b['tokens']:,}",
                f"{100 * b['share']:.1f}%",
                _num(b["kld_mean"], 6),
                _num(b["kld_rev_mean"], 6),
                same,
            )
        )
    chart = bar_chart(labels, {"KL(ref ‖ Q)": fwd, "KL(Q ‖ ref)": rev}, "mean KLD (nats)", "KLD by top-1 probability")
    head = ("reference top-1 p", "tokens", "share", "mean KLD", "mean reverse KLD", "same top-1")
    note = "Where the reference is undecided (low top-1 probability), quantization moves the most mass."
    return section("KLD by the reference's top-1 probability", chart, table(rows, head, cls="buckets"), note=note)


def histogram_section(c: dict[str, Any]) -> str:
    h = c.get("kld_histogram")
    if not h or not h["counts"]:
        return ""
    edges = h["edges"]
    decade = [abs(math.log10(e) - round(math.log10(e))) < 1e-6 for e in edges]  # label the powers of ten only
    labels = [label(edges[i]) if decade[i] else "" for i in range(len(h["counts"]))]
    hover = [f"[{edges[i]:.3g}, {edges[i + 1]:.3g})" for i in range(len(h["counts"]))]
    chart = bar_chart(labels, {"tokens": h["counts"]}, "tokens", "KLD histogram", hover=hover)
    note = f"Per-token KLD in quarter decades; {h['below']:,} tokens below 1e-15 (rounding), {h['above']:,} above 1e4."
    return section("KLD histogram", chart, note=note)


LAYER = re.compile(r"^(?:.*\.)?(\d+)\.(.+)$")  # model.layers.3.self_attn.q_proj -> 3, self_attn.q_proj


def auto_section(auto: dict[str, Any], measured: float | None) -> str:
    """quant=auto: the scheme of every layer (a grid of blocks × kinds) and the frontier of bytes against KLD."""
    choice, table_ = auto.get("choice") or {}, auto.get("sensitivity") or {}
    kinds: dict[str, dict[int, str]] = {}
    for name, scheme in choice.items():
        m = LAYER.match(name)
        block, kind = (int(m.group(1)), m.group(2)) if m else (-1, name)
        costs = ", ".join(f"{k} {v['kld']:.3g}" for k, v in (table_.get(name) or {}).items())
        tip = escape(f"{name}: {scheme} (KLD of each scheme alone: {costs})")
        kinds.setdefault(kind, {})[block] = f'<td class="s-{escape(scheme)}" title="{tip}">{escape(scheme[:4])}</td>'

    blocks = sorted({b for row in kinds.values() for b in row})
    grid = [
        '<table class="grid"><tr><th>layer</th>' + "".join(f"<th>{b if b >= 0 else ''}</th>" for b in blocks) + "</tr>"
    ]
    for kind, row in kinds.items():
        grid.append(f"<tr><th>{escape(kind)}</th>" + "".join(row.get(b, "<td></td>") for b in blocks) + "</tr>")
    grid.append("</table>")
    mib = 2.0**-20
    points = [(auto["bytes_full_precision"] * mib, 0.0, "full precision", 0)]
    if "ppl_increase" not in (auto.get("budget") or {}):  # that budget's rounds measure another quantity
        for kind, nbytes in (auto.get("bytes_uniform") or {}).items():
            cost = sum((v.get(kind) or {}).get("kld", 0.0) for v in table_.values())
            points.append((nbytes * mib, cost, f"all {kind} (predicted)", 1))
        for i, r in enumerate(auto.get("rounds") or []):
            points.append((r["bytes"] * mib, float(r["measured"]), f"round {i + 1} (calibration)", 2))
    if measured is not None:
        points.append((auto["bytes"] * mib, measured, "chosen (evaluated text)", 3))
    chart = points_chart(points, "MiB of the quantizable layers' weights", "mean KLD", "quant=auto frontier")
    note = (
        f"Budget: {' '.join(f'{k} ≤ {v:g}' for k, v in auto['budget'].items())}; {auto['bytes']:,} of "
        f"{auto['bytes_full_precision']:,} bytes ({auto['bits']:.4g} bits per weight). Hover a cell for its "
        "scheme and what each scheme costs alone."
    )
    return section("quant=auto: the choice per layer and the frontier", "".join(grid), chart, note=note)


def text_section(text: dict[str, Any] | None, compare: bool) -> str:
    if not text or not text["pages"]:
        return ""
    shown, scored = text["shown"], text["scored"]
    what = "every scored token" if shown == scored else f"{shown:,} of {scored:,} scored tokens (evenly spread windows)"
    buttons = '<button data-metric="nll">NLL</button>' + ('<button data-metric="kld">KLD</button>' if compare else "")
    legend = '<span id="legend-low"></span><span class="gradient"></span><span id="legend-high"></span>'
    body = f'<div class="controls">shade by {buttons} {legend}</div><div id="pages" data-shown="{shown}"></div>'
    return section("The text", body, note=f"Showing {what}, each shaded by its value; hover a token for its numbers.")


def run_page(results: dict[str, Any], text: dict[str, Any] | None) -> str:
    """The page of one run (``results.json``'s content and the sampled text)."""
    c = results.get("compare") or None
    auto = (results.get("quant") or {}).get("auto")
    sections = [headline(results)]
    if c:
        sections += [buckets_section(c), histogram_section(c)]
    if auto:
        sections.append(auto_section(auto, c["kld_mean"] if c else None))
    sections += [positions(results.get("nll_by_position")), text_section(text, bool(c))]
    data = {"pages": text["pages"], "compare": bool(c)} if text else None
    return page(f"lit-ppl report · {Path(str(results.get('model'))).name}", sections, data)


def write_run_page(path: str | Path, results: dict[str, Any], text: dict[str, Any] | None) -> Path:
    """Write :func:`run_page` to ``path`` atomically."""
    return write_text_atomic(path, run_page(results, text))


def weight_bytes(run: dict[str, Any]) -> float | None:
    """The model's weight bytes: the quantization's count (packed, as its schemes store them, where recorded: CPU
    kernels hold int4 unpacked), else one replica's share of the ranks' bytes."""
    quant = run.get("quant") or {}
    if quant.get("weight_bytes_packed"):
        return float(quant["weight_bytes_packed"])
    if quant.get("weight_bytes_after"):
        return float(quant["weight_bytes_after"])
    held = run.get("rank_weight_bytes")
    if not held:
        return None
    layout = run.get("parallel") or {}
    return (
        float(sum(held) / max(layout.get("dp_replicate", len(held)), 1))
        if layout.get("kind") not in (None, "single", "ddp")
        else float(max(held))
    )


def runs_page(runs: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> str:
    """One page comparing finished runs: the report's table and the frontier of weight bytes against mean KLD."""
    from lit_ppl.report.tables import format_row, visible_columns

    cols = visible_columns(rows)
    cells = [[format_row(row)[k] for k, _ in cols] for row in rows]
    runs_table = f'<div class="wide">{table(cells, [h for _, h in cols], cls="runs")}</div>'
    sections = [section("Runs", runs_table, note=f"Δ against {rows[0]['run']}.")]
    points = []
    for run in runs:
        nbytes, kld = weight_bytes(run), (run.get("compare") or {}).get("kld_mean")
        if nbytes is not None and kld is not None:
            points.append((nbytes / 2**20, kld, f"{Path(str(run['run'])).name} ({quant_name(run)})", 0))
    if points:
        log_y = any(p[1] > 0 for p in points)
        chart = points_chart(points, "weight MiB", "mean KLD (nats)", "frontier", log_y=log_y)
        note = "Runs with a comparison: fewer bytes to the left, less damage below."
        if any(p[1] <= 0 for p in points):
            note += " A KLD of 0 (the reference itself) has no place on the log axis."
        sections.append(section("Frontier: bytes against measured KLD", chart, note=note))
    labels = [Path(str(r["run"])).name for r in rows]
    sections.append(
        section("Perplexity", bar_chart(labels, {"PPL": [r["ppl"] for r in rows]}, "token perplexity", "PPL"))
    )
    return page(f"lit-ppl report · {len(runs)} run{'s' if len(runs) != 1 else ''}", sections)


def write_runs_page(path: str | Path, runs: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> Path:
    """Write :func:`runs_page` to ``path`` atomically."""
    return write_text_atomic(path, runs_page(runs, rows))
