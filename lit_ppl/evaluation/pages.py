"""The evaluated text that ``report.html`` shows: a bounded sample of windows, each token with its values.

:func:`lit_ppl.data.windows.sample_pages` picks the windows (all of a small corpus; evenly spread ones of a large
one, so the page stays a few hundred KB at any corpus size), :class:`lit_ppl.metrics.sample.TokenSample` keeps their
tokens' values through the run and across ranks, and rank 0 turns them into text with the tokenizer at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lit_ppl.data.windows import page_starts, sample_pages
from lit_ppl.metrics.sample import TokenSample
from lit_ppl.model.tokenizer import token_pieces

BUDGET = 16_384  # tokens shown at most: ~25 bytes each in the page
PAGE = 512  # tokens shown of each window when the corpus does not fit


class ReportSample:
    """Which tokens the report shows (:meth:`metric`), and their text and values at the end (:meth:`finish`)."""

    def __init__(self, budget: int = BUDGET, page: int = PAGE) -> None:
        self.budget, self.page = budget, page
        self.datamodule: Any = None
        self.pages: np.ndarray | None = None

    def metric(self, datamodule: Any, fields: tuple[str, ...]) -> TokenSample:
        """The metric that keeps ``fields`` of the sampled tokens, once the datamodule's windows are known."""
        self.datamodule = datamodule
        self.pages = sample_pages(datamodule.first_token, self.budget, self.page)
        return TokenSample(self.pages[:, 1:], fields)

    def finish(self, values: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Rank 0: the pages as ``report.html`` reads them (each token's text piece and values, rounded for size)."""
        dm, pages = self.datamodule, self.pages
        assert dm is not None and pages is not None
        docs, positions = page_starts(dm.windows, dm.corpus.doc_lengths, pages[:, 0])
        host = {k: v.cpu().numpy() for k, v in values.items()}
        ids = host.pop("target").round().astype(np.int64)
        out, at = [], 0
        for doc, pos, count in zip(docs.tolist(), positions.tolist(), pages[:, 2].tolist(), strict=True):
            part = slice(at, at + count)
            page = {"document": doc, "position": pos, "text": token_pieces(dm.tokenizer, ids[part].tolist())}
            page |= {k: [float(f"{x:.4g}") for x in v[part]] for k, v in host.items()}
            out.append(page)
            at += count
        return {"pages": out, "shown": at, "scored": dm.scored_tokens}
