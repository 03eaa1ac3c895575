"""Quantized weights across ranks: their bytes, a digest, the check that ranks agree, rank 0's broadcast.

Every rank quantizes its own copy (``quant.source=local``) or rank 0 quantizes and broadcasts
(``quant.source=rank0``); either way :func:`check_ranks_agree` hashes every quantized parameter on every rank and
refuses ranks that hold different weights (:class:`RankMismatchError`): their results would not be one model's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import UserError
from lit_ppl.parallel.ranks import world
from lit_ppl.runtime.memory import inner_tensors, tensor_bytes


class RankMismatchError(UserError, RuntimeError):
    """Ranks hold different quantized weights: their results would not be one model's."""


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's inner tensors (bytes, dtypes and shapes)."""
    h = hashlib.sha256()
    for name, x in inner_tensors(t):
        x = x.detach().contiguous().cpu()
        h.update(f"{name}|{x.dtype}|{tuple(x.shape)}|".encode())
        h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def whole_digest(
    lm: nn.Module, names: list[str], tp: Any = None, known: dict[str, str | None] | None = None
) -> str | None:
    """SHA-256 of the quantized weights as one model, whatever the layout: per parameter of ``names`` (name-sorted)
    the :func:`value_digest` of its dequantized values and any input pre-scale, each over the whole tensor (``tp``: a
    :class:`lit_ppl.quant.calibrated.split.TpView`, whose split parameters are gathered from the group's slices;
    ``known``: digests taken while a parameter was whole, before this rank kept only its rows of it).
    Dequantized values, not the inner tensors: a split tensor's group scales and codes would need a gather rule per
    torchao layout, and the dequantized values (with the pre-scales) are what the layers compute with. A packing
    torchao cannot dequantize (the CPU int4 prototypes) is hashed by its inner tensors, whole layers only: under
    tensor parallelism the digest is then ``None``."""
    params, known = dict(lm.named_parameters()), known or {}
    h = hashlib.sha256()
    for name in sorted(n for n in names if n in params):
        entry = known[name] if name in known else value_digest(params[name].detach(), name, tp)
        if entry is None and tp is not None:
            return None
        h.update(f"{name}|{entry or digest(params[name])}|".encode())
    return h.hexdigest()


def value_digest(p: torch.Tensor, name: str = "", tp: Any = None) -> str | None:
    """SHA-256 of a parameter's dequantized values and input pre-scale (under ``tp``, the parameter ``name``'s
    whole tensors gathered from the group's slices), or ``None`` where torchao cannot dequantize it."""
    values = _values(p.detach())
    if values is None:
        return None
    layer, _, leaf = name.rpartition(".")
    h = hashlib.sha256()
    for key, x in values.items():
        if tp is not None:  # a weight split as its own parameter; an input scale along the layer's input columns
            split = leaf == "weight" and key == "values"
            x = tp.whole(name, x) if split else tp.whole(f"{layer}.weight", x, columns=True)
        x = x.contiguous().cpu()
        h.update(f"{key}|{x.dtype}|{tuple(x.shape)}|".encode())
        h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _values(p: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A parameter's dequantized values and torchao's input pre-scale, or ``None`` if torchao cannot dequantize it."""
    if not hasattr(p, "__tensor_flatten__"):
        return {"values": p}
    try:
        values = {"values": p.dequantize()}
    except NotImplementedError:
        return None
    if getattr(p, "act_pre_scale", None) is not None:
        values["act_pre_scale"] = p.act_pre_scale
    return values


def check_ranks_agree(
    lm: nn.Module, names: list[str], tp: int = 1, known: dict[str, str] | None = None
) -> dict[str, Any]:
    """Hash every quantized parameter on every rank and compare; raise naming the modules that differ.

    Under tensor parallelism (``tp`` > 1) the ranks of a group hold different slices: each rank is compared with
    the first rank holding the same slice (``rank % tp``). ``known``: digests taken while a parameter was whole.
    """
    import torch.distributed as dist

    params, known = dict(lm.named_parameters()), known or {}
    local = {n: known[n] if n in known else digest(params[n]) for n in names if n in params}
    _, size = world()
    total = hashlib.sha256("".join(f"{n}={d};" for n, d in sorted(local.items())).encode()).hexdigest()
    if size == 1:
        return {"world_size": 1, "checked": False, "digest": total}
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, local)
    differing = sorted(
        {
            n
            for r in range(tp, size)
            for n in set(gathered[r % tp]) | set(gathered[r])
            if gathered[r % tp].get(n) != gathered[r].get(n)
        }
    )
    if differing:
        bad_ranks = [r for r in range(tp, size) if gathered[r] != gathered[r % tp]]
        shown = ", ".join(m.removesuffix(".weight") for m in differing[:20])
        raise RankMismatchError(
            f"quantized weights differ across ranks (ranks {bad_ranks} vs rank {bad_ranks[0] % tp}) in "
            f"{len(differing)} modules: "
            f"{shown}{' ...' if len(differing) > 20 else ''}. Ranks loaded different weights or their kernels "
            "quantize differently; use quant.source=rank0 to quantize on rank 0 and broadcast"
        )
    return {"world_size": size, "checked": True, "digest": total}


def broadcast_from_rank0(lm: nn.Module, names: list[str]) -> None:
    """Replace every rank's quantized parameters with rank 0's (pickled, one module at a time)."""
    import torch.distributed as dist

    rank, _ = world()
    modules = dict(lm.named_modules())
    for name in names:
        mod_name, _, attr = name.rpartition(".")
        mod = modules[mod_name]
        device = getattr(mod, attr).device
        # Pickled through the CPU: other ranks' tensors may not even have rank 0's types or shapes.
        box = [getattr(mod, attr).detach().cpu() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        setattr(mod, attr, nn.Parameter(box[0].to(device), requires_grad=False))


@dataclass
class Known:
    """What was read of weights quantized as they arrived, while each was whole: per parameter its inner tensors'
    and its values' digests, per layer its bytes (after that, a rank may hold only its rows)."""

    inner: dict[str, str] = field(default_factory=dict)
    values: dict[str, str | None] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)


def record(known: Known, key: str, layer: str, weight: Any) -> None:
    """What is kept of a quantized weight while it is whole: its inner tensors' and values' digests, its bytes."""
    known.inner[key] = digest(weight)
    known.values[key] = value_digest(weight) or known.inner[key]  # whole_digest's fallback, taken whole
    known.bytes[layer] = tensor_bytes(weight)
