"""Which library lines a plain run shows: the host's logging and warning filters, set once per run (``verbose``)."""

from __future__ import annotations

import logging
import warnings

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
