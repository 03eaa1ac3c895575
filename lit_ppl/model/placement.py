"""Where a model's weights live: built, split, loaded, quantized and sharded for the run's layout, in one call.

:func:`place` is the one pipeline for every model of a run — the evaluated one, a live reference, and (with
:func:`place_head`) a saved reference's head:

* one process (or data parallelism alone): the checkpoint read straight to the device as ``from_pretrained``
  reads it, then quantized;
* a split layout: built on the meta device (no rank but the reader ever holds the whole model), split for tensor
  parallelism (:mod:`lit_ppl.parallel.tensor_parallel`), FSDP-sharded when nothing will be quantized, materialised
  empty, loaded (each rank reads its own part of a safetensors checkpoint or a GGUF file; otherwise one reader reads
  and every rank keeps its part: :mod:`lit_ppl.parallel.sharding`), quantized — or a
  stored checkpoint's codes restored — and then, quantized, its rows sharded by hand and the rest by FSDP (FSDP2
  cannot hold torchao's tensors).

It needs no Trainer: the one exchange of a Python object between ranks (what the reader found) is the
``broadcast`` of the :class:`Placement` it is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.model.checkpoint import key_problem
from lit_ppl.model.scorer import TokenScorer
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel.layout import Layout
from lit_ppl.parallel.sharding import (
    decoder_blocks,
    device_mesh,
    fsdp_mesh,
    fully_shard_blocks,
    load_from_rank0,
    load_own_parts,
    materialize,
    shard_quantized_rows,
    tp_group,
    unloaded,
    weight_bytes,
)
from lit_ppl.parallel.tensor_parallel import Group, parallelize
from lit_ppl.parallel.vocab_rows import hold_by_rows
from lit_ppl.runtime.memory import map_large_blocks

__all__ = ["Placement", "Quantizes", "place", "place_head", "weight_bytes"]


class Quantizes(Protocol):
    """What placement asks of a quantizer (:class:`lit_ppl.quant.quantizer.Quantizer`)."""

    def read(self, full: dict[str, torch.Tensor]) -> Any:
        """The reader's part, on the whole checkpoint as read; handed to every rank's :meth:`quantize`."""

    def quantize(self, lm: nn.Module, tp: Group | None, splits: dict[str, Any], read: Any) -> Any:
        """Quantize ``lm`` (this rank's tensor-parallel slices under ``tp``) in place; a report with
        ``quantized_params``."""


@dataclass
class Placement:
    """Where the run's models go: the rank ``layout`` (``None``: one process) and its device ``mesh``, the
    ``device``, positions per output-head chunk, whether the decoder is compiled, how one Python object goes
    from rank 0 to every rank (Lightning's ``strategy.broadcast``; the identity in one process), and whether FSDP
    may hold a large vocabulary by blocks of rows (:mod:`lit_ppl.parallel.vocab_rows`; not in deterministic mode:
    its head's matmuls are cut by vocabulary, which rounds like one process's only in some dtypes)."""

    layout: Layout | None
    device: torch.device
    chunk_size: int
    broadcast: Callable[[Any], Any]
    compile_decoder: bool = False
    mesh: Any = None
    vocab_rows: bool = True

    def __post_init__(self) -> None:
        if self.split and self.mesh is None:  # every rank builds it at the same point: it creates process groups
            self.mesh = device_mesh(self.layout, self.device.type)

    @property
    def split(self) -> bool:
        """Whether the layout splits the model (tensor parallelism or FSDP), rather than replicating it."""
        return self.layout is not None and self.layout.sharded

    @property
    def dp_mesh(self) -> Any:
        """The mesh FSDP shards over, or ``None``."""
        return fsdp_mesh(self.mesh, self.layout) if self.split else None


def place(
    spec: ModelSpec, where: Placement, dtype: torch.dtype, quantizer: Quantizes | None = None
) -> tuple[TokenScorer, Any]:
    """``spec``'s model in ``dtype``, placed as ``where`` says and quantized by ``quantizer``: ``(scorer, the
    quantization report or None)``. The built-in model is built whole on every rank (it is small and seeded alike)
    and split the same way."""
    if not where.split:
        lm = spec.build(dtype, where.device)
        report = quantizer.quantize(lm, None, {}, None) if quantizer is not None else None
        return _compiled(TokenScorer(lm, where.chunk_size), where), report
    if where.dp_mesh is not None and where.device.type == "cpu":
        map_large_blocks()  # FSDP's gathered units would fragment the heap to a whole model's worth
    tp = tp_group(where.mesh, where.layout)
    lm = spec.build(dtype) if spec.is_builtin else spec.build_empty(dtype)
    expected = set(lm.state_dict())
    parts = None if spec.is_builtin else spec.tensor_parts(lm)  # before any split: the model's own names and shapes
    splits = parallelize(lm, tp) if tp is not None else {}
    lockstep = None
    # FSDP alone may hold a float vocabulary by rows; a compiled decoder keeps its embedding's plain lookup.
    by_rows = where.vocab_rows and not where.compile_decoder and where.dp_mesh is not None and tp is None
    # In float, before any quantization (a layout that cuts nothing need not find the blocks).
    block_bytes = max(weight_bytes(block) for block in decoder_blocks(lm)) if by_rows else 0
    if quantizer is None and by_rows and (parts is not None or spec.is_builtin):  # a reader's broadcast fills whole
        lockstep = _hold_by_rows(lm, where, block_bytes)
    scorer = TokenScorer(lm, where.chunk_size, tp, lockstep)
    if quantizer is None and where.dp_mesh is not None:
        fully_shard_blocks(scorer, where.dp_mesh, set())
    read: Any = None
    if not spec.is_builtin:
        materialize(scorer, where.device)
        if parts is not None:  # every rank reads its own part: no reader, nothing for a quantizer to read
            load_own_parts(lm, parts, splits, tp)
        else:
            read = _load(spec, lm, dtype, expected, splits, tp, quantizer, where.broadcast)
        _check_loaded(spec, lm)
    report = quantizer.quantize(lm, tp, splits, read) if quantizer is not None else None
    if report is not None and where.dp_mesh is not None:
        # FSDP2 cannot hold torchao's tensors: their rows are sharded by hand, the rest by fully_shard.
        shard_quantized_rows(lm, report.quantized_params, where.mesh["dp_shard"].get_group())
        if by_rows and (lockstep := _hold_by_rows(lm, where, block_bytes)) is not None:  # a table left in float
            scorer = TokenScorer(lm, where.chunk_size, tp, lockstep)
        quantized = {p for p in lm.parameters() if hasattr(p, "__tensor_flatten__")}
        fully_shard_blocks(scorer, where.dp_mesh, quantized)
    return _compiled(scorer, where), report


def place_head(head: nn.Module, where: Placement) -> nn.Module:
    """A saved reference's output head (its vocabulary rows already cut to this rank's tensor-parallel slice) on
    the device, sharded like the candidate's under FSDP."""
    head = head.to(where.device)
    if where.dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(head, mesh=where.dp_mesh, reshard_after_forward=False)  # gathered once per batch, then resharded
    return head


def _load(
    spec: ModelSpec,
    lm: nn.Module,
    dtype: torch.dtype,
    expected: set[str],
    splits: dict[str, Any],
    tp: Group | None,
    quantizer: Quantizes | None,
    broadcast: Callable[[Any], Any],
) -> Any:
    """Rank 0 reads the checkpoint as ``from_pretrained`` does, checks that its tensors are exactly the model's
    and broadcasts them. Returns what the quantizer read of the whole checkpoint."""
    import torch.distributed as dist

    full: dict[str, torch.Tensor] = {}
    problem, read = None, None
    if dist.get_rank() == 0:
        try:
            full = spec.full_state_dict(dtype)
            problem = key_problem(spec.path, expected - set(full), set(full) - expected)
            read = quantizer.read(full) if quantizer is not None else None
        except LitPplError as err:  # told to every rank below, so that none waits for a broadcast
            problem = str(err)
    problem, read = broadcast((problem, read))
    if problem:
        raise LitPplError(problem)
    load_from_rank0(lm, full, splits, tp)
    return read


def _hold_by_rows(lm: nn.Module, where: Placement, block_bytes: int) -> Any:
    """Hold ``lm``'s vocabulary tables by blocks of rows of at most ``block_bytes`` (its largest decoder block's, in
    float: a quantized model's would cut the table into a gather per few rows) (:mod:`lit_ppl.parallel.vocab_rows`);
    the group whose ranks then call the head in step, or ``None``."""
    if hold_by_rows(lm, block_bytes):
        return where.mesh["dp_shard"].get_group()
    return None


def _check_loaded(spec: ModelSpec, lm: nn.Module) -> None:
    """:func:`lit_ppl.parallel.sharding.unloaded` proves no parameter was left NaN, on any rank."""
    missing = unloaded(lm)
    if missing:
        raise LitPplError(
            f"model.path={spec.path!r}: {len(missing)} parameters hold NaN after sharded loading "
            f"({', '.join(missing[:5])}): the checkpoint holds NaN there, or no tensor reached them (a bug in "
            "lit-ppl: please report it)"
        )


def _compiled(scorer: TokenScorer, where: Placement) -> TokenScorer:
    if where.compile_decoder:
        from lit_ppl.model.compiling import compile_decoder

        compile_decoder(scorer)
    return scorer
