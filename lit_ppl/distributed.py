"""Process-group helpers that turn a dead or failing rank into one clear error instead of a hang."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


class RankFailure(RuntimeError):
    """A peer rank died, raised, or did not reach a synchronisation point in time."""


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def control_group() -> dist.ProcessGroup | None:
    """A gloo group for health checks (``monitored_barrier`` is gloo-only); ``None`` when not distributed.

    Must be called by every rank at the same point, like any group creation.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def check_peers(group: dist.ProcessGroup | None, timeout_s: float, where: str) -> None:
    """Every rank must reach ``where`` within ``timeout_s``; otherwise name the ranks that did not.

    Rank 0 hears from every other rank (``wait_all_ranks``), so its message lists all missing ranks; the
    others only learn that rank 0 is unreachable.
    """
    if group is None:
        return
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as err:
        raise RankFailure(
            f"rank {rank()}: not every rank reached {where} within {timeout_s:g} s — a rank died, was killed or "
            f"raised (see its log): {first_line(err)}"
        ) from err


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (torch's collective errors span pages)."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__
