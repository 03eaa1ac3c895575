"""Split a model over the layout's mesh and fill each rank's share from one copy of the checkpoint.

The mesh is built once per run, ``(dp_replicate, dp_shard, tp)`` with tensor parallelism innermost (so a
tensor-parallel group is consecutive ranks: one node). Tensor parallelism splits layers into plain local shards
(:mod:`lit_ppl.parallel.tensor_parallel`); FSDP2's ``fully_shard`` then shards what each rank holds over the
data-parallel
shard dimension (replicating over ``dp_replicate``: HSDP).

Loading never puts the whole model on a rank: parameters start on the meta device, are split, materialised empty,
and every rank reads its own slices of a safetensors checkpoint or a GGUF file (:func:`load_own_parts`); where
transformers does more than rename keys (fused experts, a quantized checkpoint) rank 0 reads it as
``from_pretrained`` does and broadcasts one block at a time, each rank keeping its slice (:func:`load_from_rank0`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lit_ppl.errors import LitPplError
from lit_ppl.parallel.layout import Layout
from lit_ppl.parallel.tensor_parallel import Group, split_sizes
from lit_ppl.parallel.vocab_rows import Held, row_blocks, row_targets
from lit_ppl.runtime.memory import is_quantized, tensor_bytes

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
BROADCAST_BYTES = 8 * 2**20  # a loaded tensor crosses in blocks of rows of this size: the receivers' transient


def device_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The run's one mesh (every rank calls this at the same point: it creates process groups)."""
    return init_device_mesh(device_type, (layout.dp_replicate, layout.dp_shard, layout.tp), mesh_dim_names=MESH_DIMS)


def tp_group(mesh: DeviceMesh | None, layout: Layout) -> Group | None:
    if mesh is None or layout.tp == 1:
        return None
    sub = mesh["tp"]
    return Group(sub.get_group(), sub.get_local_rank(), layout.tp)


def fsdp_mesh(mesh: DeviceMesh | None, layout: Layout) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: ``dp_shard`` (1D), or ``dp_replicate × dp_shard`` (2D: HSDP)."""
    if mesh is None or layout.dp_shard == 1:
        return None
    return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]


def decoder_blocks(lm: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: Hugging Face names their classes in ``_no_split_modules``."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    # By any class of its MRO: fully_shard turns a LlamaDecoderLayer into an FSDPLlamaDecoderLayer subclass.
    blocks = [m for m in lm.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not blocks:
        raise LitPplError(f"{type(lm).__name__} declares no _no_split_modules; cannot find its decoder blocks")
    return blocks


def fully_shard_blocks(scorer: nn.Module, mesh: DeviceMesh, ignored: set[nn.Parameter]) -> None:
    """``fully_shard`` every decoder block, then the scorer (whose root holds embeddings, norm and head).

    ``ignored``: parameters FSDP2 cannot shard (torchao's quantized tensors lack ``aten.split``); they stay whole.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in [*decoder_blocks(scorer.lm), *row_blocks(scorer.lm)]:
        if not isinstance(block, FSDPModule):  # a vocabulary's rows may be sharded before the rest is read
            fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)
    embed, head = scorer.lm.get_input_embeddings(), scorer.lm.get_output_embeddings()
    held = isinstance(embed, Held) or isinstance(head, Held)  # a vocabulary by rows: its blocks are units
    if not held and head is not None and head.weight is not embed.weight:
        # Units of their own, as torchtitan shards them: with a large vocabulary they are the biggest tensors, and
        # in the root they would stay gathered through the whole forward. The head is called once per chunk of
        # positions: it stays gathered until the scorer has scored them all (TokenScorer.forward reshards it).
        fully_shard(embed, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)
        fully_shard(head, mesh=mesh, reshard_after_forward=False, ignored_params=ignored)
    fully_shard(scorer, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)


def fully_shard_rows(lm: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` each block of a vocabulary held by rows (:mod:`lit_ppl.parallel.vocab_rows`) alone, before
    the rest of the model is read: each rank then allocates and reads only its shard of the table."""
    from torch.distributed.fsdp import fully_shard

    for block in row_blocks(lm):
        fully_shard(block, mesh=mesh, reshard_after_forward=True)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP-sharded) tensor, sharing its memory."""
    return t.to_local() if isinstance(t, DTensor) else t


def materialize(module: nn.Module, device: torch.device, later: Iterable[str] = ()) -> None:
    """Meta parameters → empty ones on ``device``, filled with NaN (so one that no tensor reaches cannot give a
    number); the buffers, computed for real at build time, keep their values. ``later``: parameters left on meta,
    allocated by :func:`load_own_parts` as their tensor arrives."""
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    left = [(module.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in later]
    kept = [(owner, attr, owner._parameters.pop(attr)) for owner, attr in left]
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((owner, name))
    tied = [o for o in owners.values() if len(o) > 1]
    for _, *others in tied:  # to_empty would give each module its own tensor: a tied head's copy, freed at once
        for owner, name in others:
            owner._parameters[name] = None
    module.to_empty(device=device)
    for (first, first_name), *others in tied:
        for owner, name in others:
            setattr(owner, name, getattr(first, first_name))
    for owner, attr, param in kept:
        owner._parameters[attr] = param
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])
        for param in module.parameters():
            if not param.is_meta:
                local(param).fill_(float("nan"))


def kept_region(
    shape: tuple[int, ...], target: torch.Tensor, dim: int | tuple[int, int, int] | None, tp: Group | None
) -> tuple[list[int], list[int]]:
    """``(start, size)`` per dim of the part of a full tensor of ``shape`` that ``target`` holds on this rank:
    its tensor-parallel slice along ``dim`` (part ``index`` of ``parts`` when ``dim`` is ``(dim, parts, index)``: a
    replicated KV head), then FSDP's shard of that slice."""
    start, size = [0] * len(shape), list(shape)
    if tp is not None and dim is not None:
        dim, parts, index = dim if isinstance(dim, tuple) else (dim, tp.size, tp.rank)
        sizes = split_sizes(shape[dim], parts)
        start[dim], size[dim] = sum(sizes[:index]), sizes[index]
    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        size, offset = compute_local_shape_and_global_offset(size, target.device_mesh, target.placements)
        start = [s + o for s, o in zip(start, offset, strict=True)]
    return start, list(size)


def load_from_rank0(
    lm: nn.Module, full: dict[str, torch.Tensor], splits: dict[str, int | tuple[int, int, int]], tp: Group | None
) -> None:
    """Fill ``lm``'s (split, possibly FSDP-sharded) tensors from rank 0's ``full`` state dict.

    ``full`` is empty on the other ranks and consumed on rank 0. Tensors cross in blocks of rows of at most
    :data:`BROADCAST_BYTES`, and each rank keeps the part of every block it holds (``splits``: name → the dim a
    tensor-parallel layer splits): no rank but the reader ever holds more than its share plus one block.
    """
    targets = lm.state_dict(keep_vars=True)
    shapes = [{k: (tuple(v.shape), v.dtype) for k, v in full.items()}]
    dist.broadcast_object_list(shapes, src=0)
    reader = dist.get_rank() == 0
    with torch.no_grad():
        for name in sorted(targets):
            shape, dtype = shapes[0][name]
            target = targets[name]
            dest = local(target)
            source = full.pop(name) if reader else None
            if not shape:  # a scalar
                value = source.to(dest.device) if reader else torch.empty((), dtype=dtype, device=dest.device)
                dist.broadcast(value, src=0)
                dest.copy_(value)
                continue
            start, size = kept_region(shape, target, splits.get(name), tp)
            row_bytes = max(1, torch.Size(shape[1:]).numel() * dtype.itemsize)
            step = max(1, BROADCAST_BYTES // row_bytes)
            for r0 in range(0, shape[0], step):
                r1 = min(r0 + step, shape[0])
                if reader:
                    block = source[r0:r1].to(dest.device).contiguous()
                else:
                    block = torch.empty((r1 - r0, *shape[1:]), dtype=dtype, device=dest.device)
                dist.broadcast(block, src=0)
                a, b = max(r0, start[0]), min(r1, start[0] + size[0])
                if a < b:
                    piece = block[a - r0 : b - r0]
                    for d in range(1, len(shape)):
                        piece = piece.narrow(d, start[d], size[d])
                    dest[a - start[0] : b - start[0]].copy_(piece)
            del source


def load_own_parts(
    lm: nn.Module,
    parts: Iterable[tuple[str, Any]],
    splits: dict[str, int | tuple[int, int, int]],
    tp: Group | None,
    arrived: Callable[[str], None] | None = None,
    device: torch.device | None = None,
) -> None:
    """Fill ``lm``'s (split, possibly FSDP-sharded) tensors from ``parts`` — ``(state-dict name, the whole tensor or a
    lazy handle to it, indexed like a tensor)`` one at a time (:class:`lit_ppl.model.checkpoint.FileParts`,
    :class:`lit_ppl.model.gguf_weights.GgufParts`) — each rank keeping the part it holds (``splits`` as in
    :func:`load_from_rank0`), a block of rows at a time. No collective: a rank's host holds its share plus at most the
    one tensor in flight. A parameter still on meta (:func:`materialize`'s ``later``) is allocated whole on
    ``device`` when its tensor arrives; ``arrived(name)`` is called once each tensor is in place (a quantizer takes
    it there, as it is read).
    """
    targets = lm.state_dict(keep_vars=True)
    by_rows = row_targets(lm)  # a vocabulary held by blocks of rows: each block is a target of its own
    done: set[int] = set()
    with torch.no_grad():
        for name, whole in parts:
            first = by_rows[name][0][1] if name in by_rows else targets[name]
            if id(first) in done:  # tied weights: one tensor under several names
                continue
            done.add(id(first))
            if first.is_meta:
                first = _allocate(lm, name, first, device)
            shape = tuple(whole.shape)
            if not shape:  # a scalar
                local(first).copy_(whole[()])
                continue
            for offset, target in by_rows.get(name, [(0, first)]):
                block = (target.shape[0], *shape[1:]) if name in by_rows else shape
                start, size = kept_region(block, target, splits.get(name), tp)
                start[0] += offset
                _copy_rows(local(target), whole, start, size)
            if arrived is not None:
                arrived(name)


def _allocate(lm: nn.Module, name: str, meta: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """The parameter ``name`` (on meta) allocated on ``device``, in place in its module."""
    if device is None:
        raise RuntimeError(f"{name} is still on the meta device and no device was given to load it to (a bug)")
    owner, _, attr = name.rpartition(".")
    param = nn.Parameter(torch.empty_like(meta, device=device), requires_grad=False)
    lm.get_submodule(owner)._parameters[attr] = param
    return param


def _copy_rows(dest: torch.Tensor, whole: Any, start: list[int], size: list[int]) -> None:
    """``dest[:] = whole[start : start + size]`` a block of rows at a time: what a lazy reader holds at once."""
    rest = tuple(slice(a, a + n) for a, n in zip(start[1:], size[1:], strict=True))
    step = max(1, BROADCAST_BYTES // max(1, 4 * torch.Size(size[1:]).numel()))  # float32 rows
    for r in range(0, size[0], step):
        n = min(step, size[0] - r)
        dest[r : r + n].copy_(whole[(slice(start[0] + r, start[0] + r + n), *rest)])


def unloaded(module: nn.Module, found: Iterable[str] = ()) -> list[str]:
    """Names of parameters still NaN or never allocated on any rank (each rank checks its own shards; one gather),
    with ``found``: those a quantizer saw NaN in as they arrived (its own tensors are not checked again)."""
    names = [*found]
    for n, p in module.named_parameters():
        if p.is_meta or (not is_quantized(p) and bool(torch.isnan(local(p)).any())):
            names.append(n)
    if dist.is_available() and dist.is_initialized():
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = sorted({n for part in gathered for n in part or []})
    return names


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weights this rank holds (its shards; a quantized tensor's packed data and scales)."""

    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += tensor_bytes(local(p))
    return total
