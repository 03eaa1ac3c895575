"""A progress bar that shows scored tokens per second."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class TokensPerSecondBar(TQDMProgressBar):
    """Lightning's TQDM bar plus the scored-token rate (counted from batch shapes: no device sync)."""

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._t0 = time.perf_counter()

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        if self.val_progress_bar is not None and not self.val_progress_bar.disable:
            rate = pl_module.tokens_seen / max(time.perf_counter() - self._t0, 1e-9)
            self.val_progress_bar.set_postfix({"tok/s": f"{rate:,.0f}"}, refresh=False)
