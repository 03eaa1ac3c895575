"""Float linear weights held by rows across the FSDP group while a calibrated method observes them.

AWQ and GPTQ run whole forward passes over the float model and read each layer's whole weight to quantize it. FSDP2
would hold the float weights sharded, but it manages a block's parameters as one unit and cannot hold the torchao
tensors that replace them layer by layer. So while calibration runs, each rank keeps its rows of every calibrated
layer's float weight (a ``DTensor`` sharded along its output rows: loaders and byte counts see the whole tensor's
shape); a forward pre-hook gathers the whole weight for the layer's call and the forward hook drops it, so a rank
holds its share of the float weights plus one layer. :meth:`FloatRows.whole` gathers a layer for good, to quantize
it (a decoder block at a time); :class:`lit_ppl.parallel.sharding.RowShard` then keeps this rank's rows of the
quantized weight. Written here because FSDP2's units cannot change their parameters' type while sharded.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

HELD = "_lit_ppl_float_rows"  # a module attribute (outside nn.Module's registries): this rank's rows, during a call


class FloatRows:
    """The float weights of the layers ``names`` of ``lm`` (still on the meta device) held by rows over ``mesh``."""

    def __init__(self, lm: nn.Module, names: Iterable[str], mesh: DeviceMesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        self.lm, self.names = lm, list(names)
        self.handles: dict[str, list] = {}
        for name in self.names:
            module = lm.get_submodule(name)
            rows = distribute_tensor(module.weight.detach(), mesh, [Shard(0)])  # on meta: shapes only
            module._parameters["weight"] = nn.Parameter(rows, requires_grad=False)
            self.handles[name] = [module.register_forward_pre_hook(_gather), module.register_forward_hook(_release)]

    def whole(self, name: str) -> None:
        """Layer ``name``'s whole weight, gathered for good (collective: every rank, the same order), its hooks
        removed: the layer is about to be quantized."""
        for handle in self.handles.pop(name, []):
            handle.remove()
        module = self.lm.get_submodule(name)
        module._parameters["weight"] = nn.Parameter(module.weight.full_tensor(), requires_grad=False)


def _gather(module: nn.Module, args: object) -> None:
    module.__dict__[HELD] = module._parameters["weight"]
    module._parameters["weight"] = nn.Parameter(module.__dict__[HELD].full_tensor(), requires_grad=False)


def _release(module: nn.Module, args: object, output: object) -> None:
    module._parameters["weight"] = module.__dict__.pop(HELD)
