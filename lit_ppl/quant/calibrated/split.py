"""Calibration under tensor parallelism: a split layer's whole input and weight for its statistics and its solve,
and this rank's slice of what was solved on the whole layer.

A layer split by :func:`lit_ppl.parallel.tensor_parallel.parallelize` holds a block of output rows (column-parallel,
its input whole) or a block of input columns (row-parallel, its input a slice of the features). AWQ's scales and
GPTQ's Hessians are statistics of the whole input and GPTQ feeds each column's rounding error into the other
columns of the whole row, so a calibrated layer is observed and solved whole, identically on every rank of the
group (the gathers are the group's own collectives), and each rank keeps its slice: the quantized model is the one
a single process would build. While calibration observes, a row-parallel layer runs as one process runs it
(:func:`whole_matmuls`): its whole input and weight gathered, one matmul, rather than partial products summed over
the group, whose last bits differ — and GPTQ's rounding decisions, each feeding its error into the next columns,
turn a last-bit difference in a Hessian into different codes for a fifth of a layer's weights.

``quant=auto`` runs the whole model forward and backward with every candidate and reads whole layers and whole rows
of logits: :func:`as_one_process` makes the group compute as one process does for that while, each rank still
holding its slice of every decoder layer (gathered for each call, :mod:`lit_ppl.parallel.float_rows`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lit_ppl.parallel.float_rows import FloatRows
from lit_ppl.parallel.layout import KV_HEADS
from lit_ppl.parallel.tensor_parallel import Group, RowParallelLinear, VocabParallel, split_sizes, widths
from lit_ppl.runtime.memory import large_blocks_mapped

Split = int | tuple[int, int, int]  # parallelize's split of a parameter: a dim, or (dim, parts, index) for a KV head


def _parts(t: torch.Tensor, dim: int, tp: Group) -> list[torch.Tensor]:
    """Every rank's ``t`` (their sizes along ``dim`` may differ), in group rank order."""
    t = t.detach().contiguous()
    sizes = [torch.zeros((), dtype=torch.long, device=t.device) for _ in range(tp.size)]
    dist.all_gather(sizes, torch.tensor(t.shape[dim], device=t.device), group=tp.group)
    longest = max(int(s) for s in sizes)
    pad = list(t.shape)
    pad[dim] = longest - t.shape[dim]
    padded = torch.cat([t, t.new_zeros(pad)], dim=dim) if pad[dim] else t
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=tp.group)
    return [p.narrow(dim, 0, int(n)) for p, n in zip(parts, sizes, strict=True)]


@dataclass
class TpView:
    """This rank's tensor-parallel group and ``splits`` (parameter name -> :data:`Split`) as calibration sees them."""

    tp: Group
    splits: dict[str, Any] = field(default_factory=dict)

    def split_of(self, param: str) -> Split | None:
        return self.splits.get(param)

    def rowwise(self, layer: str) -> bool:
        """Whether ``layer`` holds a block of input columns (its input is then a slice of the features)."""
        return self.split_of(f"{layer}.weight") == 1

    def whole_input(self, layer: str, x: torch.Tensor) -> torch.Tensor:
        """The layer's input over all its features (``x``: ``(tokens, features of this rank)``)."""
        return torch.cat(_parts(x, x.dim() - 1, self.tp), dim=-1) if self.rowwise(layer) else x

    def whole(self, param: str, t: torch.Tensor, columns: bool = False) -> torch.Tensor:
        """The whole of a parameter split as ``param`` is, from every rank's slice (``t`` itself if not split);
        ``columns``: ``t`` is per input column of the weight ``param`` (an input scale): gathered only where the
        weight's input columns are split."""
        how = self.split_of(param)
        if columns:
            return torch.cat(_parts(t, 0, self.tp)) if how == 1 else t
        if how is None:
            return t
        dim, parts, _ = (how, 0, 0) if isinstance(how, int) else how
        pieces = _parts(t, dim, self.tp)
        if parts:  # a replicated KV head: each part is held by tp / parts consecutive ranks
            pieces = pieces[:: self.tp.size // parts]
        return torch.cat(pieces, dim=dim)

    def local(self, param: str, whole: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """This rank's slice of ``whole``, split as ``param`` is, along ``dim`` of ``whole`` (default: the split's)."""
        how = self.split_of(param)
        if how is None:
            return whole
        split_dim, parts, index = (how, self.tp.size, self.tp.rank) if isinstance(how, int) else how
        return whole.tensor_split(parts, split_dim if dim is None else dim)[index]

    def columns(self, layer: str, in_features: int) -> slice:
        """This rank's input columns of a row-parallel ``layer`` whose whole input has ``in_features``."""
        sizes = split_sizes(in_features, self.tp.size)
        start = sum(sizes[: self.tp.rank])
        return slice(start, start + sizes[self.tp.rank])


def quantized_whole(lm: nn.Module, names: set[str], config: Any, view: TpView | None) -> set[str]:
    """Round to nearest by torchao's ``config`` each row-parallel layer of ``names`` as one process does: its whole
    weight gathered (a layer at a time), quantized, and this rank's slice of the quantized tensor kept (int8's one
    scale per row is the whole row's). The names left to quantize as they are (all of them without ``view``)."""
    from lit_ppl.quant.calibrated.awq import quantize_weight  # awq imports this module

    rowwise = {n for n in names if view is not None and view.rowwise(n)}
    for name in sorted(rowwise):  # the same order on every rank: each gather is collective
        module, param = lm.get_submodule(name), f"{name}.weight"
        quantized = quantize_weight(view.whole(param, module.weight.detach()), config)
        module.weight = nn.Parameter(view.local(param, quantized), requires_grad=False)
    return names - rowwise


@contextmanager
def whole_matmuls(lm: nn.Module, tp: TpView | None) -> Iterator[None]:
    """Inside: every row-parallel layer of ``lm`` computes ``F.linear`` of its whole input and whole weight (a
    quantized one dequantized, as torchao's own linear computes it), so that calibration sees one process's
    activations bit for bit; the layers' forwards are restored after."""
    layers = {
        name: m
        for name, m in lm.named_modules()
        if tp is not None
        and isinstance(m, RowParallelLinear)
        and getattr(m.weight, "activation_quantization", None) is None  # a per-token input scale: not one matmul
    }
    for name, module in layers.items():
        module.forward = _whole_forward(module, name, tp)
    try:
        yield
    finally:
        for module in layers.values():
            del module.forward


def _whole_forward(module: nn.Module, name: str, tp: TpView) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.weight.dequantize() if hasattr(module.weight, "__tensor_flatten__") else module.weight
        return F.linear(tp.whole_input(name, x), tp.whole(f"{name}.weight", weight), module.bias)

    return forward


@contextmanager
def as_one_process(lm: nn.Module, view: TpView | None) -> Iterator[TpView | None]:
    """Inside: ``lm``'s tensor-parallel group computes as one process does (every rank the same thing), and the
    view of a group with nothing split is yielded (``None`` without tensor parallelism). Each decoder linear layer
    split evenly is held as this rank's slice and gathered whole for each call (a backward pass gathers it again:
    :meth:`~lit_ppl.parallel.float_rows.FloatRows.regathered`); the other split parameters (the embedding table and
    output head, column-parallel biases, a key/value head held by several ranks) are gathered whole for the while,
    as a layout of whole layers holds them; row-parallel layers sum nothing, the embedding looks up the whole table
    and the attention reads every key/value head. Everything is put back on exit."""
    if view is None:
        yield None
        return
    modules = dict(lm.named_modules())
    params = dict(lm.named_parameters(remove_duplicate=False))
    names = sorted(p for p in view.splits if p in params)  # the same order on every rank: each gather is collective
    device = next(lm.parameters()).device
    mine = torch.tensor([params[p].shape[_dim(view.split_of(p))] for p in names], device=device)
    every = [torch.empty_like(mine) for _ in range(view.tp.size)]
    dist.all_gather(every, mine, group=view.tp.group)
    even = {p for i, p in enumerate(names) if len({int(e[i]) for e in every}) == 1}
    head = lm.get_output_embeddings()
    sliced: dict[str, int] = {}  # layer -> the dim its weight is split along: held by slices
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    wholes: dict[int, nn.Parameter] = {}  # a parameter's id -> its whole (a tied table gathered once)
    for p in names:
        layer, _, attr = p.rpartition(".")
        module, how = modules[layer], view.split_of(p)
        linear = attr == "weight" and isinstance(module, nn.Linear) and module is not head
        if linear and isinstance(how, int) and p in even:
            sliced[layer] = how
            continue
        held = module._parameters[attr]
        if id(held) not in wholes:
            wholes[id(held)] = nn.Parameter(view.whole(p, held.detach()), requires_grad=False)
        saved.append((module, attr, held))
    rows = FloatRows(lm, sorted(sliced), DeviceMesh.from_group(view.tp.group, device.type), sliced)
    row_parallel = [m for m in modules.values() if isinstance(m, RowParallelLinear)]
    pauses = [v for m in modules.values() if (v := VocabParallel.of(m)) is not None]
    size = widths(lm.config)
    groups = size["attention heads"] // size[KV_HEADS] if size["attention heads"] else None
    kv = [(m, m.num_key_value_groups) for m in modules.values() if hasattr(m, "num_key_value_groups")]
    try:
        for module, attr, held in saved:
            module._parameters[attr] = wholes[id(held)]
        for m in row_parallel:
            m.__class__ = nn.Linear  # its input is whole: nothing to sum
        for v in pauses:
            v.paused = True
        for m, _ in kv if groups else ():
            m.num_key_value_groups = groups
        with large_blocks_mapped():  # whole layers gathered and freed in turn: from mmap, as under FSDP
            yield TpView(view.tp, {})
    finally:
        rows.put_back()
        for module, attr, held in reversed(saved):
            module._parameters[attr] = held
        for m in row_parallel:
            m.__class__ = RowParallelLinear
        for v in pauses:
            v.paused = False
        for m, n in kv:
            m.num_key_value_groups = n


def _dim(how: Split) -> int:
    return how if isinstance(how, int) else how[0]
