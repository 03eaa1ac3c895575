"""Float linear weights held by rows across the FSDP group while a calibrated method observes them (or by
tensor-parallel slices while ``quant=auto`` runs a tensor-parallel group as one process).

AWQ, GPTQ and ``quant=auto`` run whole forward passes over the float model and read each layer's whole weight to
quantize it. FSDP2 would hold the float weights sharded, but it manages a block's parameters as one unit and cannot
hold the torchao tensors that replace them layer by layer. So while calibration runs, each rank keeps its rows of
every calibrated layer's float weight (a ``DTensor`` sharded along its output rows: loaders and byte counts see the
whole tensor's shape); a forward pre-hook gathers the whole weight for the layer's call and the forward hook drops
it, so a rank holds its share of the float weights plus one layer. A weight put in the rows' place (a candidate
measured by ``quant=auto``) is whole already and is called as it is. :meth:`FloatRows.regathered` keeps a backward
pass from holding every gathered weight: autograd saves a reference to each and gets it gathered again when the
backward pass needs it. :meth:`FloatRows.whole` gathers a layer for good, to quantize it (a decoder block at a
time); :class:`lit_ppl.parallel.quantized_rows.RowShard` then keeps this rank's rows of the quantized weight.
Written here because FSDP2's units cannot change their parameters' type while sharded.

Every gather is a collective: every rank of the group runs the same forward (and backward) passes, in the same
order, whatever its share of the calibration text (a rank past its last batch runs an idle one).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

HELD = "_lit_ppl_float_rows"  # a module attribute (outside nn.Module's registries): this rank's rows, during a call
_GATHERED: dict[int, nn.Module] = {}  # storage address of a weight gathered for a call -> its layer, during the call


class FloatRows:
    """The float weights of the layers ``names`` of ``lm`` (still on the meta device) held by rows over ``mesh``;
    or, given ``dims``, layers holding this rank's tensor-parallel slice already (along ``dims[name]``, evenly over
    ``mesh``), held as that slice, gathered for each call alike, and put back by :meth:`put_back`."""

    def __init__(
        self, lm: nn.Module, names: Iterable[str], mesh: DeviceMesh, dims: dict[str, int] | None = None
    ) -> None:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        self.lm, self.names = lm, list(names)
        self.handles: dict[str, list] = {}
        for name in self.names:
            module = lm.get_submodule(name)
            weight = module.weight.detach()
            if dims is None:
                rows = distribute_tensor(weight, mesh, [Shard(0)])  # on meta: shapes only
            else:
                rows = DTensor.from_local(weight, mesh, [Shard(dims[name])], run_check=False)
            module._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
            self.handles[name] = [module.register_forward_pre_hook(_gather), module.register_forward_hook(_release)]

    def put_back(self) -> None:
        """Every layer still held back to this rank's part as a plain tensor (a tensor-parallel slice: as it was),
        its hooks removed."""
        for name in list(self.handles):
            for handle in self.handles.pop(name):
                handle.remove()
            module = self.lm.get_submodule(name)
            module._parameters["weight"] = nn.Parameter(module.weight.to_local(), requires_grad=False)

    def whole(self, name: str) -> None:
        """Layer ``name``'s whole weight, gathered for good (collective: every rank, the same order), its hooks
        removed: the layer is about to be quantized (or kept in float)."""
        for handle in self.handles.pop(name, []):
            handle.remove()
        module = self.lm.get_submodule(name)
        module._parameters["weight"] = nn.Parameter(whole_weight(module.weight), requires_grad=False)

    @staticmethod
    @contextmanager
    def regathered() -> Iterator[None]:
        """Autograd saves a gathered weight as its layer and gathers it again for the backward pass (the same order
        on every rank: the same graph), so a forward pass with gradients holds one layer's weight, not all."""
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield


@contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Every weight held by rows in ``module`` and its submodules gathered once (collective, in module order), the
    rows put back on exit: the module's calls in between gather nothing."""
    held = [(m, m._parameters["weight"]) for m in module.modules() if _is_rows(m._parameters.get("weight"))]
    for m, rows in held:
        m._parameters["weight"] = nn.Parameter(rows.full_tensor(), requires_grad=False)
    try:
        yield
    finally:
        for m, rows in held:
            m._parameters["weight"] = rows


def whole_weight(weight: Any) -> torch.Tensor:
    """``weight`` whole: gathered if it is held by rows, float or quantized (collective), else itself."""
    from lit_ppl.parallel.quantized_rows import QuantizedRows

    if isinstance(weight, QuantizedRows):
        return weight.whole()
    return weight.full_tensor() if _is_rows(weight) else weight


def rows_group(weight: torch.Tensor) -> Any:
    """The process group ``weight``'s rows are held over, or ``None`` if it is whole."""
    return weight.device_mesh.get_group() if _is_rows(weight) else None


def _is_rows(weight: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def _gather(module: nn.Module, args: object) -> None:
    rows = module._parameters["weight"]
    if not _is_rows(rows):
        return  # a whole weight in the rows' place (a candidate measured): called as it is
    module.__dict__[HELD] = rows
    whole = rows.full_tensor()
    module._parameters["weight"] = nn.Parameter(whole, requires_grad=False)
    _GATHERED[whole.untyped_storage().data_ptr()] = module


def _release(module: nn.Module, args: object, output: object) -> None:
    rows = module.__dict__.pop(HELD, None)
    if rows is not None:
        _GATHERED.pop(module._parameters["weight"].untyped_storage().data_ptr(), None)
        module._parameters["weight"] = rows


def _pack(tensor: torch.Tensor) -> Any:
    plain = type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type != "meta"
    module = _GATHERED.get(tensor.untyped_storage().data_ptr()) if plain and _GATHERED else None
    if module is None:
        return tensor
    return _Saved(module, tensor.shape, tensor.stride(), tensor.storage_offset())


def _unpack(saved: Any) -> torch.Tensor:
    if not isinstance(saved, _Saved):
        return saved
    whole = whole_weight(saved.module._parameters["weight"])
    return whole.as_strided(saved.shape, saved.stride, saved.offset)


class _Saved:
    """A gathered weight (or a view of it, e.g. its transpose) as autograd saved it: its layer and the view."""

    def __init__(self, module: nn.Module, shape: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.module, self.shape, self.stride, self.offset = module, shape, stride, offset
