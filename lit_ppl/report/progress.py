"""The console: a progress bar that shows scored tokens per second, and which library lines a plain run hides."""

from __future__ import annotations

import logging
import time
import warnings
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


# What a plain run hides (verbose=false): Lightning's device banner and advertising tips, the `srun` hint (lit-ppl
# runs under srun or not by design, see slurm/) and deprecations and hints inside Lightning that users cannot act
# on. Each is matched by its logger and message, so every other warning, lit-ppl's own included, still shows.
_QUIET_INFO = ("GPU available:", "TPU available:", "HPU available:", "💡 Tip:")
_QUIET_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
_QUIET_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"The `srun` command is available on your system but is not used", Warning),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # Lightning's own all_gather (the per-rank token counts) calls a torch function torch now deprecates.
    (r"torch.distributed.nn.functional.all_gather is deprecated", Warning),
    # The final PPL is logged once, from the already-synced metric: a sync_dist would only average equal values.
    (r"It is recommended to use `self.log\('(ppl|nll_mean)', ..., sync_dist=True\)`", Warning),
)


class _DropLines(logging.Filter):
    """Drops log records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_drop_banner = _DropLines(_QUIET_INFO)


def set_verbose(verbose: bool) -> None:
    """Show (``verbose=True``) or hide the library lines listed above; idempotent, and reversible in one process."""
    for name in _QUIET_INFO_LOGGERS:
        logger = logging.getLogger(name)
        logger.removeFilter(_drop_banner)
        if not verbose:
            logger.addFilter(_drop_banner)
    # filterwarnings moves an identical filter to the front instead of adding a second, so repeated runs in one
    # process (sweeps, tests) do not pile filters up, and ours stay ahead of broader ones added since.
    for message, category in _QUIET_WARNINGS:
        ours = any(f[0] == "ignore" and f[1] is not None and f[1].pattern == message for f in warnings.filters)
        if not verbose:
            warnings.filterwarnings("ignore", message=message, category=category)
        elif ours:
            warnings.filterwarnings("default", message=message, category=category)
    # transformers' "Loading weights" bar (rank 0 reading a checkpoint, every rank under ddp).
    from transformers.utils import logging as transformers_logging

    if verbose:
        transformers_logging.enable_progress_bar()
    else:
        transformers_logging.disable_progress_bar()
