"""A model's embedding table and output head held as blocks of vocabulary rows, each an FSDP unit of its own.

FSDP2 gathers a unit whole, and a vocabulary table is one parameter: a tied 262,144 × 768 table is a 768 MiB unit
that FSDP gathers (its all-gather output beside the unsharded copy) for the lookup and keeps through the whole forward
— on a 270M model, more per rank than one process holds in all. Here the table is cut into blocks of rows no bigger
than a decoder block, each sharded alone: the lookup and every chunk of the head gather one block at a time, and the
same blocks serve a tied embedding and head, and the loss streams over them
(:func:`lit_ppl.model.nll.streamed_cross_entropy`: one block's logits at a time). The ranks must then call the head
the same number of times:
:func:`lit_ppl.metrics.chunks.agreed_chunks` gives every rank the largest chunk count. Written here because FSDP2
has no unit smaller than a parameter, and the usual answer (a vocabulary-parallel head, as torchtitan's) needs a
tensor-parallel group.

Only for a plain ``nn.Embedding`` and bias-free ``nn.Linear`` head (a subclass may scale or shift its output), in
float weights (torchao's tensors are outside FSDP).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class RowBlock(nn.Module):
    """Rows ``[start, start + len(weight))`` of a vocabulary table: a lookup of ids in that range, or the logits of
    those vocabulary entries. Its own module so that FSDP2's hooks gather it around each call."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start

    def forward(self, x: torch.Tensor, lookup: bool) -> torch.Tensor:
        if lookup:  # ids outside the block read its row 0: the caller keeps only those inside
            return F.embedding((x - self.start).clamp_(0, self.weight.shape[0] - 1), self.weight)
        return F.linear(x, self.weight)


class VocabRows(nn.Module):
    """A ``(vocab, dim)`` table as consecutive :class:`RowBlock` s of ``rows`` rows (the last may be shorter)."""

    def __init__(self, weight: torch.Tensor, rows: int) -> None:
        super().__init__()
        self.shape = tuple(weight.shape)
        self.blocks = nn.ModuleList(
            RowBlock(part, start)  # a view: FSDP copies each block's shard out of the loaded table
            for start, part in zip(range(0, self.shape[0], rows), weight.detach().split(rows), strict=True)
        )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, table)``, a block at a time (every block is called, on every rank: FSDP's all-gathers
        line up whatever the ids)."""
        out = None
        for block in self.blocks:
            rows = block(ids, lookup=True)
            inside = ((ids >= block.start) & (ids < block.start + block.weight.shape[0]))[..., None]
            out = rows if out is None else torch.where(inside, rows, out)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``F.linear(hidden, table)``, a block of vocabulary entries at a time, each written into its columns (a
        ``torch.cat`` of the blocks' outputs would hold the chunk's logits twice)."""
        out = None
        for block in self.blocks:
            part = block(hidden, lookup=False)
            if out is None:
                out = part.new_empty((*part.shape[:-1], self.shape[0]))
            out[..., block.start : block.start + part.shape[-1]] = part
            del part
        return out


class Held(nn.Module):
    """What stands in the model for a table held by rows: ``weight`` is a meta tensor of the whole table's shape, for
    code that reads its shape or dtype; anything computing with it fails loudly instead of using a stale copy."""

    def __init__(self, rows: VocabRows) -> None:
        super().__init__()
        self.rows = rows

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.rows.shape, dtype=self.rows.blocks[0].weight.dtype, device="meta")

    def full_weight(self) -> torch.Tensor:
        """The whole table, each block gathered from its FSDP shards (collective): to save it, not to compute."""
        return torch.cat(list(self.gathered_blocks()))

    def gathered_blocks(self) -> Iterator[torch.Tensor]:
        """Each block's rows in order, gathered from its FSDP shards one at a time as iterated (collective)."""
        for block in self.rows.blocks:
            w = block.weight
            yield w.full_tensor() if hasattr(w, "full_tensor") else w


class RowsEmbedding(Held):
    """An ``nn.Embedding`` whose table is held by rows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows.lookup(ids)


class RowsHead(Held):
    """A bias-free ``nn.Linear`` output head whose weight is held by rows: ``forward(hidden, block)`` gives the logits
    of one block's vocabulary entries (through this module's own forward, so that FSDP's hooks fire where it is a
    root), or of all of them."""

    def forward(self, hidden: torch.Tensor, block: int | None = None) -> torch.Tensor:
        if block is None:
            return self.rows.logits(hidden)
        return self.rows.blocks[block](hidden, lookup=False)


def hold_by_rows(lm: nn.Module, block_bytes: int) -> list[VocabRows]:
    """Replace ``lm``'s input embeddings and output head (one :class:`VocabRows` for both when tied) by tables of
    blocks of at most ``block_bytes`` (a decoder block's size); those of one block or less stay as they are.
    Returns the tables replaced."""
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    plain = type(embed) is nn.Embedding and embed.max_norm is None  # max_norm renormalises rows as it looks them up
    if not plain or not (head is None or (type(head) is nn.Linear and head.bias is None)):
        return []
    if any(hasattr(m.weight, "__tensor_flatten__") for m in (embed, head) if m is not None):
        return []  # quantized (torchao) or already sharded: not a float table to cut
    tied = head is not None and head.weight is embed.weight
    held = []
    for module, wrap, setter in (
        (embed, RowsEmbedding, lm.set_input_embeddings),
        (None if tied or head is None else head, RowsHead, lm.set_output_embeddings),
    ):
        if module is None or (table := table_by_rows(module, block_bytes)) is None:
            continue
        setter(wrap(table))
        if tied and module is embed:
            lm.set_output_embeddings(RowsHead(table))
        held.append(table)
    return held


def table_by_rows(module: nn.Module, block_bytes: int) -> VocabRows | None:
    """``module``'s float ``weight`` as blocks of at most ``block_bytes``; ``None`` where it has a bias, is quantized or
    fits in one block."""
    weight = module.weight
    if getattr(module, "bias", None) is not None or hasattr(weight, "__tensor_flatten__") or block_bytes <= 0:
        return None
    rows = max(1, block_bytes // (weight.shape[1] * weight.element_size()))
    return VocabRows(weight, rows) if math.ceil(weight.shape[0] / rows) >= 2 else None


def row_targets(lm: nn.Module) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Per state-dict name of a table held by rows (``model.embed_tokens.weight``), its blocks' first rows and
    parameters: where a checkpoint's whole tensor goes."""
    return {
        f"{name}.weight": [(block.start, block.weight) for block in module.rows.blocks]
        for name, module in lm.named_modules()
        if isinstance(module, Held)
    }


def row_blocks(lm: nn.Module) -> list[RowBlock]:
    """Every :class:`RowBlock` of ``lm``, once (``modules()`` yields a module shared by a tied head once)."""
    return [m for m in lm.modules() if isinstance(m, RowBlock)]
