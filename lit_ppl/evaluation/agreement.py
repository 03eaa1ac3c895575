"""The start-up agreement check: every rank scores the same text with the same model and settings, or none does.

Nodes are started separately (``torchrun`` per node, ``srun`` tasks), each with its own command line and files: a
node given another ``eval.seq_len``, another ``data.path`` or other weights would silently contribute other
numbers. Before the first step every rank all-gathers a fingerprint of what decides the numbers, made
location-free so that nodes reading their own copies of the same files agree: the config's number keys (no paths),
the exact windows and document lengths, the model's file names and sizes, the layout and batch plan.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lit_ppl.errors import LitPplError
from lit_ppl.parallel.ranks import control_group, peers_alive


def _disagreement(everyone: list[dict[str, Any]]) -> str | None:
    """The one line naming the keys on which ranks differ from rank 0 and which ranks; ``None`` if all agree."""
    first = everyone[0]
    keys = sorted({k for other in everyone for k in {*first, *other} if other.get(k) != first.get(k)})
    if not keys:
        return None
    ranks = [r for r, other in enumerate(everyone) if any(other.get(k) != first.get(k) for k in keys)]
    shown = "; ".join(f"{k}: rank 0 {first.get(k)!r}, rank {ranks[0]} {everyone[ranks[0]].get(k)!r}" for k in keys)
    return (
        f"the ranks disagree on {', '.join(keys)} (ranks {ranks} differ from rank 0: {shown}); every node must run "
        "the same config on the same text and weights"
    )


class AgreementCheck(Callback):
    """Refuses, on every rank, a job whose ranks would score different things (see the module docstring).

    Args:
        fingerprint: this rank's location-free facts known from the config (number keys, model files, layout).
    """

    def __init__(self, fingerprint: dict[str, Any]) -> None:
        self.fingerprint = fingerprint

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        group = control_group()
        if group is None:
            return
        # The datamodule is set up already: Lightning runs its setup before the callbacks'.
        mine = {**self.fingerprint, "windows": trainer.datamodule.windows_digest()}
        everyone: list[Any] = [None] * dist.get_world_size()
        with peers_alive("the start-up agreement check"):
            dist.all_gather_object(everyone, mine, group=group)
        problem = _disagreement(everyone)
        if problem:
            raise LitPplError(problem)
