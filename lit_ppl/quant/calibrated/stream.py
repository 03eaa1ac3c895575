"""Streaming the calibration windows through the float model with hooks that accumulate fixed-size statistics.

A calibrated method (:mod:`lit_ppl.quant.calibrated.awq`, :mod:`lit_ppl.quant.calibrated.gptq`) registers a forward
pre-hook per observed layer (:func:`stream`), streams this data-parallel rank's share of the calibration batches
(:meth:`lit_ppl.quant.calibrated.text.Calibration.batches`: global batch ``g`` on rank ``g mod D``) and sums its
statistics over the ranks in :class:`Sums`, so every rank holds the numbers of the whole calibration set and memory
does not grow with it.

Why the sums do not depend on the number of ranks: each batch's float64 partial is computed alone (the same
windows, the same kernels, one thread per rank in deterministic mode: the same bits at any world size), and after
every step the ranks' partials of that step are gathered and added in global batch order, so the total is
``((p₀ + p₁) + p₂) + …`` whether one process or ``D`` ranks computed the ``pᵢ``. :mod:`lit_ppl.metrics.exact`'s
fixed-point sums would also be order-free but need every value below ``2^22`` and resolve ``2^-40`` absolutely,
which activations with outliers (``x²`` sums in the millions) and small channels both break. Under tensor
parallelism each layer is observed whole (:mod:`lit_ppl.quant.calibrated.split`): the ranks of a group hold the
same partials, and the first rank of each group stands for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from lit_ppl.model.scorer import decoder_and_head
from lit_ppl.quant.calibrated.split import TpView, whole_matmuls
from lit_ppl.quant.calibrated.text import Calibration


@dataclass(frozen=True)
class Where:
    """Where calibration runs: this rank's data-parallel ``rank`` of ``size`` (each a share of the batches) and its
    tensor-parallel view (``None``: each rank holds whole layers)."""

    rank: int = 0
    size: int = 1
    tp: TpView | None = None

    @property
    def tp_size(self) -> int:
        return self.tp.tp.size if self.tp is not None else 1


class Sums:
    """Per layer, float64 statistics (and int64 counts) summed over every data-parallel rank's batches in global
    batch order: a hook :meth:`add` s one batch's value, :meth:`step` adds the ranks' values of the step in order."""

    def __init__(self, where: Where, total: dict[str, dict[str, torch.Tensor]]) -> None:
        self.where, self.total = where, total
        self.partial = (
            {n: {k: torch.zeros_like(v) for k, v in st.items()} for n, st in total.items()} if where.size > 1 else None
        )

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        return self.total[name]

    def add(self, name: str, key: str, value: torch.Tensor, index: int | None = None) -> None:
        """Add one batch's ``value`` (computed alone) to ``name``'s ``key`` (element ``index``)."""
        into = (self.partial or self.total)[name][key]
        if index is None:
            into += value
        else:
            into[index] += value

    def add_keys(self, keys: dict[str, dict[str, torch.Tensor]]) -> None:
        """New statistics, zeroed, for the next pass (``name -> key -> zeros``)."""
        for name, st in keys.items():
            self.total[name].update(st)
            if self.partial is not None:
                self.partial[name].update({k: torch.zeros_like(v) for k, v in st.items()})

    def step(self) -> None:
        """Every rank's partials of this step added to the totals, in data-parallel rank order (collective)."""
        if self.partial is None:
            return
        import torch.distributed as dist

        world, every = self.where.size * self.where.tp_size, self.where.tp_size
        for name, st in self.partial.items():
            for key, part in st.items():
                parts = [torch.empty_like(part) for _ in range(world)]
                dist.all_gather(parts, part)
                total = self.total[name][key]
                for d in range(self.where.size):  # global batch order: step·D + d
                    total += parts[d * every]
                part.zero_()


class WeightShape(NamedTuple):
    """What a statistics factory reads of a weight: the whole layer's shape (its split undone) and its device."""

    shape: tuple[int, ...]
    device: torch.device


def layer_statistics(
    lm: nn.Module,
    names: list[str],
    calibration: Calibration,
    where: Where,
    sums: Callable[[WeightShape], dict[str, torch.Tensor]],
) -> tuple[dict[str, nn.Module], list[list[int]], list[torch.Tensor], Sums]:
    """What a calibrated method's pass starts from: the observed layers, this rank's calibration batches, the box
    its hooks read the real-position mask from, and per layer the zeroed ``sums(whole weight's shape)`` plus a
    token ``count``."""
    modules = {n: lm.get_submodule(n) for n in names}
    stats = {
        name: {**sums(_whole_shape(mod, name, where)), "count": torch.zeros((), dtype=torch.int64, device=_dev(mod))}
        for name, mod in modules.items()
    }
    return modules, calibration.batches(where.rank, where.size), [torch.ones(0)], Sums(where, stats)


def _dev(mod: nn.Module) -> torch.device:
    return mod.weight.device


def _whole_shape(mod: nn.Module, name: str, where: Where) -> WeightShape:
    """The layer's whole weight's shape and device, without allocating it."""
    shape = list(mod.weight.shape)
    if where.tp is not None and where.tp.rowwise(name):
        shape[1] = mod.full_in_features
    return WeightShape(tuple(shape), mod.weight.device)


def ordered_rows(rows: torch.Tensor, where: Where) -> torch.Tensor:
    """Every data-parallel rank's ``rows`` (row ``k``: its batch of step ``k``, zeros past its last) stacked in
    global batch order (collective over every rank)."""
    parts = [rows]
    if where.size * where.tp_size > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(rows) for _ in range(where.size * where.tp_size)]
        dist.all_gather(parts, rows.contiguous())
    return torch.stack([parts[d * where.tp_size][k] for k in range(rows.shape[0]) for d in range(where.size)])


def ordered_sum(rows: torch.Tensor, where: Where) -> torch.Tensor:
    """``Σ`` over dim 0 of every data-parallel rank's ``rows`` in global batch order: the same bits at any world
    size (collective over every rank)."""
    total = torch.zeros_like(rows[0])
    for row in ordered_rows(rows, where):
        total += row
    return total


def _unless_idle(hook: Callable[[nn.Module, tuple], None], real_box: list) -> Callable[[nn.Module, tuple], None]:
    """``hook``, skipped in a rank's idle forward (``real_box[0]`` is ``None``: see :func:`_run`)."""

    def observed(module: nn.Module, args: tuple) -> None:
        if real_box[0] is not None:
            hook(module, args)

    return observed


class Stop(Exception):
    """Raised after the last observed block: the rest of the forward pass would observe nothing."""


def _stop_hook(*_: Any) -> None:
    raise Stop


BLOCK = re.compile(r"(.*?)\.(\d+)\.")  # "model.layers.3.mlp.up_proj" -> block list "model.layers", index 3


def block_of(name: str) -> tuple[str, int] | None:
    """``(block list, index)`` of a module inside a numbered decoder block, or ``None`` (e.g. the head)."""
    m = BLOCK.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def _run(
    lm: nn.Module, calibration: Calibration, batches: list[list[int]], real_box: list[torch.Tensor], sums: Sums
) -> None:
    """Stream ``batches`` through the float model; hooks read ``real_box[0]``, the mask of real positions. Every
    data-parallel rank takes the same number of steps, each a forward (a rank past its last batch runs the first
    global batch, its hooks observing nothing: it adds nothing, and the layers' gathers of weights held by rows, as
    :mod:`lit_ppl.parallel.float_rows` holds them, still have every rank) ending with :meth:`Sums.step`."""
    decoder, head = decoder_and_head(lm)
    device = next(lm.parameters()).device
    with torch.no_grad(), whole_matmuls(lm, sums.where.tp):
        for k in range(calibration.steps(sums.where.size)):
            if k < len(batches):
                _forward(decoder, head, calibration, batches[k], device, real_box)
            elif sums.where.size > 1:
                _forward(decoder, head, calibration, calibration.batches(0, 1)[0], device, real_box, idle=True)
            sums.step()


def _forward(
    decoder: nn.Module,
    head: nn.Module,
    calibration: Calibration,
    ids: list[int],
    device: torch.device,
    box: list,
    idle: bool = False,
) -> None:
    input_ids, real = calibration.batch(ids, device)
    box[0] = None if idle else real  # None: the hooks observe nothing (see stream)
    try:
        out = decoder(input_ids=input_ids, use_cache=False)
    except Stop:
        return
    hidden = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
    if getattr(head, "_lit_ppl_awq", False):  # the head's input only matters when the head is calibrated
        head(hidden)


def stream(
    lm: nn.Module,
    modules: dict[str, nn.Module],
    make: Callable[[str], Callable[[nn.Module, tuple], None]],
    calibration: Calibration,
    batches: list[list[int]],
    real_box: list[torch.Tensor],
    sums: Sums,
    stop: nn.Module | None = None,
) -> None:
    """One pass of ``batches`` with the pre-hook ``make(name)`` on every module of ``modules``, their values summed
    in ``sums``; ``stop``: a module after whose forward each batch's pass ends (nothing after it is observed)."""
    handles = [mod.register_forward_pre_hook(_unless_idle(make(name), real_box)) for name, mod in modules.items()]
    if stop is not None:
        handles.append(stop.register_forward_hook(_stop_hook))
    head = lm.get_output_embeddings()
    marked = head is not None and any(m is head for m in modules.values())
    if marked:
        head._lit_ppl_awq = True
    try:
        _run(lm, calibration, batches, real_box, sums)
    finally:
        for h in handles:
            h.remove()
        if marked:
            del head._lit_ppl_awq
