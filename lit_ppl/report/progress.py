"""The console's progress bar: scored tokens per second (which library lines show: :mod:`lit_ppl.runtime.verbosity`)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class TokensPerSecondBar(TQDMProgressBar):
    """Lightning's TQDM bar plus the scored-token rate (counted from batch shapes: no device sync).

    Lightning redraws the bar after every batch; a redraw (formatting plus a terminal write) costs about half
    a millisecond, as much as a small model's whole step. This bar redraws at most every ``min_interval_s``
    seconds, and always after the last batch.

    Args:
        min_interval_s: least time between two redraws during validation.
        **kwargs: ``TQDMProgressBar``'s arguments.
    """

    def __init__(self, min_interval_s: float = 0.25, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.min_interval_s = min_interval_s
        self._t0 = self._drawn = 0.0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._t0 = self._drawn = time.perf_counter()

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.is_enabled or self.val_progress_bar.disable:
            return
        bar = self.val_progress_bar
        n, now = batch_idx + 1, time.perf_counter()
        if now - self._drawn < self.min_interval_s and n != bar.total:
            return
        self._drawn = now
        rate = pl_module.tokens_seen / max(now - self._t0, 1e-9)
        bar.set_postfix({"tok/s": f"{rate:,.0f}"}, refresh=False)
        bar.n = n
        bar.refresh()
