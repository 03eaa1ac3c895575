"""A pre-quantized torchao INT8 checkpoint under split layouts: its stored codes split and sharded like on-the-fly ones.

torchao's ``Int8Tensor`` has no collectives (``c10d.broadcast_`` is not implemented for it), so rank 0 sends each
quantized weight as its exact float values ``qdata × scale`` together with its per-row scales; every rank then
re-creates the ``Int8Tensor`` of the slice it holds from those scales (a row-wise tensor-parallel slice keeps the
full row's scale). The codes are recovered exactly: each rank checks that ``codes × scale`` gives back the float
values bit for bit, which holds only for the stored codes, and refuses the checkpoint otherwise. The rows are then
sharded by :func:`lit_ppl.parallel.quantized_rows.shard_quantized_rows` like on-the-fly quantized ones, and the ranks'
agreement is hashed like theirs (:mod:`lit_ppl.quant.consistency`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_ppl.config.quant import QuantConfig, quant_config
from lit_ppl.errors import LitPplError
from lit_ppl.parallel.sharding import kept_region, local
from lit_ppl.quant.calibrated.split import TpView
from lit_ppl.quant.consistency import check_ranks_agree, whole_digest
from lit_ppl.quant.quantizer import Quantizer
from lit_ppl.quant.report import QuantReport


def unpack_int8(path: str, full: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """Rank 0: replace every ``Int8Tensor`` of ``full`` by its float values, in place; return ``{name: (per-row
    scale, full shape)}`` for :func:`restore_int8`."""
    from torchao.quantization import Int8Tensor

    scales = {}
    for name, t in list(full.items()):
        if not isinstance(t, Int8Tensor):
            continue
        rows, cols = t.qdata.shape
        if tuple(t.block_size) != (1, cols) or t.act_quant_kwargs is not None:
            raise LitPplError(
                f"model.path={path!r}: {name} is an Int8Tensor with blocks {list(t.block_size)} or quantized "
                "activations; split layouts read per-row weight-only INT8 checkpoints: use strategy=ddp"
            )
        if t.zero_point is not None and bool(t.zero_point.ne(0).any()):
            raise LitPplError(f"model.path={path!r}: {name} has nonzero zero points; split layouts need symmetric INT8")
        full[name] = t.dequantize()
        scales[name] = (t.scale.reshape(rows, 1).clone(), (rows, cols))
    return scales


def restore_int8(
    lm: nn.Module,
    path: str,
    scales: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
    splits: dict[str, Any],
    tp: Any,
    stored: dict[str, Any],
) -> QuantReport:
    """Turn this rank's slice of every stored INT8 weight of ``lm`` (loaded as exact floats) back into an
    ``Int8Tensor`` with the stored codes and scales; the report is the checkpoint's (``source: checkpoint``)."""
    from torchao.quantization import Int8Tensor

    params = dict(lm.named_parameters(remove_duplicate=False))
    modules = dict(lm.named_modules())
    for name, (scale, shape) in sorted(scales.items()):
        w = local(params[name].data)
        start, size = kept_region(shape, params[name], splits.get(name), tp)
        s = scale[start[0] : start[0] + size[0]].to(device=w.device, dtype=w.dtype)
        codes = torch.where(s == 0, 0.0, torch.round(w / torch.where(s == 0, 1.0, s))).clamp(-128, 127)
        if not torch.equal(codes * s, w):  # exact: only the stored codes give the stored values back
            raise LitPplError(
                f"model.path={path!r}: {name}'s INT8 codes cannot be recovered exactly from its values and scales "
                "(scales that are not float32?); evaluate it with strategy=ddp"
            )
        q = Int8Tensor(
            codes.to(torch.int8), s, [1, w.shape[1]], w.dtype, zero_point=torch.zeros_like(s, dtype=torch.int8)
        )
        setattr(modules[name.rpartition(".")[0]], name.rpartition(".")[2], nn.Parameter(q, requires_grad=False))
    report = QuantReport(name=stored["name"], source="checkpoint")
    report.quantized_params = sorted(scales)
    report.consistency = check_ranks_agree(lm, report.quantized_params, getattr(tp, "size", 1))
    report.digest = whole_digest(lm, report.quantized_params, TpView(tp, splits) if tp is not None else None)
    return report


class StoredInt8(Quantizer):
    """The quantizer of a checkpoint that holds torchao INT8 weights, under a split layout: the reader sends their
    exact float values (:meth:`read`), and every rank turns its slice back into the stored codes (:meth:`quantize`)."""

    def __init__(self, model: Any) -> None:
        super().__init__(quant_config({"name": "none"}))
        self.model, self.stored = model, model.stored_quantization()

    @property
    def name(self) -> str:
        return self.stored["name"]

    @property
    def streams(self) -> bool:
        return False  # its codes come from the reader's whole checkpoint (rank 0 reads it)

    @staticmethod
    def holds(model: Any, cfg: QuantConfig) -> bool:
        """Whether the checkpoint of ``model`` (a :class:`lit_ppl.model.spec.ModelSpec`) holds torchao INT8 weights
        to split and shard as stored; on-the-fly quantization (``cfg``) on top of them is refused in one line."""
        stored = model.stored_quantization()
        if stored is None or stored.get("format") != "torchao":
            return False
        if cfg.name != "none":
            raise LitPplError(
                f"model.path={model.path!r} is already quantized ({stored['name']}); evaluate it as stored with "
                "quant=none, or quantize its float checkpoint"
            )
        return True

    def read(self, full: dict[str, Any]) -> Any:
        return unpack_int8(self.model.path, full)

    def held_by_rows(self, lm: nn.Module, device: Any) -> list[str]:
        """None: it restores stored codes, it does not calibrate."""
        return []

    def quantize(self, lm: nn.Module, tp: Any = None, splits: Any = None, read: Any = None) -> QuantReport:
        return restore_int8(lm, self.model.path, read or {}, splits or {}, tp, self.stored)
