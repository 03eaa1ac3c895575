"""Quantized linear weights held by rows across the data-parallel shard group.

FSDP2 shards a block's float parameters but cannot hold torchao's tensors (they lack ``aten.split``), so without
this every rank would hold every quantized weight whole. :class:`QuantizedRows` keeps a rank's rows of one quantized
weight and gathers them back; :class:`RowShard` does so around a module's forward, and
:func:`shard_quantized_rows` applies it to a quantized model before FSDP2 shards the rest. Written here because
FSDP2 and torchao have no sharding of each other's tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.parallel.tensor_parallel import all_gather_uneven, split_sizes


def _rows(t: torch.Tensor, rows: int, parts: int, index: int) -> torch.Tensor | None:
    """Row block ``index`` of ``parts`` of a quantized weight's inner tensor, if it is laid out by output row."""
    if t.dim() == 0 or t.shape[0] != rows:
        return None
    return t.tensor_split(parts, 0)[index].clone()


class QuantizedRows:
    """Rows ``[rank]`` of a quantized weight, held; :meth:`whole` gathers them back (collective over ``group``).

    FSDP2 cannot shard torchao's tensors (they lack ``aten.split``), so without this every rank would hold every
    quantized weight. A quantized weight is a tensor subclass around plain inner tensors (codes, scales, zero
    points); those laid out by output row are split, the rest (shared metadata) kept whole. Splitting rows is
    exact for every scheme here: per-row int8 scales and int4's groups along the input features stay whole.
    """

    @staticmethod
    def splits(weight: torch.Tensor) -> bool:
        """Whether every inner tensor of ``weight`` with two dimensions or more is laid out by output row."""
        names, _ = weight.__tensor_flatten__()
        return all(getattr(weight, n).dim() < 2 or getattr(weight, n).shape[0] == weight.shape[0] for n in names)

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.outer = tuple(weight.shape)
        names, self.ctx = weight.__tensor_flatten__()
        inner = {n: getattr(weight, n) for n in names}
        split = {n: _rows(t, self.outer[0], self.size, self.rank) for n, t in inner.items()}
        if not self.splits(weight):
            raise LitPplError(
                f"{type(weight).__name__} packs its {self.outer} weight in a layout not split by output row; it cannot "
                "be sharded across data-parallel ranks: use quant.backend=intx, or parallel.tp instead of fsdp"
            )
        self.shared = {n: t for n, t in inner.items() if split[n] is None}
        self.cls = type(weight)
        self.local = {n: t for n, t in split.items() if t is not None}

    def _build(self, parts: dict[str, torch.Tensor], local: bool) -> torch.Tensor:
        rows = next(iter(parts.values())).shape[0] if local else self.outer[0]
        size = (rows, *self.outer[1:])
        stride = tuple(torch.empty(size, device="meta").stride())
        return self.cls.__tensor_unflatten__({**self.shared, **parts}, self.ctx, size, stride)

    def mine(self) -> torch.Tensor:
        """This rank's rows, as a quantized tensor of their shape."""
        return self._build(self.local, local=True)

    def whole(self) -> torch.Tensor:
        """The whole quantized weight, every rank's rows gathered (collective: every rank, the same order)."""
        sizes = split_sizes(self.outer[0], self.size)
        return self._build({n: all_gather_uneven(t, 0, sizes, self.group) for n, t in self.local.items()}, False)


class RowShard:
    """A module's quantized weight held as ``rows`` (this rank's, in its place); gathered around the module's
    forward (``handles``: the two hooks, for a caller that puts the module back)."""

    def __init__(self, module: nn.Module, rows: QuantizedRows) -> None:
        self.rows = rows
        module._parameters["weight"] = nn.Parameter(rows.mine(), requires_grad=False)
        self.handles = [module.register_forward_pre_hook(self.gather), module.register_forward_hook(self.release)]

    def gather(self, module: nn.Module, args: object) -> None:
        module._parameters["weight"] = nn.Parameter(self.rows.whole(), requires_grad=False)

    def release(self, module: nn.Module, args: object, output: object) -> None:
        module._parameters["weight"] = nn.Parameter(self.rows.mine(), requires_grad=False)


def shard_quantized_rows(lm: nn.Module, names: list[str], group: dist.ProcessGroup) -> None:
    """Row-shard every quantized linear weight in ``names`` (``module.weight`` names) over ``group``, but the
    output head's, which stays whole as FSDP leaves quantized weights: the scorer calls the head once per chunk of
    this rank's positions, a count the ranks need not share (a gather per call would hang), and a head tied to
    the embeddings would lose the tie."""
    modules = dict(lm.named_modules())
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    for name in names:
        owner = modules[name.removesuffix(".weight")]
        linear = isinstance(owner, nn.Linear) and name.endswith(".weight") and owner is not head
        if linear and not hasattr(owner, "_lit_ppl_rows"):  # not sharded already, as it arrived
            owner._lit_ppl_rows = RowShard(owner, QuantizedRows(owner.weight, group))
