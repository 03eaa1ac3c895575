"""Inline SVG charts for ``report.html``: a line, bars and labelled points, with axes — no library, no network.

Each function returns one ``<svg>`` element as text; values are data, labels are escaped. Log axes take positive
values only (a caller drops the others and says so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from pathlib import Path

W, H = 720, 280  # the drawing, in CSS pixels
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 26, 44  # the legend goes above the frame
LABEL_W, LABEL_H = 90, 11  # room a point's label takes, in CSS pixels (10 px text)
COLOURS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")


def ticks(lo: float, hi: float, log: bool = False, count: int = 5) -> list[float]:
    """Round values spanning ``[lo, hi]`` to label an axis (powers of ten on a log axis).

    Examples:
        >>> ticks(0.0, 1.0)
        [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
        >>> ticks(1e-4, 0.5, log=True)
        [0.0001, 0.001, 0.01, 0.1]
    """
    if log:
        return [10.0**e for e in range(math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9) + 1)]
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = min((m * 10.0 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 12) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def label(v: float) -> str:
    """A tick's text: short, whatever the magnitude.

    Examples:
        >>> [label(v) for v in (0.0, 0.25, 2e4, 1.2e5, 1e-8)]
        ['0', '0.25', '2e4', '1.2e5', '1e-8']
    """
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:  # two significant digits, so 1e5 and 1.2e5 stay two labels
        mantissa, exponent = f"{v:.1e}".split("e")
        return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
    return f"{v:,.4g}"


class Axes:
    """Maps data to pixels on a linear or log axis each, and draws the frame, ticks and labels."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float], log_x: bool, log_y: bool, y_from_zero: bool) -> None:
        self.log_x, self.log_y = log_x, log_y
        self.x0, self.x1 = self._span(xs, log_x, False)
        self.y0, self.y1 = self._span(ys, log_y, y_from_zero)

    @staticmethod
    def _span(values: Sequence[float], log: bool, from_zero: bool) -> tuple[float, float]:
        lo, hi = min(values), max(values)
        if from_zero and not log:
            lo = min(lo, 0.0)
        if log:
            lo, hi = 10.0 ** math.floor(math.log10(lo)), 10.0 ** math.ceil(math.log10(hi))
            return (lo, hi * 10.0) if hi <= lo else (lo, hi)
        pad = (hi - lo) * 0.05 or abs(lo) * 0.1 or 1.0  # points off the frame; a lone value in the middle
        return (lo if from_zero and lo == 0.0 else lo - pad), hi + pad

    def _frac(self, v: float, lo: float, hi: float, log: bool) -> float:
        return (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) if log else (v - lo) / (hi - lo)

    def x(self, v: float) -> float:
        return LEFT + self._frac(v, self.x0, self.x1, self.log_x) * (W - LEFT - RIGHT)

    def y(self, v: float) -> float:
        return H - BOTTOM - self._frac(v, self.y0, self.y1, self.log_y) * (H - TOP - BOTTOM)

    def frame(self, x_label: str, y_label: str, x_ticks: bool = True) -> list[str]:
        out = [f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" class="frame"/>']
        for t in ticks(self.y0, self.y1, self.log_y):
            y = self.y(t)
            out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label(t)}</text>')
        if x_ticks:
            for t in ticks(self.x0, self.x1, self.log_x):
                x = self.x(t)
                out.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{label(t)}</text>')
        out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 8}" text-anchor="middle">{escape(x_label)}</text>')
        out.append(
            f'<text transform="translate(14,{(TOP + H - BOTTOM) / 2}) rotate(-90)" text-anchor="middle">'
            f"{escape(y_label)}</text>"
        )
        return out


def _path(axes: Axes, xy: Sequence[tuple[float, float]]) -> str:
    return " ".join(f"{'M' if i == 0 else 'L'}{axes.x(x):.1f},{axes.y(y):.1f}" for i, (x, y) in enumerate(xy))


def _svg(parts: list[str], title: str) -> str:
    return f'<svg viewBox="0 0 {W} {H}" role="img" class="chart"><title>{escape(title)}</title>{"".join(parts)}</svg>'


def line_chart(xs: Sequence[float], ys: Sequence[float], x_label: str, y_label: str, title: str) -> str:
    """A line through ``(xs, ys)`` (NaN ys leave gaps)."""
    kept = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
    axes = Axes([x for x, _ in kept], [y for _, y in kept], False, False, True)
    return _svg([*axes.frame(x_label, y_label), f'<path d="{_path(axes, kept)}" class="line"/>'], title)


def bar_chart(
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    y_label: str,
    title: str,
    log_y: bool = False,
    hover: Sequence[str] | None = None,
) -> str:
    """Grouped bars: one group per label, one bar per series (``None``: no bar), a legend when several."""
    values = [v for s in series.values() for v in s if v is not None and (v > 0 or not log_y)]
    axes = Axes([0.0, 1.0], values or [1.0], False, log_y, True)
    n, k = len(labels), len(series)
    slot = (W - LEFT - RIGHT) / max(n, 1)
    bar = slot * 0.8 / k
    parts = axes.frame("", y_label, x_ticks=False)
    base = axes.y(axes.y0)
    for i, name in enumerate(labels):
        for j, (key, vals) in enumerate(series.items()):
            v = vals[i]
            if v is None or (log_y and v <= 0):
                continue
            x, y = LEFT + i * slot + slot * 0.1 + j * bar, axes.y(v)
            tip = f"{name} · {key}: {v:.4g}" + (f" · {hover[i]}" if hover else "")
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{max(base - y, 0.5):.1f}" '
                f'fill="{COLOURS[j % len(COLOURS)]}" class="bar"><title>{escape(tip)}</title></rect>'
            )
        parts.append(
            f'<text x="{LEFT + (i + 0.5) * slot:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{escape(name)}</text>'
        )
    if k > 1:
        for j, key in enumerate(series):
            x = LEFT + 10 + j * 150
            parts.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{COLOURS[j % len(COLOURS)]}"/>')
            parts.append(f'<text x="{x + 14}" y="15">{escape(key)}</text>')
    return _svg(parts, title)


def _points(axes: Axes, shown: Sequence[tuple[float, float, str, int]]) -> list[str]:
    """A circle and a label per point, coloured by series, with its numbers on hover."""
    parts: list[str] = []
    placed: list[tuple[float, float]] = []  # labels' anchors so far: a label never covers another
    for x, y, name, series in sorted(shown, key=lambda p: axes.y(p[1])):
        cx, cy = axes.x(x), axes.y(y)
        colour, tip = COLOURS[series % len(COLOURS)], f"{name}: {label(x)}, {y:.4g}"
        right = cx > 0.7 * W  # a label near the right edge goes to the point's left
        anchor, tx = ("end", cx - 7) if right else ("start", cx + 7)
        ty = cy - 7
        while any(abs(ty - py) < LABEL_H and abs(tx - px) < LABEL_W for px, py in placed):
            ty += LABEL_H  # points close together (same bytes, similar KLD): their labels stack downwards
        placed.append((tx, ty))
        parts.append(
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{colour}" class="point"><title>{escape(tip)}</title>'
            f'</circle><text x="{tx:.1f}" y="{ty:.1f}" text-anchor="{anchor}" class="small">{escape(name)}</text>'
        )
    return parts


def points_chart(
    points: Sequence[tuple[float, float, str, int]], x_label: str, y_label: str, title: str, log_y: bool = False
) -> str:
    """Labelled points ``(x, y, label, series)``, coloured by series."""
    shown = [p for p in points if not log_y or p[1] > 0]
    axes = Axes([p[0] for p in shown], [p[1] for p in shown], False, log_y, True)
    return _svg([*axes.frame(x_label, y_label), *_points(axes, shown)], title)


def frontier_chart(
    points: Sequence[tuple[float, float, str, int]],
    joined: int,
    levels: Sequence[tuple[float, str]],
    x_label: str,
    y_label: str,
    title: str,
) -> str:
    """Labelled points ``(x, y, label, series)`` on a log y axis (positive ys only), those of series ``joined``
    linked by a line in x order (series 0 is the line's colour), and each level ``(y, label)`` a dashed horizontal
    line labelled at its right end."""
    shown = [p for p in points if p[1] > 0]
    marks = [(y, name) for y, name in levels if y > 0]
    axes = Axes([p[0] for p in shown], [p[1] for p in shown] + [y for y, _ in marks], False, True, False)
    parts = axes.frame(x_label, y_label)
    for y, name in marks:
        at = axes.y(y)
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{at:.1f}" y2="{at:.1f}" class="level"/>')
        # At the right end, unless a point (or its label) is there: then at the left end.
        crowded = any(axes.x(x) > W - RIGHT - 2 * LABEL_W and abs(axes.y(py) - at) < 2 * LABEL_H for x, py, *_ in shown)
        anchor, tx = ("start", LEFT + 4) if crowded else ("end", W - RIGHT - 4)
        tag = f'<text x="{tx}" y="{at - 3:.1f}" text-anchor="{anchor}" class="small">{escape(name)}</text>'
        parts.append(tag)
    line = sorted((x, y) for x, y, _, series in shown if series == joined)
    if len(line) > 1:
        parts.append(f'<path d="{_path(axes, line)}" class="line"/>')
    return _svg([*parts, *_points(axes, shown)], title)


def standalone(svg: str) -> str:
    """One chart as an SVG file of its own: the namespace, and ``report.css``'s chart rules inside it."""
    css = Path(__file__).with_name("report.css").read_text(encoding="utf-8").splitlines()
    rules = "\n".join(line for line in css if line.startswith("svg.chart"))
    head = '<svg xmlns="http://www.w3.org/2000/svg" '
    return f'<?xml version="1.0" encoding="UTF-8"?>\n{svg.replace("<svg ", head, 1)}'.replace(
        "<title>", f"<style>{rules}\nsvg.chart {{ background: #fff; }}</style><title>", 1
    )
