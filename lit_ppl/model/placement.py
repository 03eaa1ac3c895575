"""Where a model's weights live: built, split, loaded, quantized and sharded for the run's layout, in one call.

:func:`place` is the one pipeline for every model of a run — the evaluated one, a live reference, and (with
:func:`place_head`) a saved reference's head:

* one process (or data parallelism alone): the checkpoint read straight to the device as ``from_pretrained``
  reads it, then quantized — by round to nearest, each decoder weight as it is read;
* a split layout: built on the meta device (no rank but the reader ever holds the whole model), split for tensor
  parallelism (:mod:`lit_ppl.parallel.tensor_parallel`), FSDP-sharded when nothing will be quantized, materialised
  empty, loaded (each rank reads its own part of a safetensors checkpoint or a GGUF file; otherwise one reader reads
  and every rank keeps its part: :mod:`lit_ppl.parallel.sharding`), quantized — or a
  stored checkpoint's codes restored — and then, quantized, its rows sharded by hand and the rest by FSDP (FSDP2
  cannot hold torchao's tensors). Under FSDP alone, with each rank reading its own part, round to nearest
  quantizes each decoder weight as it is read and keeps its rows at once: no rank holds the float model.

It needs no Trainer: the one exchange of a Python object between ranks (what the reader found) is the
``broadcast`` of the :class:`Placement` it is handed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.model.checkpoint import key_problem
from lit_ppl.model.scorer import TokenScorer
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel.float_rows import FloatRows
from lit_ppl.parallel.layout import Layout
from lit_ppl.parallel.quantized_rows import shard_quantized_rows
from lit_ppl.parallel.sharding import (
    decoder_blocks,
    device_mesh,
    fsdp_mesh,
    fully_shard_blocks,
    fully_shard_rows,
    load_from_rank0,
    load_own_parts,
    local,
    materialize,
    tp_group,
    unloaded,
    weight_bytes,
)
from lit_ppl.parallel.tensor_parallel import Group, parallelize
from lit_ppl.parallel.vocab_rows import RowsHead, hold_by_rows, table_by_rows
from lit_ppl.runtime.memory import is_quantized, large_blocks_mapped, map_large_blocks

__all__ = ["Placement", "Quantizes", "place", "place_head", "weight_bytes"]


class Quantizes(Protocol):
    """What placement asks of a quantizer (:class:`lit_ppl.quant.quantizer.Quantizer`)."""

    streams: bool  # it can quantize each weight as it is read

    def read(self, full: dict[str, torch.Tensor]) -> Any:
        """The reader's part, on the whole checkpoint as read; handed to every rank's :meth:`quantize`."""

    def quantize(
        self,
        lm: nn.Module,
        tp: Group | None,
        splits: dict[str, Any],
        read: Any,
        stream: Any = None,
        release: Any = None,
        device: Any = None,
        rows: Any = None,
    ) -> Any:
        """Quantize ``lm`` (this rank's tensor-parallel slices under ``tp``) in place; a report with
        ``quantized_params``. ``stream(arrived)`` loads the weights onto ``device``, calling ``arrived(name)`` as each
        is in place, to be quantized then and its layer's name handed to ``release``; ``rows``: the
        :class:`~lit_ppl.parallel.float_rows.FloatRows` of :meth:`held_by_rows`, each layer released once quantized."""

    def layers(self, lm: nn.Module, device: Any) -> set[str]:
        """The modules its rules quantize, known before any weight is read."""

    def held_by_rows(self, lm: nn.Module, device: Any) -> list[str]:
        """The layers whose float weights FSDP's ranks hold by rows while it calibrates (none if it does not)."""


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
        return _place_whole(spec, where, dtype, quantizer)
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
    # FSDP alone, each rank reading its own part: round to nearest quantizes each decoder weight as it is read and
    # keeps its rows, so no rank holds the float model.
    as_read = quantizer is not None and quantizer.streams and where.dp_mesh is not None and tp is None
    later = _arriving(lm) if as_read and parts is not None else []
    # FSDP alone, each rank reading its own part: a calibrated method's float weights held by rows while it runs.
    held = where.dp_mesh is not None and tp is None and parts is not None and quantizer is not None
    rows = FloatRows(lm, quantizer.held_by_rows(lm, where.device), where.mesh["dp_shard"]) if held else None
    float_table = quantizer is None or (bool(later) and not quantizer.layers(lm, where.device) & _tables(lm))
    if by_rows and float_table and (parts is not None or spec.is_builtin):  # a reader's broadcast fills whole
        lockstep = _hold_by_rows(lm, where, block_bytes)
    scorer = TokenScorer(lm, where.chunk_size, tp, lockstep)
    if quantizer is None and where.dp_mesh is not None:
        fully_shard_blocks(scorer, where.dp_mesh, set())
    elif lockstep is not None:  # a float vocabulary beside weights quantized as read: its rows sharded before
        fully_shard_rows(lm, where.dp_mesh)
    read, report = None, None
    if not spec.is_builtin:
        materialize(scorer, where.device, [f"lm.{n}" for n in later])  # the scorer's names
        if later:
            report = _quantize_as_read(spec, lm, parts, quantizer, where)
        elif parts is not None:  # every rank reads its own part: no reader, nothing for a quantizer to read
            load_own_parts(lm, parts, splits, tp)
        else:
            read = _load(spec, lm, dtype, expected, splits, tp, quantizer, where.broadcast)
        if not later:
            _check_loaded(spec, lm)
    group = where.mesh["dp_shard"].get_group() if where.dp_mesh is not None else None
    if quantizer is not None and report is None and rows is not None and rows.names:
        release = lambda name: shard_quantized_rows(lm, [f"{name}.weight"], group)  # noqa: E731
        report = quantizer.quantize(lm, tp, splits, read, release=release, rows=rows)
    elif quantizer is not None and report is None:
        report = quantizer.quantize(lm, tp, splits, read)
    if report is not None and where.dp_mesh is not None:
        # FSDP2 cannot hold torchao's tensors: their rows are sharded by hand, the rest by fully_shard.
        shard_quantized_rows(lm, report.quantized_params, group)
        if by_rows and lockstep is None and (lockstep := _hold_by_rows(lm, where, block_bytes)) is not None:
            scorer = TokenScorer(lm, where.chunk_size, tp, lockstep)  # a table left in float, by rows
        fully_shard_blocks(scorer, where.dp_mesh, {p for p in lm.parameters() if is_quantized(p)})
    return _compiled(scorer, where), report


def _place_whole(
    spec: ModelSpec, where: Placement, dtype: torch.dtype, quantizer: Quantizes | None
) -> tuple[TokenScorer, Any]:
    """:func:`place` in one process (or under data parallelism alone): read as ``from_pretrained`` reads it, then
    quantized; with round to nearest, each decoder weight quantized as it is read (the float model never whole)."""
    lm = spec.build_empty(dtype) if quantizer is not None and quantizer.streams and not spec.is_builtin else None
    parts = spec.tensor_parts(lm) if lm is not None else None
    later = _arriving(lm) if parts is not None else []
    if later:
        materialize(lm, where.device, later)
        report = _quantize_as_read(spec, lm, parts, quantizer, where)
        return _compiled(TokenScorer(lm, where.chunk_size), where), report
    lm = spec.build(dtype, where.device)
    report = quantizer.quantize(lm, None, {}, None) if quantizer is not None else None
    return _compiled(TokenScorer(lm, where.chunk_size), where), report


def place_head(head: nn.Module, where: Placement, candidate: nn.Module) -> tuple[nn.Module, Any]:
    """A saved reference's linear output head (its vocabulary rows already cut to this rank's tensor-parallel slice)
    on the device, sharded like the ``candidate`` model's under FSDP: ``(head, the group whose ranks must call it in
    step, or None)``. Where the candidate's own table may be held by rows, a bias-free head bigger than one of its
    decoder blocks is too (:mod:`lit_ppl.parallel.vocab_rows`): one block gathered at a time, never the whole table."""
    head = head.to(where.device)
    if where.dp_mesh is None:
        return head, None
    from torch.distributed.fsdp import fully_shard

    by_rows = where.vocab_rows and where.layout.tp == 1
    # A decoder block's bytes: this rank's share of it times the ranks sharing it.
    block_bytes = max(map(weight_bytes, decoder_blocks(candidate))) * where.layout.dp_shard if by_rows else 0
    if by_rows and (table := table_by_rows(head, block_bytes)) is not None:
        for block in table.blocks:
            fully_shard(block, mesh=where.dp_mesh)
        # A root above the blocks: FSDP2 keeps a root's parameters gathered after its forward, a child's it frees.
        return fully_shard(RowsHead(table), mesh=where.dp_mesh), where.mesh["dp_shard"].get_group()
    fully_shard(head, mesh=where.dp_mesh, reshard_after_forward=False)  # gathered once per batch, then resharded
    return head, None


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


def _arriving(lm: nn.Module) -> list[str]:
    """The decoder blocks' linear weights, left unallocated until each is read and quantized; none where quantization
    would first rebuild modules (``Conv1D``, ``FalconLinear``: their weights load in their own layout)."""
    if any(type(m).__name__ in ("Conv1D", "FalconLinear") for m in lm.modules()):
        return []
    blocks = set(map(id, decoder_blocks(lm)))
    prefixes = tuple(f"{n}." for n, m in lm.named_modules() if id(m) in blocks)
    return [f"{n}.weight" for n, m in lm.named_modules() if type(m) is nn.Linear and n.startswith(prefixes)]


def _tables(lm: nn.Module) -> set[str]:
    """The module names of ``lm``'s input embeddings and output head."""
    tables = (lm.get_input_embeddings(), lm.get_output_embeddings())
    return {n for n, m in lm.named_modules() if any(m is t for t in tables if t is not None)}


def _quantize_as_read(spec: ModelSpec, lm: nn.Module, parts: Any, quantizer: Quantizes, where: Placement) -> Any:
    """Every rank reads the checkpoint tensor by tensor; each decoder linear weight is quantized as it arrives,
    hashed whole, and under FSDP cut to this rank's rows: a rank holds (its rows of) the quantized weights, the float
    tensors outside the blocks, and one float weight in flight. The quantization report."""
    group = where.mesh["dp_shard"].get_group() if where.dp_mesh is not None else None
    nan: list[str] = []

    def stream(quantize: Callable[[str], None]) -> None:
        def arrived(name: str) -> None:
            owner, _, attr = name.rpartition(".")
            weight = lm.get_submodule(owner)._parameters.get(attr)  # None: a table held by rows (checked after)
            if weight is not None and not is_quantized(weight) and bool(torch.isnan(local(weight)).any()):
                nan.append(name)
            quantize(name)

        with large_blocks_mapped() if where.device.type == "cpu" else contextlib.nullcontext():
            load_own_parts(lm, parts, {}, None, arrived, where.device)

    release = None if group is None else lambda name: shard_quantized_rows(lm, [f"{name}.weight"], group)
    report = quantizer.quantize(lm, None, {}, None, stream, release, where.device)
    _check_loaded(spec, lm, nan)
    return report


def _hold_by_rows(lm: nn.Module, where: Placement, block_bytes: int) -> Any:
    """Hold ``lm``'s vocabulary tables by blocks of rows of at most ``block_bytes`` (its largest decoder block's, in
    float: a quantized model's would cut the table into a gather per few rows) (:mod:`lit_ppl.parallel.vocab_rows`);
    the group whose ranks then call the head in step, or ``None``."""
    if hold_by_rows(lm, block_bytes):
        return where.mesh["dp_shard"].get_group()
    return None


def _check_loaded(spec: ModelSpec, lm: nn.Module, found: list[str] | None = None) -> None:
    """:func:`lit_ppl.parallel.sharding.unloaded` proves no parameter was left NaN, on any rank (``found``: weights
    seen NaN as they arrived, before they were quantized)."""
    missing = unloaded(lm, found or [])
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
