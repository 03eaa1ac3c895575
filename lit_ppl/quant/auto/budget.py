"""The arithmetic of ``quant=auto``'s choice: the budget, a layer's options and bytes, the cheapest assignment.

:func:`cheapest` is a multiple-choice knapsack — per layer one option, the fewest bytes in all, the summed costs
within the budget — solved exactly by dynamic programming over the budget in :data:`BINS` steps, each cost
rounded up, so that the prediction never exceeds the budget. Written here because none of the dependencies has a
knapsack solver.

Bytes are the weights as the scheme stores them packed (:func:`packed_bytes`): full precision in its dtype, int8
one byte per weight plus a scale per row, int4 half a byte plus a scale and a zero point per group (in the
weight's dtype); the intx int4 backend holds one code per byte in memory, which ``results.json``'s
``weight_bytes_after`` shows. An embedding table packs the same way, a row per token (torchao's ``Int8Tensor``
holds one scale per row, int4 ``IntxWeightOnlyConfig`` one per group of the row); a tied head and embedding table
is one tensor, counted once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from lit_ppl.config.quant import QuantConfig
from lit_ppl.config.values import check_auto
from lit_ppl.errors import LitPplError
from lit_ppl.quant.schemes import Scheme
from lit_ppl.runtime.memory import tensor_bytes

BINS = 4000  # the budget's resolution in the knapsack: a cost is rounded up by at most budget / BINS
CONFIDENCE = 0.95  # a choice keeps its cost's one-sided upper prediction bound at this level within the budget


@dataclass(frozen=True)
class Budget:
    """``quant.budget``: ``metric`` is ``kld`` (mean KL divergence, nats) or ``ppl_increase``, the relative change
    of perplexity either way, ``|PPL(Q) / PPL(base) − 1|`` (a quantization that lowers the calibration text's
    perplexity has still changed the model, and on other text need not lower it), both limits on the loss; or
    ``bits``, a limit on the size: the candidates' mean bits per weight, packed, within which the least KLD."""

    metric: str
    value: float

    @classmethod
    def from_config(cls, quant: QuantConfig) -> Budget:
        """The one budget of a ``quant`` config (checked as the config check does, for callers of the API)."""
        check_auto("quant", dataclasses.asdict(quant))
        ((metric, value),) = ((k, v) for k, v in dataclasses.asdict(quant.budget).items() if v is not None)
        return cls(metric, float(value))

    @property
    def measure(self) -> str:
        """What a candidate costs: ``ppl_increase`` under that budget, else the KLD (a size budget minimises it)."""
        return "ppl_increase" if self.metric == "ppl_increase" else "kld"

    @property
    def limit(self) -> float:
        """A loss budget in cost units: mean KLD, or the mean NLL change in nats (``|ΔNLL| ≤ log1p(b)`` bounds the
        perplexity ratio within ``[1 − b, 1 + b]``)."""
        return self.value if self.metric == "kld" else math.log1p(self.value)

    def max_bytes(self, weights: int) -> int:
        """A size budget's bytes for ``weights`` weights (the float rounding of bits given from bytes forgiven)."""
        return math.floor(self.value * weights / 8 + 1e-6)

    def cost(self, units: torch.Tensor) -> float:
        """A measurement's cost from its ``(Σ KLD, Σ NLL, Σ NLL of the float model, tokens)`` per unit of tokens."""
        kld, nll, nll_base, tokens = (float(x) for x in real_units(units).sum(0))
        return kld / tokens if self.measure == "kld" else abs(nll - nll_base) / tokens

    def bound(self, units: torch.Tensor) -> float:
        """The cost's one-sided upper prediction bound at :data:`CONFIDENCE` for another text as long as the
        calibration text, a unit being one calibration window: the mean over tokens is a ratio of sums over
        windows, its standard error the ratio estimator's, ``s = √(Σ (v_i − m n_i)² / (N (N − 1))) / n̄``; another
        text of ``N`` windows drawn the same way has the same error, so their difference has ``s √2``, times
        Student's t quantile on ``N − 1`` degrees of freedom. A bound on the calibration text's own mean (``s``
        alone) is not what the budget is for: the evaluated text is another text. Windows, not shorter runs of
        tokens: the tokens of one window share its context and topic, so their costs move together."""
        units = real_units(units)
        value = units[:, 0] if self.measure == "kld" else units[:, 1] - units[:, 2]
        tokens = units[:, 3]
        mean = value.sum() / tokens.sum()
        n = units.shape[0]
        if n < 2:
            raise LitPplError(
                f"quant=auto: the calibration text gave one window ({int(tokens.sum())} scored tokens), and the "
                "measurement's variance is over windows: give it at least two (quant.calibration.tokens above "
                "quant.calibration.seq_len)"
            )
        stderr = torch.sqrt(((value - mean * tokens) ** 2).sum() / (n * (n - 1))) / tokens.mean()
        return abs(float(mean)) + t_quantile(CONFIDENCE, n - 1) * math.sqrt(2) * float(stderr)

    def shown(self, cost: float) -> float:
        """A cost in the budget's own terms (``ppl_increase``: ``exp(|ΔNLL|) − 1``)."""
        return cost if self.measure == "kld" else math.expm1(cost)


def t_quantile(p: float, dof: int) -> float:
    """Student's t distribution's ``p`` quantile (``0.5 ≤ p ≤ 0.99``) on ``dof`` degrees of freedom, its density
    integrated on a fine grid (within 1e-4): torch's ``StudentT`` has no inverse CDF and scipy is no dependency."""
    x = torch.linspace(0.0, 64.0, 2**20, dtype=torch.float64)  # the 0.99 quantile at 1 degree of freedom is 31.8
    v = float(dof)
    log_density = math.lgamma((v + 1) / 2) - math.lgamma(v / 2) - 0.5 * math.log(v * math.pi)
    density = torch.exp(log_density - (v + 1) / 2 * torch.log1p(x.square() / v))
    cdf = 0.5 + torch.cumulative_trapezoid(density, x)
    return float(x[1 + int(torch.searchsorted(cdf, p))])


def real_units(units: torch.Tensor) -> torch.Tensor:
    """The units that hold tokens, as ``(N, 4)`` float64 (the same tensor at every world size: padding dropped)."""
    flat = units.reshape(-1, 4).double()
    return flat[flat[:, 3] > 0]


def packed_bytes(scheme: Scheme, weight: torch.Tensor) -> int:
    """The bytes of ``weight`` under ``scheme`` as stored packed (module docstring)."""
    numel, size = weight.numel(), weight.element_size()
    if scheme.kind == "none":
        return tensor_bytes(weight)
    rows = numel // weight.shape[-1]
    if scheme.kind in ("int8", "int8dq"):  # int8dq: the same int8 weights per row, activations quantized on the fly
        return numel + rows * size
    return numel // 2 + 2 * (numel // scheme.group_size) * size


def cheapest(options: list[list[tuple[int, float]]], limit: float, bins: int = BINS) -> list[int] | None:
    """Per unit the index of its ``(bytes, cost)`` option, fewest bytes in all with summed cost ≤ ``limit``
    (costs rounded up to ``limit / bins``), or ``None`` if no choice fits."""

    def steps(cost: float) -> int:  # rounded up; past the budget: bins + 1
        return 0 if cost <= 0 else min(math.ceil(cost / limit * bins), bins + 1)

    weights = [[steps(c) for _, c in unit] for unit in options]
    best = np.full(bins + 1, np.inf)  # fewest bytes at exactly c steps of cost
    best[0] = 0.0
    picks = np.zeros((len(options), bins + 1), dtype=np.int16)
    for i, unit in enumerate(options):
        new = np.full(bins + 1, np.inf)
        for j, ((size, _), w) in enumerate(zip(unit, weights[i], strict=True)):
            if w > bins:
                continue
            shifted = np.full(bins + 1, np.inf)
            shifted[w:] = best[: bins + 1 - w] + size
            better = shifted < new
            new[better], picks[i, better] = shifted[better], j
        best = new
    if not np.isfinite(best).any():
        return None
    c, chosen = int(np.argmin(best)), []
    for i in reversed(range(len(options))):
        j = int(picks[i, c])
        chosen.append(j)
        c -= weights[i][j]
    return chosen[::-1]


def least_cost(
    options: list[list[tuple[int, float]]], max_bytes: int, bins: int = BINS
) -> tuple[list[int], float] | None:
    """Per unit the index of its ``(bytes, cost)`` option, the least summed cost within ``max_bytes`` (to the
    knapsack's resolution), and the cost target that chose it; ``None`` if the fewest bytes exceed it. The
    smallest target whose :func:`cheapest` choice fits, bisected: one solver serves both budgets."""
    if sum(min(b for b, _ in unit) for unit in options) > max_bytes:
        return None
    free = [min(((b, j) for j, (b, c) in enumerate(unit) if c <= 0), default=None) for unit in options]
    if all(f is not None for f in free) and sum(f[0] for f in free) <= max_bytes:  # nothing lost within the size
        return [f[1] for f in free], 0.0

    def fits(target: float) -> list[int] | None:
        picks = cheapest(options, target, bins)
        ok = picks is not None and sum(u[j][0] for u, j in zip(options, picks, strict=True)) <= max_bytes
        return picks if ok else None

    low, high = 0.0, sum(max(c for _, c in unit) for unit in options)
    while (picks := fits(high)) is None:  # costs rounded up to the target's steps: the fewest bytes need headroom
        low, high = high, 2 * high
    while high - low > high / bins:
        mid = (low + high) / 2
        if (found := fits(mid)) is not None:
            high, picks = mid, found
        else:
            low = mid
    return picks, high


@dataclass(frozen=True)
class Option:
    """One scheme for one layer: its packed bytes and, measured alone, its mean KLD and mean NLL change."""

    kind: str  # "none" or a scheme of quant.schemes
    bytes: int
    kld: float = 0.0
    nll_delta: float = 0.0

    def cost(self, budget: Budget) -> float:
        # |ΔNLL|: a layer that lowers the NLL alone is no credit against another's loss (Budget).
        return self.kld if budget.measure == "kld" else abs(self.nll_delta)
