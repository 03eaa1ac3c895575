"""A bounded sample of per-token values for ``report.html``: a fixed set of corpus-order tokens, kept as a metric.

The tokens are chosen before the run from the windows alone (:func:`lit_ppl.data.windows.sample_pages`), so each is
scored by exactly one rank whatever the layout; that rank copies its values into the token's slot, every other
rank's slot stays 0, and the sync's sum is the value itself, exactly. Being a metric state, the sample is saved and
restored with a preempted run's progress like every other sum. Its size is fixed by the pages, never by the corpus.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric


class TokenSample(Metric):
    """Per-token ``fields`` (float64: a token id is exact) of the corpus-order token ranges ``pages``.

    Args:
        pages: ``(k, 2)`` first corpus-order token and tokens of each range, ascending and disjoint.
        fields: the values kept per token (e.g. ``nll``, ``target``, a comparison's ``kld``).
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, pages: np.ndarray, fields: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        pages = np.asarray(pages, dtype=np.int64).reshape(-1, 2)
        self.fields = fields
        self.size = int(pages[:, 1].sum())
        rows = torch.from_numpy(np.stack([pages[:, 0], pages[:, 1], np.cumsum(pages[:, 1]) - pages[:, 1]], axis=1))
        self._ranges = {"cpu": (rows[:, 0].contiguous(), rows)}
        # One slot per sampled token, plus one that takes every other token's values and is never read.
        self.add_state(
            "values", default=torch.zeros(len(fields), self.size + 1, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The pages' first tokens ``(k,)`` and rows of (first token, tokens, first slot) ``(k, 3)`` on ``device``."""
        key = str(device)
        if key not in self._ranges:  # made once per device: a step costs no host-to-device copy
            self._ranges[key] = tuple(t.to(device) for t in self._ranges["cpu"])
        return self._ranges[key]

    def update(self, token_index: Tensor, **values: Tensor) -> None:
        """Keep the values of the batch's sampled tokens (``token_index``: corpus order); no host sync."""
        starts, ranges = self._on(token_index.device)
        page = (torch.searchsorted(starts, token_index, right=True) - 1).clamp_min(0)
        start, count, slot0 = ranges.index_select(0, page).unbind(1)  # one gather of whole rows
        offset = token_index - start
        slot = torch.where((offset >= 0) & (offset < count), slot0 + offset, self.size)
        rows = torch.stack([values[f].detach().to(torch.float64) for f in self.fields])
        self.values.index_copy_(1, slot, rows)

    def compute(self) -> dict[str, Tensor]:
        """Each field's values, in the order of the pages' tokens."""
        return {f: self.values[i, : self.size] for i, f in enumerate(self.fields)}
