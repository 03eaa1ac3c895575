"""The noise floor's sums (:mod:`lit_ppl.evaluation.noise_floor`): per sampled window, so exact at any layout."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_ppl.errors import LitPplError
from lit_ppl.metrics.exact import SumStates
from lit_ppl.metrics.perplexity import mean_stderr

# Per sampled window of the noise floor: tokens, Σ KLD, Σ KLD², Σ reverse KLD, top-1 agreements, largest KLD.
NOISE_FIELDS = ("tokens", "kld", "kld2", "kld_rev", "same_top", "kld_max")


class NoiseFloorSums(SumStates):
    """The noise floor's statistics (:mod:`lit_ppl.evaluation.noise_floor`): float64 sums per sampled window.

    Each window's row is filled by the one rank that scored it and is zero on every other, so the sync's all-reduce
    adds only zeros to it (exact), and :meth:`compute` adds the rows in window order: the same bits at any world size
    and layout whose ranks compute each window's values alike. Not the fixed-point sums of deterministic mode: their
    resolution (2^-40 per value) is coarser than a float32 reference's per-token noise.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, windows: int, **kwargs: Any) -> None:
        super().__init__(exact=False, **kwargs)
        self.windows = windows
        self.add_sum_state("rows", size=windows * len(NOISE_FIELDS))

    def update(self, slot: int, kld: Tensor, kld_rev: Tensor, same_top: Tensor) -> None:
        """Add window ``slot``'s per-token values (:func:`lit_ppl.metrics.kl.token_stats` of the run's scores against
        float64's)."""
        d = torch.float64
        kld, kld_rev = kld.detach().to(d), kld_rev.detach().to(d)
        top = kld.max() if kld.numel() else kld.new_zeros(())
        row = torch.stack(
            [kld.new_tensor(float(kld.numel())), kld.sum(), (kld * kld).sum(), kld_rev.sum(), same_top.to(d).sum(), top]
        )
        width = len(NOISE_FIELDS)
        index = torch.arange(slot * width, (slot + 1) * width, device=row.device)
        self.add_to("rows", row, index)

    def compute(self) -> dict[str, float]:
        """Mean KLD both ways with the KLD's standard error, the largest KLD, top-1 agreement, tokens."""
        rows = self.sum_of("rows").reshape(self.windows, len(NOISE_FIELDS)).cpu()
        s = dict(zip(NOISE_FIELDS, (sum(column) for column in rows.T.tolist()), strict=True))  # in window order
        n = s["tokens"]
        if n == 0:
            raise LitPplError("the noise floor's windows hold no scored tokens")
        kld, kld_unc = map(float, mean_stderr(s["kld"], s["kld2"], n))
        return {
            "kld_mean": kld,
            "kld_mean_unc": kld_unc,
            "kld_rev_mean": s["kld_rev"] / n,
            "kld_max": float(rows[:, NOISE_FIELDS.index("kld_max")].max()),
            "same_top": s["same_top"] / n,
            "tokens": int(n),
        }
