"""How many chunks of positions each rank scores when its ranks must call the output head in step."""

from __future__ import annotations

import math
from typing import Any

import torch


def agreed_chunks(rows: int, chunk_size: int, group: Any, device: torch.device) -> int:
    """How many head calls of ``chunk_size`` rows each rank makes: the most any rank of ``group`` needs for its
    ``rows`` (``group`` ``None``: this rank's own). A rank past its rows calls the head on none, so that every
    block's all-gather has all its ranks."""
    chunks = math.ceil(rows / chunk_size)
    if group is None:
        return chunks
    import torch.distributed as dist

    count = torch.tensor(chunks, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count)
