"""Percentiles from fixed-size log-spaced histograms: compare statistics whose memory does not grow with the corpus.

llama.cpp sorts every token's KLD and Δp to read off percentiles; over 100M tokens that is 1.6 GB on every rank.
Here a value only adds one to an int64 count of the bin it falls in, so a rank's state is a vector of fixed size
that syncs by summing (exactly, in any order: the same counts at any world size), and a percentile is read back
from the counts.

The bins are DDSketch's (Masson, Rim & Lee, VLDB 2019): magnitudes in ``[low, high)`` fall in the bins
``[low·γ^i, low·γ^(i+1))`` with ``γ = (1 + α)/(1 − α)``, and every value of bin ``i`` is read back as the point
``2·low·γ^(i+1)/(γ + 1)``, whose relative distance to anything in the bin is at most ``α``. A ``signed`` histogram
mirrors the bins for negative values. With the exact min and max kept beside the counts, a percentile (llama.cpp's
linear interpolation at ``p/100 · (n − 1)`` between the sorted values ``v_lo ≤ v_hi``) is:

* exact at 0 and 100 (the min and the max);
* within ``α · max(|v_lo|, |v_hi|)`` of the exact one when both magnitudes lie in ``[low, high)``: a relative error
  of at most ``α`` (0.1% at the default ``α = 1e-3``) when they share a sign, as KLDs always do;
* within ``low`` (absolute) for a value of magnitude below ``low``, read back as 0 (zero, and the rounding-level
  negatives a float64 KLD can have);
* read back as the exact max (or min, on the negative side) for a value past the top bin (``low·γ^m ≥ high``).

A read-back point is clamped to ``[min, max]``, which only moves it closer to the value it stands for.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lit_ppl.errors import LitPplError


@dataclasses.dataclass(frozen=True)
class LogBins:
    """The bins of a log-spaced histogram, in ascending order of value.

    Layout (``m`` = :attr:`per_side` log bins per sign): unsigned ``[under, 0 … m−1, over]``; signed
    ``[−over, −(m−1) … −0, under, 0 … m−1, over]``, where ``under`` holds magnitudes below ``low`` and ``over``
    magnitudes of ``low·γ^m`` (≥ ``high``) or more. NaN counts as ``over``. An unsigned histogram puts every value
    below ``low``, negative ones included, in ``under``.

    Args:
        low: the smallest magnitude with its own bins.
        high: magnitudes from here on share the overflow bin (read back as the exact max).
        alpha: the relative error bound of a value read back from its bin.
        signed: mirror the bins for negative values.

    Examples:
        >>> bins = LogBins(low=1e-3, high=1e3, alpha=0.01)
        >>> bins.per_side, bins.size
        (691, 693)
        >>> bins.index(torch.tensor([0.0, 1e-3, 1.0, 5e3])).tolist()
        [0, 1, 346, 692]
    """

    low: float
    high: float
    alpha: float = 1e-3
    signed: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.low < self.high < math.inf:
            raise LitPplError(f"LogBins needs 0 < low < high < inf, got low={self.low}, high={self.high}")
        if not 0.0 < self.alpha < 1.0:
            raise LitPplError(f"LogBins needs 0 < alpha < 1, got alpha={self.alpha}")

    @property
    def gamma(self) -> float:
        """The ratio of a bin's upper to its lower edge."""
        return (1.0 + self.alpha) / (1.0 - self.alpha)

    @functools.cached_property
    def per_side(self) -> int:
        """Log bins per sign: enough to reach ``high`` from ``low``."""
        return math.ceil(math.log(self.high / self.low) / math.log(self.gamma))

    @property
    def size(self) -> int:
        """Bins in all, under- and overflow included: the length of the count vector."""
        return 2 * self.per_side + 3 if self.signed else self.per_side + 2

    def index(self, values: Tensor) -> Tensor:
        """The bin of every value (int64, same shape and device); elementwise, so the same on any rank."""
        x = values.detach().to(torch.float64)
        m = self.per_side
        j = torch.floor((torch.log(x.abs()) - math.log(self.low)) / math.log(self.gamma))
        # log(0) = −inf → under (−1); NaN and ±inf → over (m).
        j = torch.nan_to_num(j, nan=float(m), posinf=float(m), neginf=-1.0).clamp(-1, m).to(torch.int64)
        if not self.signed:
            return j + 1
        under = m + 1
        return torch.where((x < 0) & (j >= 0), under - 1 - j, under + 1 + j)

    def points(self) -> Tensor:
        """The value each bin is read back as (float64, ascending): 0 for ``under``, ±inf for the overflow bins."""
        i = torch.arange(self.per_side, dtype=torch.float64)
        mid = 2.0 * self.low * torch.pow(torch.tensor(self.gamma, dtype=torch.float64), i + 1) / (self.gamma + 1.0)
        inf, zero = torch.tensor([math.inf], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        if not self.signed:
            return torch.cat([zero, mid, inf])
        return torch.cat([-inf, -mid.flip(0), zero, mid, inf])


def coarse(bins: LogBins, counts: Tensor, per_decade: int = 4) -> dict[str, Any]:
    """An unsigned histogram's counts regrouped into ``per_decade`` bins per decade, for a chart.

    Each fine bin joins the coarse bin holding its lower edge, so a coarse edge stands within a factor ``γ`` of
    where its values change bins. Returns ``edges`` (``len(counts) + 1`` values, from the first to the last
    non-empty coarse bin), ``counts``, ``below`` (values under ``low``: zeros and rounding-level values) and
    ``above`` (past ``high``).

    Examples:
        >>> bins = LogBins(low=1e-6, high=10.0)
        >>> values = torch.tensor([0.0, 2e-3, 3e-3, 0.5], dtype=torch.float64)
        >>> counts = torch.zeros(bins.size, dtype=torch.int64).index_add_(0, bins.index(values), torch.ones(4).long())
        >>> out = coarse(bins, counts, per_decade=1)
        >>> out["edges"], out["counts"], out["below"], out["above"]
        ([0.001, 0.01, 0.1, 1.0], [2, 0, 1], 1, 0)
    """
    if bins.signed:
        raise LitPplError("coarse() regroups unsigned histograms only")
    c = counts.detach().to("cpu", torch.int64)
    lower = math.log10(bins.low) + torch.arange(bins.per_side, dtype=torch.float64) * math.log10(bins.gamma)
    group = torch.floor(lower * per_decade + 1e-9).to(torch.int64)
    first = int(group[0])
    grouped = torch.zeros(int(group[-1]) - first + 1, dtype=torch.int64).index_add_(0, group - first, c[1:-1])
    filled = torch.nonzero(grouped).flatten().tolist()
    lo, hi = (filled[0], filled[-1] + 1) if filled else (0, 0)
    return {
        "edges": [float(f"{10.0 ** ((first + i) / per_decade):.6g}") for i in range(lo, hi + 1)] if filled else [],
        "counts": grouped[lo:hi].tolist(),
        "below": int(c[0]),
        "above": int(c[-1]),
    }


def percentiles(
    bins: LogBins, counts: Tensor, lowest: float, highest: float, pcts: Sequence[float]
) -> dict[float, float]:
    """llama.cpp's percentiles (linear interpolation at ``p/100 · (n − 1)``) read back from a histogram.

    Args:
        bins: the histogram's bins.
        counts: ``(bins.size,)`` int64 counts.
        lowest: the exact smallest value counted; ``highest`` the exact largest.
        pcts: percentiles in ``[0, 100]``.

    Returns:
        ``{p: value}``, within the bounds of the module docstring of the exact percentiles.

    Examples:
        >>> bins = LogBins(low=1e-6, high=10.0)
        >>> values = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
        >>> counts = torch.zeros(bins.size, dtype=torch.int64).index_add_(0, bins.index(values), torch.ones(5).long())
        >>> out = percentiles(bins, counts, 0.0, 4.0, (0, 50, 62.5, 100))
        >>> out[0], round(out[50], 6), round(out[62.5], 6), out[100]
        (0.0, 0.999494, 1.500093, 4.0)
    """
    cum = counts.detach().to("cpu", torch.int64).cumsum(0)
    n = int(cum[-1])
    if n == 0:
        raise LitPplError("no values were counted, so there is no percentile to read")
    points = bins.points()

    def sorted_value(rank: int) -> float:
        if rank == 0:
            return lowest
        if rank == n - 1:
            return highest
        i = int(torch.searchsorted(cum, torch.tensor([rank]), right=True))  # first bin whose cumulative count > rank
        return min(max(float(points[i]), lowest), highest)

    out = {}
    for pct in pcts:
        if not 0.0 <= pct <= 100.0:
            raise LitPplError(f"percentile {pct} is not in [0, 100]")
        pos = pct / 100.0 * (n - 1)
        lo = min(int(pos), n - 1)
        frac = pos - lo
        out[pct] = (1.0 - frac) * sorted_value(lo) + frac * sorted_value(min(lo + 1, n - 1))
    return out
