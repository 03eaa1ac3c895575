"""How work is shared between ranks of unequal speed (``distributed.balance``).

* ``tokens`` — every rank gets the same number of tokens (ranks are alike).
* ``weights`` — the user gives relative speeds, per node (``[1.0, 0.4]`` on 2 nodes) or per rank.
* ``measured`` — every rank times a few identical probe batches of ``batch_size × seq_len`` tokens, and the
  shares follow the measured tokens/s.

Every window is still scored exactly once (:mod:`lit_ppl.data.sampler`); only who scores it changes. Weighting pays
where ranks run independently between the periodic cross-rank checks (``ddp``): the slow rank gets less work and
its padding steps are spread among its real ones. Under ``fsdp``/``hsdp`` every step is a collective: the
plan then also gives a slower rank proportionally smaller batches (so that every step costs each rank about the
same), which deterministic mode cannot do (its batches are the same at every world size), and the probe cannot
time a rank alone (its forward waits for the others' all-gathers) — both refused with one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lit_ppl.config.values import BALANCES
from lit_ppl.errors import LitPplError


def check(
    balance: str, weights: Sequence[float] | None, strategy: str, deterministic: bool, world_size: int, num_nodes: int
) -> None:
    """Refuse, before anything loads, a balance setting that cannot work."""
    if balance not in BALANCES:
        raise LitPplError(f"distributed.balance={balance!r} is not one of {', '.join(BALANCES)}")
    if balance == "weights" and (not weights or not all(isinstance(w, int | float) and w > 0 for w in weights)):
        raise LitPplError(
            f"distributed.balance=weights needs distributed.weights: positive relative speeds per node or per rank, "
            f"e.g. [1.0,0.4]; got {weights}"
        )
    sharded = strategy not in ("single", "ddp")  # the layout's kind: FSDP and TP make every step a collective
    if sharded and balance == "measured":
        raise LitPplError(
            f"distributed.balance=measured cannot time a rank alone under strategy={strategy} (every forward waits "
            "for the other ranks' all-gathers); give distributed.balance=weights with distributed.weights"
        )
    if sharded and deterministic and balance != "tokens":
        raise LitPplError(
            f"distributed.balance={balance} cannot help under strategy={strategy} with eval.deterministic=true: every "
            "step is a collective and deterministic batches have the same shape on every rank; use "
            "eval.deterministic=false (a slower rank then gets smaller batches) or distributed.balance=tokens"
        )
    if balance == "weights":
        given_weights(weights, world_size, num_nodes)


def given_weights(weights: Sequence[float], world_size: int, num_nodes: int) -> list[float]:
    """Per-rank weights from per-node (ranks ``node·devices …``) or per-rank ``weights``.

    Examples:
        >>> given_weights([1.0, 0.5], world_size=4, num_nodes=2)
        [1.0, 1.0, 0.5, 0.5]
    """
    weights = [float(w) for w in weights]
    if len(weights) == world_size:
        return weights
    if len(weights) == num_nodes and world_size % num_nodes == 0:
        per_node = world_size // num_nodes
        return [weights[rank // per_node] for rank in range(world_size)]
    raise LitPplError(
        f"distributed.weights has {len(weights)} entries; give one per node ({num_nodes}) or one per rank "
        f"({world_size})"
    )


def probe_tokens_per_s(
    scorer: nn.Module, batch_size: int, seq_len: int, context: Callable[[], Any] | None = None, repeats: int = 3
) -> float:
    """This rank's tokens/s over ``repeats`` identical ``batch_size × seq_len`` batches (after one warm-up).

    The total time, not the best run: a rank that is throttled (a CPU quota, a shared GPU) is slow on average.
    """
    from lit_ppl.data.autobatch import scorer_batch_runner

    run = scorer_batch_runner(scorer, seq_len, context)
    device = next(scorer.parameters()).device
    start = 0.0
    for i in range(repeats + 1):
        if i == 1:  # the first run pays for allocation and kernel selection
            start = time.perf_counter()
        run(batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return repeats * batch_size * seq_len / (time.perf_counter() - start)


def measured_weights(tokens_per_s: float) -> tuple[list[float], list[float]]:
    """Every rank's measured tokens/s (one all-gather) and the weights they give (the fastest rank 1.0)."""
    import torch.distributed as dist

    speeds = [tokens_per_s]
    if dist.is_available() and dist.is_initialized():
        gathered: list[float | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tokens_per_s)
        speeds = [float(s) for s in gathered]
    fastest = max(speeds)
    return speeds, [s / fastest for s in speeds]
