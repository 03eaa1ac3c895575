"""Exact sharding of evaluation windows over ranks.

Lightning's default validation sampler (``DistributedSampler``) pads by *repeating* samples so every rank
gets the same count: 5 windows on 2 ranks become ``[0, 2, 4]`` and ``[1, 3, 0]``, and window 0 is scored
twice. Here every window goes to exactly one rank, ranks are balanced by tokens (not by window count), and
short ranks are padded with *empty* batches (``[PAD]``) that score nothing, so every rank runs the same
number of steps and no collective (FSDP's all-gather, the final metric sync) waits for a rank that ended.

Two plans:

* per window (``deterministic=False``): windows are shared out, then each rank batches its own; a window's
  batch (its neighbours, its padding) depends on the world size, so results agree to rounding across sizes.
* per batch (``deterministic=True``): batches are formed once from the windows alone, the same at every world
  size, and ranks receive whole batches; a window is computed in the same batch, at the same row, with the same
  shape whichever rank runs it, so per-token losses are bit-identical at every world size.

Ranks may be given relative speeds (``weights``): shares follow them, and a slower rank's padding steps are
spread among its real ones, so that at every periodic cross-rank check each rank has done its share.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from lit_ppl.errors import LitPplError

PAD = -1  # window id of a padding batch entry: scored tokens 0, documents 0


def _check_weights(weights: Sequence[float] | None, world_size: int) -> list[float]:
    if world_size < 1:
        raise LitPplError(f"world_size must be >= 1, got {world_size}")
    if weights is None:
        return [1.0] * world_size
    if len(weights) != world_size or not all(w > 0 for w in weights):
        raise LitPplError(f"rank weights {list(weights)} must be {world_size} positive numbers, one per rank")
    return [float(w) for w in weights]


def share(costs: np.ndarray, world_size: int, weights: Sequence[float] | None = None) -> list[np.ndarray]:
    """Assign items to ranks, costliest first, each to the rank whose load ÷ weight is lowest so far.

    Deterministic: a function of the costs, ``world_size`` and the weights only (ties go to the lower rank and
    the lower item id). Each rank's items come back costliest first.

    Examples:
        >>> [s.tolist() for s in share(np.array([5, 1, 4, 2, 3]), 2)]
        [[0, 3, 1], [2, 4]]
        >>> [s.tolist() for s in share(np.array([4, 4, 4, 4]), 2, weights=[3.0, 1.0])]
        [[0, 2, 3], [1]]
    """
    speed = _check_weights(weights, world_size)
    order = np.lexsort((np.arange(len(costs)), -np.asarray(costs)))
    heap = [(0.0, rank) for rank in range(world_size)]
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for idx in order.tolist():
        _, rank = heapq.heappop(heap)
        shards[rank].append(idx)
        loads[rank] += int(costs[idx])
        heapq.heappush(heap, (loads[rank] / speed[rank], rank))
    return [np.asarray(s, dtype=np.int64) for s in shards]


def global_batches(lengths: np.ndarray, batch_size: int) -> list[list[int]]:
    """Windows batched once, longest first, independent of any world size (deterministic mode's unit of work).

    Examples:
        >>> global_batches(np.array([3, 9, 5, 9]), 2)
        [[1, 3], [2, 0]]
    """
    order = np.lexsort((np.arange(len(lengths)), -np.asarray(lengths))).tolist()
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _spread(batches: list[list[int]], steps: int) -> list[list[int]]:
    """``batches`` laid over ``steps`` steps, padding steps evenly between them (all at the end if none fit)."""
    out = [[PAD] for _ in range(steps)]
    for i, batch in enumerate(batches):
        out[i * steps // len(batches)] = batch
    return out


def plan_batches(
    lengths: np.ndarray,
    world_size: int,
    batch_size: int,
    weights: Sequence[float] | None = None,
    deterministic: bool = False,
) -> list[list[list[int]]]:
    """Every rank's list of batches (window ids), all ranks padded to the same number of steps.

    With ``weights`` (relative rank speeds), a rank's share of the tokens follows its weight; without
    ``deterministic``, a slower rank also gets proportionally smaller batches, so that every step (a collective
    under FSDP) costs every rank about the same time.
    """
    if batch_size < 1:
        raise LitPplError(f"batch_size must be >= 1, got {batch_size}")
    speed = _check_weights(weights, world_size)
    lengths = np.asarray(lengths)
    if deterministic:
        batches = global_batches(lengths, batch_size)
        costs = np.asarray([len(b) * int(lengths[b].max()) for b in batches], dtype=np.int64)  # padded size
        per_rank = [[batches[i] for i in s.tolist()] for s in share(costs, world_size, weights)]
    else:
        sizes = [max(1, round(batch_size * w / max(speed))) for w in speed]
        per_rank = [
            [s[i : i + size].tolist() for i in range(0, len(s), size)]
            for s, size in zip(share(lengths, world_size, weights), sizes, strict=True)
        ]
    steps = max(len(b) for b in per_rank)
    return [_spread(b, steps) if b else [[PAD]] * steps for b in per_rank]


class ExactBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of window ids (``[PAD]`` for padding steps).

    Args:
        lengths: input tokens of every window, the same on every rank.
        rank: this process's *global* rank (not its local rank: lm-eval #1081).
        world_size: number of processes.
        batch_size: windows per batch.
        skip: batches already done (resuming), skipped without being produced.
        weights: relative speed of every rank (``None``: equal).
        deterministic: batches formed independently of the world size (see the module docstring).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        rank: int,
        world_size: int,
        batch_size: int,
        skip: int = 0,
        weights: Sequence[float] | None = None,
        deterministic: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise LitPplError(f"rank {rank} is outside [0, world_size={world_size})")
        self.plan = plan_batches(lengths, world_size, batch_size, weights, deterministic)
        self.batches = self.plan[rank]
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches[self.skip :]

    def __len__(self) -> int:
        return len(self.batches) - self.skip
