"""The reference's noise floor: the KLD its own arithmetic produces, so that a candidate's KLD reads against it.

``compare.noise_floor=N`` (windows; 0: off) picks N windows that score tokens, spread evenly over the corpus by their
global index (:func:`sample_windows`: the same windows at any layout and batch size), and scores each alone twice:
by the reference as the run scores it (its weights' dtype, the run's precision context, its own dtype's context) and
by a float64 copy of the reference built from its checkpoint (:func:`lit_ppl.model.placement.place`: split and
sharded like it, so a sharded reference is re-scored sharded). ``results.json["compare"]["noise_floor"]`` then holds
KL(float64 ‖ run) of those tokens (:func:`measure`): the rounding of the weights to the run's dtype and of every
operation after it — what a candidate's KLD cannot be read below.

* live reference (``compare=unquantized``, ``compare.reference=…``): measured at the end of the run;
* saved reference (``compare=saved``): the run that saved the store measured it on its live model (the reference
  then) and wrote it in the store's manifest; the comparison reports it as stored (``"source": "saved"``), the same
  number as the live comparison of that reference in that precision. A store saved with ``compare.noise_floor=0``
  (or before lit-ppl measured it) has none: ``kld_mean`` is ``null`` with a ``note``;
* a quantized reference: not measured (``kld_mean`` ``null``, a ``note``): its float64 re-score would measure its
  quantization, not its rounding;
* ``compare.noise_floor=0``: the key is ``null``;
* a float64 copy that would not fit (its share of the weights on any rank past what
  :func:`lit_ppl.data.autobatch.default_budget` allows: 90% of the free GPU memory, half the available host memory):
  not measured, the ``note`` gives both sizes.

Cost: a float64 copy of the reference (built from its checkpoint, freed after) and two forwards of each sampled
window, about ``N / windows`` of a comparison's evaluation (the default 4 of a few hundred windows: about 1%; a text
of 4 windows or fewer: as much again). Measured after the run's ``seconds``.

Exact under every layout: each window's sums go to its own row of
:class:`lit_ppl.metrics.noise_floor.NoiseFloorSums` (one rank fills it), added in window order. Under fsdp the
float64 re-score all-gathers the same weights as one process holds, so the figure is one process's; under tensor
parallelism both scores carry the split sums' rounding (like the comparison itself), so it agrees with one process's
to the precision's rounding, not bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from lit_ppl.data.autobatch import default_budget
from lit_ppl.data.datamodule import WindowCollator
from lit_ppl.data.windows import spread
from lit_ppl.metrics.kl import token_stats
from lit_ppl.metrics.noise_floor import NoiseFloorSums
from lit_ppl.model.placement import Placement, place, weight_bytes
from lit_ppl.model.scorer import TokenScorer
from lit_ppl.model.spec import ModelSpec

Context = Callable[[], contextlib.AbstractContextManager]


def sample_windows(first_token: np.ndarray, count: int) -> np.ndarray:
    """Window ids of ``count`` windows that score tokens, spread evenly over the corpus (all of them when fewer):
    a rule on the global window index alone, so every rank, layout and batch plan picks the same.

    Examples:
        >>> sample_windows(np.array([0, 4, 4, 9, 12, 20]), 2).tolist()
        [0, 4]
        >>> sample_windows(np.array([0, 4, 4, 9]), 5).tolist()
        [0, 2]
    """
    chosen = np.flatnonzero(np.diff(np.asarray(first_token, dtype=np.int64)) > 0)
    return chosen[spread(len(chosen), count)]


@dataclasses.dataclass
class Reference:
    """The reference as the run scores it: its checkpoint (``spec``), its placed ``scorer``, the context its forward
    runs in (``context``: the precision plugin's step context and its own), and the run's precision name."""

    spec: ModelSpec
    scorer: TokenScorer
    context: Context
    precision: str


def not_measured(reason: str) -> dict[str, Any]:
    """A noise floor that could not be measured honestly, and why."""
    return {"kld_mean": None, "note": reason}


def measure(module: Any, reference: Reference, count: int) -> dict[str, Any] | None:
    """The noise floor of ``reference`` on ``count`` sampled windows (``None``: ``count`` is 0), every rank.

    ``module``: the run's :class:`lit_ppl.evaluation.module.PerplexityModule` (its trainer, data, placement and
    rank layout). Collective: every rank calls it; under a split layout every rank runs as many forwards.
    """
    if count <= 0:
        return None
    too_big = _too_big(module, reference.scorer)
    if too_big:
        return not_measured(too_big)
    dm = module.trainer.datamodule
    ids = sample_windows(dm.first_token, count)
    placement: Placement = dataclasses.replace(module.placement, compile_decoder=False)
    exact64, _ = place(reference.spec, placement, torch.float64)
    sums = NoiseFloorSums(len(ids)).to(module.device)
    collate = WindowCollator(dm.corpus, dm.windows, first_token=dm.first_token)
    rank, size = _data_rank(module)
    mine = list(range(rank, len(ids), size))
    steps = math.ceil(len(ids) / size) if placement.split else len(mine)  # split: collectives in lockstep
    try:
        for step in range(steps):
            slot = mine[step] if step < len(mine) else None  # None: a padding forward, not counted
            batch = collate([int(ids[slot if slot is not None else 0])])
            stats = _window(module, reference, exact64, batch)
            if slot is not None and module.accumulate:
                sums.update(slot, stats["kld"], stats["kld_rev"], stats["same_top"])
        out = sums.compute()  # the sync: every rank
    finally:
        del exact64
        gc.collect()
    return {**out, "windows": len(ids), "precision": reference.precision, "source": "live"}


def _too_big(module: Any, scorer: TokenScorer) -> str | None:
    """Why a float64 copy of ``scorer`` would not fit beside the run's models on some rank (``None``: it fits); every
    rank's verdict is every rank's, so that all build it or none."""
    dtype = next(scorer.parameters()).dtype
    needed = weight_bytes(scorer) * 8 // (torch.finfo(dtype).bits // 8)
    budget = default_budget(module.device)
    fits = module.trainer.strategy.reduce_boolean_decision(needed <= budget, all=True)
    if fits:
        return None
    return (
        f"a float64 copy of the reference does not fit on every rank (rank {module.global_rank}: "
        f"{needed / 2**30:.3g} GiB needed, {budget / 2**30:.3g} GiB free); fsdp would split it"
    )


def _data_rank(module: Any) -> tuple[int, int]:
    """This rank's share of the sampled windows: its data-parallel index and their count (a tensor-parallel group
    scores the same windows)."""
    layout, rank = module.layout, module.global_rank
    if layout is None:
        return rank, module.trainer.world_size
    return layout.dp_rank(rank), layout.dp_size


def _window(module: Any, reference: Reference, exact64: TokenScorer, batch: dict[str, Any]) -> dict[str, Any]:
    """:func:`token_stats` of one window: the reference as the run scores it (the candidate's side) against the
    float64 copy (the base), the copy's forward nested in the reference's so that both heads are gathered."""
    device = module.device
    ids, index, targets = (batch[k].to(device) for k in ("input_ids", "score_index", "targets"))
    scorer, exact = reference.scorer, float64_context(device.type)
    group = scorer.tp.group if scorer.tp is not None else None
    start = int(getattr(scorer.head_module, "vocab_start", 0))

    def against(hidden: torch.Tensor, run: TokenScorer) -> dict[str, Any]:
        def stats(hidden64: torch.Tensor, base: TokenScorer) -> dict[str, Any]:
            chunk, lockstep = module.chunk_size, run.lockstep or base.lockstep
            return token_stats(hidden, hidden64, targets, run.head, base.head, chunk, exact, group, start, lockstep)

        return exact64(ids, index, targets, then=stats, context=exact)

    with torch.no_grad(), reference.context():
        return scorer(ids, index, targets, then=against)


def float64_context(device_type: str) -> Context:
    """The float64 copy's context inside the run's: autocast off, float64 the default dtype (a 16-true run's plugin
    sets its own)."""

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            with torch.autocast(device_type, enabled=False):
                yield
        finally:
            torch.set_default_dtype(default)

    return context


def reference_context(module: Any, own: Context) -> Context:
    """The context the run scores a reference in: the precision plugin's step context, then the reference's ``own``."""

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with module.trainer.precision_plugin.val_step_context(), own():
            yield

    return context
