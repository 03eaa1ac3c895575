"""Exact sharding of evaluation windows over ranks.

Lightning's default validation sampler (``DistributedSampler``) pads by *repeating* samples so every rank
gets the same count: 5 windows on 2 ranks become ``[0, 2, 4]`` and ``[1, 3, 0]``, and window 0 is scored
twice. Here every window goes to exactly one rank, ranks are balanced by tokens (not by window count), and
short ranks are padded with *empty* batches (``[PAD]``) that score nothing, so every rank runs the same
number of steps and no collective (FSDP's all-gather, the final metric sync) waits for a rank that ended.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

PAD = -1  # window id of a padding batch entry: scored tokens 0, documents 0


def shard_by_tokens(lengths: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Assign windows to ranks, longest first, each to the rank with the fewest tokens so far.

    Deterministic: a function of the window lengths and ``world_size`` only (ties go to the lower rank and
    the lower window id). Each rank's windows come back sorted longest first, so consecutive windows in a
    batch have similar lengths and little padding.

    Examples:
        >>> [s.tolist() for s in shard_by_tokens(np.array([5, 1, 4, 2, 3]), 2)]
        [[0, 3, 1], [2, 4]]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = np.lexsort((np.arange(len(lengths)), -np.asarray(lengths)))
    heap = [(0, rank) for rank in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for idx in order.tolist():
        load, rank = heapq.heappop(heap)
        shards[rank].append(idx)
        heapq.heappush(heap, (load + int(lengths[idx]), rank))
    return [np.asarray(s, dtype=np.int64) for s in shards]


def plan_batches(lengths: np.ndarray, world_size: int, batch_size: int) -> list[list[list[int]]]:
    """Every rank's list of batches (window ids), all ranks padded to the same number of steps."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    per_rank = [
        [s[i : i + batch_size].tolist() for i in range(0, len(s), batch_size)]
        for s in shard_by_tokens(lengths, world_size)
    ]
    steps = max(len(b) for b in per_rank)
    return [b + [[PAD]] * (steps - len(b)) for b in per_rank]


class ExactBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of window ids (``[PAD]`` for padding steps).

    Args:
        lengths: input tokens of every window, the same on every rank.
        rank: this process's *global* rank (not its local rank: lm-eval #1081).
        world_size: number of processes.
        batch_size: windows per batch.
        skip: batches already done (resuming), skipped without being produced.
    """

    def __init__(self, lengths: np.ndarray, rank: int, world_size: int, batch_size: int, skip: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        self.plan = plan_batches(lengths, world_size, batch_size)
        self.batches = self.plan[rank]
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches[self.skip :]

    def __len__(self) -> int:
        return len(self.batches) - self.skip
