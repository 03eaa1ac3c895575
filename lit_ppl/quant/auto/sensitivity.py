"""How much a quantized layer changes the model: its KL divergence from the float model on calibration text.

:class:`Meter` holds the float model's final hidden states for this rank's calibration batches (the reference, as
a comparison run holds the reference model's) and measures any variant of the model against them with
:func:`lit_ppl.metrics.kl.token_stats` — the comparison's own per-token statistics, in float64 — returning
``(Σ KLD, Σ NLL, Σ NLL of the float model, tokens)`` per batch of this rank; the caller sums them over the ranks in
global batch order.

A variant that differs only in decoder block ``b`` and later gives the same inputs to block ``b``, so
:meth:`Meter.measure` ``(start=b)`` replays the float output of block ``b - 1`` (kept per batch by
:meth:`Meter.advance`) instead of running blocks ``0 .. b - 1``: half the forward passes on average. The replay
swaps the first ``b`` entries of the decoder's block list for a stand-in that returns the kept output (reaching
the real block's attributes, e.g. ``attention_type``), so the architecture's own forward runs unchanged; that it
reproduces the float model is checked at every block on the first batch (a model whose blocks share state
outside their inputs fails the check and is measured by whole forward passes, one line in the log).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lit_ppl.metrics.kl import token_stats
from lit_ppl.model.scorer import decoder_and_head, head_fn, logit_transform, transform
from lit_ppl.quant.calibrated.stream import Stop
from lit_ppl.quant.calibrated.text import Calibration

log = logging.getLogger(__name__)

REPLAY_TOLERANCE = 1e-4  # largest |Δ hidden| / max |hidden| of a float replay: rounding, not another function


class StandIn(nn.Module):
    """Stands in for a decoder block in its block list: the architecture's own loop calls it and reads the block's
    attributes through it (e.g. ``attention_type``); the block is not a submodule, so module names stay as they are."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "block", block)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "block"), name)


class _Replay(StandIn):
    """Stands in for a decoder block the variant leaves unchanged: returns the block output kept for the batch."""

    def __init__(self, block: nn.Module, box: list[Any]) -> None:
        super().__init__(block)
        object.__setattr__(self, "box", box)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.box[0]


class Meter:
    """The float model's outputs on this rank's calibration batches, and measurements of variants against them.

    Args:
        lm: the model, in float (its weights at construction are the reference; the head's are kept even if a
            variant swaps them).
        calibration: the calibration text; ``rank``/``world_size``: this rank's share of its batches.
        chunk_size: positions per chunk of the float64 statistics (:func:`lit_ppl.model.nll.auto_chunk`).
        blocks: the decoder's block list (``model.layers``), or ``None``: every measurement is a whole forward.
        lockstep: layers are held by rows (:mod:`lit_ppl.parallel.float_rows`): every rank runs a forward per
            step, a rank past its last batch an idle one (the first global batch, measured and dropped).
    """

    def __init__(
        self,
        lm: nn.Module,
        calibration: Calibration,
        rank: int,
        world_size: int,
        chunk_size: int,
        blocks: str | None,
        lockstep: bool = False,
    ) -> None:
        self.lm, self.chunk_size, self.steps = lm, chunk_size, calibration.steps(world_size)
        self.world_size, self.device = world_size, next(lm.parameters()).device
        spec = calibration.spec.config
        self.units = spec.batch_size  # windows per batch, the most a batch has: the same on every rank
        self.decoder, head = decoder_and_head(lm)
        self.batches = []
        mine = calibration.batches(rank, world_size)
        self.real = len(mine)  # batches past these are idle
        for ids in mine + calibration.batches(0, 1)[:1] * (self.steps - len(mine) if lockstep else 0):
            input_ids, real = calibration.batch(ids, self.device)
            self.batches.append((input_ids, real, calibration.targets(ids, self.device)[real]))
        weight, bias, (scale, cap) = head.weight, head.bias, logit_transform(lm.config)
        self.head_base = lambda h: transform(F.linear(h, weight, bias), scale, cap)  # the float head, kept
        self.head = head_fn(lm, head)  # whatever weight the head holds now
        self.blocks = blocks
        self.layers = lm.get_submodule(blocks) if blocks is not None else None
        self.box: list[Any] = [None]
        self.kept: list[Any] = []  # per batch: the float output of block ``self.at - 1``
        self.at = 0
        self.replay = self.layers is not None
        self.reference = [self._hidden(input_ids, real) for input_ids, real, _ in self.batches]

    def _hidden(self, input_ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.decoder(input_ids=input_ids, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        return hidden[real]

    @contextmanager
    def _replaying(self, start: int) -> Iterator[None]:
        """Blocks ``0 .. start - 1`` return the kept output of block ``start - 1`` (``self.box``)."""
        if start == 0:
            yield
            return
        saved = [self.layers[i] for i in range(start)]
        for i, block in enumerate(saved):
            self.layers[i] = _Replay(block, self.box)
        try:
            yield
        finally:
            for i, block in enumerate(saved):
                self.layers[i] = block

    def advance(self, block: int) -> None:
        """Keep, per batch, the float output of block ``block - 1`` (the input of ``block``): the variants measured
        next differ from the float model in ``block`` and later only. Blocks are advanced in increasing order."""
        if not self.replay or block == self.at:
            return
        assert block > self.at, f"blocks are measured in forward order ({block} after {self.at}): a bug"
        last = self.layers[block - 1]
        kept = []

        def keep(_: nn.Module, __: Any, output: Any) -> None:
            kept.append(output)
            raise Stop  # nothing after the kept block is needed

        handle = last.register_forward_hook(keep)
        try:
            with self._replaying(self.at):
                for k, (input_ids, _, _) in enumerate(self.batches):
                    self.box[0] = self.kept[k] if self.at else None
                    try:
                        with torch.no_grad():
                            self.decoder(input_ids=input_ids, use_cache=False)
                    except Stop:
                        continue
        finally:
            handle.remove()
        self.kept, self.at = kept, block
        if not self._agreed(self._replays_float() if self.batches else True):
            log.warning(
                "sensitivity: replaying %s's blocks from block %d does not reproduce the float model; measuring "
                "each layer by whole forward passes",
                type(self.lm).__name__,
                block,
            )
            self.replay, self.kept, self.at = False, [], 0

    def _agreed(self, ok: bool) -> bool:
        """Whether every rank's check passed (collective where there are ranks): they measure alike."""
        if self.world_size == 1:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _replays_float(self) -> bool:
        """The replay from the current block, with float weights, gives the float hidden states (first batch)."""
        input_ids, real, _ = self.batches[0]
        with self._replaying(self.at):
            self.box[0] = self.kept[0]
            hidden = self._hidden(input_ids, real)
        ref = self.reference[0]
        scale = float(ref.abs().max()) or 1.0
        return hidden.shape == ref.shape and float((hidden - ref).abs().max()) <= REPLAY_TOLERANCE * scale

    def measure(self, start: int | None = None) -> torch.Tensor:
        """``(Σ KLD, Σ NLL, Σ NLL of the float model, tokens)`` (float64) of the model as it is now, per step of
        this rank's calibration batches (zeros past its last) and window of the batch: ``(steps, units, 4)``,
        stacked over the ranks in global batch order by :func:`lit_ppl.quant.calibrated.stream.ordered_rows` (the
        windows are the units of the measurement's variance: :meth:`lit_ppl.quant.auto.budget.Budget.bound`);
        ``start``: the first block it differs in, to which the probe was advanced (``None``: any, a whole
        forward)."""
        replay = self.replay and start is not None
        if replay and start != self.at:
            raise AssertionError(f"measure(start={start}) after advance({self.at}): a bug")
        sums = torch.zeros(self.steps, self.units, 4, dtype=torch.float64)
        with self._replaying(self.at if replay else 0), torch.no_grad():
            for k, (input_ids, real, targets) in enumerate(self.batches):
                self.box[0] = self.kept[k] if replay and self.at else None
                hidden = self._hidden(input_ids, real)
                if k >= self.real:  # an idle forward: its gathers had every rank, its figures are not this rank's
                    continue
                st = token_stats(hidden, self.reference[k], targets, self.head, self.head_base, self.chunk_size)
                parts = [st["kld"], st["nll"], st["nll_base"], torch.ones_like(st["nll"])]
                counts = real.sum(1).cpu()  # the scored tokens of each window, in the order hidden[real] has them
                window = torch.repeat_interleave(torch.arange(len(counts)), counts)
                for i, part in enumerate(parts):
                    sums[k, : len(counts), i] = torch.zeros(len(counts), dtype=torch.float64).index_add_(
                        0, window, part.double().cpu()
                    )
        return sums
