"""PNG plots of finished runs: where in the window the loss goes, and how a sweep's configurations compare."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster nodes or in CI

import matplotlib.pyplot as plt  # the backend is chosen above, before pyplot loads
import numpy as np
import torch

from lit_ppl.errors import LitPplError
from lit_ppl.metrics.perplexity import mean_stderr
from lit_ppl.report.results import batch_size, quant_name  # not from report: report imports plots

SMOOTH_ABOVE = 256  # positions; longer windows also get a binned curve
SMOOTH_BINS = 128

# Configuration fields that tell a sweep's runs apart, in the order they appear in a label.
LABEL_FIELDS = (
    ("model", lambda r: Path(str(r.get("model", "?"))).name),
    ("quant", quant_name),
    ("precision", lambda r: r.get("precision")),
    ("world", lambda r: r.get("world_size")),
    ("strategy", lambda r: r.get("strategy")),
    ("batch", batch_size),  # the resolved number, not "auto"
    ("seq_len", lambda r: r.get("seq_len")),
    ("mode", lambda r: r.get("mode")),
)


def position_stats(stats: dict[str, Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean NLL per position and its standard error, from per-position sums.

    Args:
        stats: ``sum``, ``sum_sq`` and ``count`` of the NLL at each window position.

    Returns:
        ``(count, mean, stderr)``; NaN where a position has no token (mean) or fewer than two (stderr).
    """
    total = np.asarray(stats["sum"], dtype=np.float64)
    total_sq = np.asarray(stats["sum_sq"], dtype=np.float64)
    count = np.asarray(stats["count"], dtype=np.float64)
    if not total.shape == total_sq.shape == count.shape:
        raise LitPplError(
            f"nll_by_position: sum, sum_sq, count differ in length ({total.size}, {total_sq.size}, {count.size})"
        )
    mean, stderr = mean_stderr(torch.from_numpy(total), torch.from_numpy(total_sq), torch.from_numpy(count))
    # A lone token has no spread to estimate: NaN leaves a gap in the band rather than a misleading zero width.
    return count, np.where(count > 0, mean.numpy(), np.nan), np.where(count > 1, stderr.numpy(), np.nan)


def plot_nll_by_position(stats: dict[str, Sequence[float]], path: str | Path, title: str | None = None) -> Path:
    """Mean NLL at each position of the window with a ±1 standard-error band.

    A curve that keeps falling with position means the model uses the longer context; a flat one means it does not.

    Args:
        stats: ``sum``, ``sum_sq`` and ``count`` per position (``results.json``'s ``nll_by_position``).
        path: the PNG to write.
        title: a subtitle, e.g. the run's name.

    Returns:
        ``path``.
    """
    count, mean, stderr = position_stats(stats)
    pos = np.arange(mean.size)
    fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
    band = np.nan_to_num(stderr)
    ax.fill_between(pos, mean - band, mean + band, color="tab:blue", alpha=0.25, lw=0, label="±1 standard error")
    if mean.size > SMOOTH_ABOVE:
        # Thousands of positions make a noisy ribbon: overlay the pooled mean of bins of neighbouring positions.
        ax.plot(pos, mean, color="tab:blue", lw=0.6, alpha=0.6, label="mean NLL per position")
        width = math.ceil(mean.size / SMOOTH_BINS)
        edges = np.arange(0, mean.size, width)
        total = np.add.reduceat(np.nan_to_num(mean * count), edges)
        n = np.add.reduceat(count, edges)
        with np.errstate(divide="ignore", invalid="ignore"):
            pooled = np.where(n > 0, total / n, np.nan)
        centres = edges + (np.minimum(edges + width, mean.size) - 1 - edges) / 2
        ax.plot(centres, pooled, color="black", lw=1.6, label=f"mean over {width} positions")
    else:
        ax.plot(pos, mean, color="tab:blue", lw=1.2, label="mean NLL")
    ax.set_xlabel("position in the window (tokens of context before the scored token)")
    ax.set_ylabel("mean NLL (nats / token)")
    ax.set_xlim(0, max(mean.size - 1, 1))
    ax.grid(alpha=0.3)
    # Right axis in perplexity units: the same curve read as exp(NLL).
    ppl_axis = ax.secondary_yaxis("right", functions=(np.exp, _safe_log))
    ppl_axis.set_ylabel("perplexity exp(NLL)")
    scored = int(count.sum())
    head = "Mean NLL by position in the window"
    ax.set_title(f"{head}\n{title} · {scored:,} tokens" if title else f"{head} · {scored:,} tokens")
    ax.legend(loc="upper right")
    return _save(fig, path)


def _safe_log(y: np.ndarray) -> np.ndarray:
    # Matplotlib probes the inverse at 0 and below while laying out the axis: clip instead of warning.
    return np.log(np.clip(y, 1e-300, None))


def sweep_labels(runs: Sequence[dict[str, Any]]) -> list[str]:
    """One label per run naming only the configuration fields that vary across the runs (its name if none do)."""
    varying = [(name, get) for name, get in LABEL_FIELDS if len({str(get(r)) for r in runs}) > 1]
    if not varying:
        return [Path(str(r.get("run", f"run {i}"))).name for i, r in enumerate(runs)]
    labels = []
    for run in runs:
        parts = [
            f"{name} {get(run)}" if name in ("quant", "world", "batch", "seq_len") else str(get(run))
            for name, get in varying
        ]
        labels.append("\n".join(parts))
    return labels


def plot_sweep(runs: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """PPL with its 95% interval per run; a second panel with mean KLD (95%) when any run has a comparison.

    Args:
        runs: ``results.json`` contents (as from :func:`lit_ppl.report.runs.load_run`), one point per run.
        path: the PNG to write.

    Returns:
        ``path``.
    """
    labels = sweep_labels(runs)
    x = np.arange(len(runs))
    has_kld = any((r.get("compare") or {}).get("kld_mean") is not None for r in runs)
    width = max(6.0, 1.3 * len(runs) + 2)
    fig, axes = plt.subplots(
        2 if has_kld else 1,
        1,
        figsize=(width, 7.5 if has_kld else 4.8),
        sharex=True,
        layout="constrained",
        squeeze=False,
    )
    ax = axes[0, 0]
    ppl = np.array([r["ppl"] for r in runs])
    lo = np.array([r["ppl_ci95"][0] for r in runs])
    hi = np.array([r["ppl_ci95"][1] for r in runs])
    ax.errorbar(
        x, ppl, yerr=[ppl - lo, hi - ppl], fmt="o", color="tab:blue", capsize=6, ms=7, label="PPL, 95% interval"
    )
    ax.axhline(ppl[0], color="grey", lw=0.8, ls="--", label=f"first run ({ppl[0]:.6g})")
    for xi, value in zip(x, ppl, strict=True):
        ax.annotate(f"{value:.4f}", (xi, value), textcoords="offset points", xytext=(10, 0), va="center", fontsize=8)
    if ppl.min() > 0 and ppl.max() / ppl.min() > 10:  # e.g. several models: a linear axis flattens the small ones
        ax.set_yscale("log")
    ax.set_ylabel("token perplexity" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.set_title("Perplexity per configuration (error bars: 95% interval)")
    ax.grid(axis="y", alpha=0.3)
    # Headroom above the highest interval so the legend never covers an error bar.
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * (high / low) ** 0.2 if ax.get_yscale() == "log" else high + 0.2 * (high - low))
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    if has_kld:
        kx = axes[1, 0]
        kld = np.array([(r.get("compare") or {}).get("kld_mean", np.nan) for r in runs], dtype=float)
        unc = np.array([(r.get("compare") or {}).get("kld_mean_unc", 0.0) for r in runs], dtype=float)
        kx.bar(x, np.nan_to_num(kld), yerr=1.96 * unc, color="tab:orange", capsize=6, width=0.5)
        for xi, value in zip(x, kld, strict=True):
            text = "no comparison" if math.isnan(value) else f"{value:.3g}"
            kx.annotate(
                text,
                (xi, 0 if math.isnan(value) else value),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                fontsize=8,
            )
        kx.set_ylabel("mean KL divergence (nats / token)")
        kx.set_title("Mean KLD vs the reference per configuration (error bars: 95%)")
        kx.grid(axis="y", alpha=0.3)
    bottom = axes[-1, 0]
    bottom.set_xticks(x, labels)
    bottom.set_xlim(-0.6, len(runs) - 0.4)
    bottom.set_xlabel("configuration")
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path
