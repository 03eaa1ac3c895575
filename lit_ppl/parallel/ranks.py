"""Process-group helpers that turn a dead or failing rank into one clear error instead of a hang."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from lit_ppl.errors import UserError, first_line


class RankFailure(UserError, RuntimeError):
    """A peer rank died, raised, or did not reach a synchronisation point in time."""


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, or ``(0, 1)``.

    Unlike :func:`rank`, no launcher variables: callers size collectives with it, and before the group exists
    there is no one to exchange with.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_CONTROL: dict[int, dist.ProcessGroup] = {}


def control_group() -> dist.ProcessGroup | None:
    """A gloo group for health checks and host-side flags (``monitored_barrier`` is gloo-only, and a CPU
    all-reduce never syncs the GPU); ``None`` when not distributed.

    The first call must be made by every rank at the same point, like any group creation; later calls return
    the same group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    key = id(dist.group.WORLD)
    if key not in _CONTROL:
        _CONTROL[key] = dist.new_group(backend="gloo")
    return _CONTROL[key]


@contextmanager
def peers_alive(where: str) -> Iterator[None]:
    """Turn a collective that failed because a peer died into one clear :class:`RankFailure`."""
    try:
        yield
    except RuntimeError as err:  # gloo/NCCL errors (DistError is a RuntimeError too)
        raise RankFailure(
            f"rank {rank()}: lost contact with another rank during {where} — it died, was killed or raised "
            f"(see its log): {first_line(err)}"
        ) from err


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


# What the transports say when the other end of a collective went away (gloo raises a plain RuntimeError from inside
# FSDP's and DTensor's collectives; NCCL a DistBackendError).
_PEER_GONE = (
    "gloo/transport/",
    "Connection reset by peer",
    "Connection closed by peer",
    "NCCL communicator was aborted",
)


def peer_failure(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a collective that failed because another rank is gone."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, dist.DistError) or (
            isinstance(seen, RuntimeError) and any(m in str(seen) for m in _PEER_GONE)
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
