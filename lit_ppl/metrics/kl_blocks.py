"""llama.cpp's per-token comparison statistics streamed over blocks of vocabulary columns.

Where both heads are held by blocks of vocabulary rows (:mod:`lit_ppl.parallel.vocab_rows`: FSDP gathers one block
at a time), :func:`streamed_stats` computes what :func:`lit_ppl.metrics.kl.token_stats` computes from whole rows —
both NLLs, KL(reference ‖ candidate) both ways, top-1 agreement and the reference's top-1 probability — holding one
block of each model's logits: per model a running maximum ``m``, the float64 sums ``s = Σ e^(x − m)`` and
``t = Σ e^(x − m)·(x − y)`` (``y`` the other model's logit), rescaled when the maximum rises; then
``KL(x ‖ y) = t / s − lse(x) + lse(y)``. The two heads' blocks need not line up: the columns are walked in pieces
where one block of each overlaps, and every block is called once per chunk, in the same order on every rank (their
all-gathers line up). Written here because no library streams a KL divergence over two heads' blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_ppl.errors import LitPplError

Head = Callable[[Tensor], Tensor]
Blocks = Sequence[tuple[int, Head]]


def widest(blocks: Blocks, vocab: int) -> int:
    """The most columns of any of ``blocks`` (consecutive, covering ``vocab`` columns)."""
    ends = [start for start, _ in blocks[1:]] + [vocab]
    return max(end - start for (start, _), end in zip(blocks, ends, strict=True))


class _Running:
    """One model's running statistics over the columns seen so far, for ``n`` positions."""

    def __init__(self, n: int, device: torch.device) -> None:
        f = torch.float64
        self.top = torch.full((n,), -torch.inf, dtype=f, device=device)
        self.sum = torch.zeros(n, dtype=f, device=device)  # Σ e^(x − top)
        self.cross = torch.zeros(n, dtype=f, device=device)  # Σ e^(x − top)·(x − y)
        self.picked = torch.zeros(n, dtype=f, device=device)  # the target's logit
        self.first = torch.zeros(n, dtype=torch.int64, device=device)  # the first column holding the maximum

    def add(self, x: Tensor, y: Tensor, start: int, targets: Tensor) -> None:
        """Columns ``[start, start + x.shape[1])`` of this model's logits ``x`` and the other's ``y`` (float64)."""
        width = x.shape[1]
        if width == 0:
            return
        block_top = x.amax(1)
        higher = block_top > self.top  # strictly: an earlier column keeps a tie, as argmax does
        self.first = torch.where(higher, x.argmax(1) + start, self.first)
        top = torch.maximum(self.top, block_top)
        shift = torch.where(torch.isneginf(top), 0.0, top)  # a row of −inf so far: no NaN from −inf − (−inf)
        rescale = (self.top - shift).exp_()
        e = (x - shift[:, None]).exp_()
        # 0·(−inf) is 0: a column this model gives no mass adds nothing, whatever the other gives it.
        terms = torch.where(e > 0, e * (x - y), 0.0)
        self.sum = self.sum.mul_(rescale).add_(e.sum(1))
        self.cross = self.cross.mul_(rescale).add_(terms.sum(1))
        self.top = top
        inside = (targets >= start) & (targets < start + width)
        mine = x.gather(1, (targets - start).clamp(0, width - 1)[:, None])[:, 0]
        self.picked = torch.where(inside, mine, self.picked)

    def lse(self) -> Tensor:
        return self.sum.log() + self.top


def _pieces(
    hidden: Tensor, hidden_base: Tensor, blocks: Blocks, blocks_base: Blocks, base_context: Callable[[], Any]
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """``(first column, candidate logits, reference logits)`` (float64) of each run of columns where one block of
    each head overlaps; each block's logits computed once and dropped when passed. ``blocks_base`` is ``blocks``: one
    head for both sides, each block called once on both hidden states (outside ``base_context``)."""
    if blocks_base is blocks and hidden.dtype == hidden_base.dtype:  # one head: each block called once for both
        n = hidden.shape[0]
        both = torch.cat([hidden, hidden_base])
        for start, head in blocks:
            logits = head(both).to(torch.float64)
            yield start, logits[:n], logits[n:]
        return
    i = j = 0
    q = p = None
    q_start = p_start = 0
    while i < len(blocks) and j < len(blocks_base):
        if q is None:
            q_start, head = blocks[i]
            q = head(hidden).to(torch.float64)
        if p is None:
            p_start, head = blocks_base[j]
            with base_context():
                p = head(hidden_base).to(torch.float64)
        lo, q_end, p_end = max(q_start, p_start), q_start + q.shape[1], p_start + p.shape[1]
        hi = min(q_end, p_end)
        yield lo, q[:, lo - q_start : hi - q_start], p[:, lo - p_start : hi - p_start]
        if q_end == hi:
            i, q = i + 1, None
        if p_end == hi:
            j, p = j + 1, None
    if i < len(blocks) or j < len(blocks_base):
        seen = max(q_start + (0 if q is None else q.shape[1]), p_start + (0 if p is None else p.shape[1]))
        raise LitPplError(f"the reference's vocabulary and the model's differ in size (one ends at entry {seen:,})")


def streamed_stats(
    hidden: Tensor,
    hidden_base: Tensor,
    targets: Tensor,
    blocks: Blocks,
    blocks_base: Blocks,
    base_context: Callable[[], Any],
) -> tuple[Tensor, ...]:
    """``(nll, nll_base, kld, kld_rev, same_top, top_p)`` per position, as
    :func:`lit_ppl.metrics.kl.token_stats` computes them from whole rows, with the candidate's head given as
    ``blocks`` and the reference's as ``blocks_base`` (``(first column, head of its columns)`` each).

    Examples:
        >>> import contextlib, torch
        >>> from lit_ppl.metrics.kl import token_stats
        >>> w, v, h, y = torch.randn(10, 4), torch.randn(10, 4), torch.randn(3, 4), torch.tensor([0, 9, 5])
        >>> cand = [(0, lambda x: x @ w[:4].T), (4, lambda x: x @ w[4:].T)]  # blocks that do not line up
        >>> base = [(0, lambda x: x @ v[:7].T), (7, lambda x: x @ v[7:].T)]
        >>> got = streamed_stats(h, h, y, cand, base, contextlib.nullcontext)
        >>> whole = token_stats(h, h, y, lambda x: x @ w.T, lambda x: x @ v.T, 8)
        >>> keys = ("nll", "nll_base", "kld", "kld_rev", "same_top", "top_p")
        >>> all(torch.allclose(a.double(), whole[k].double()) for a, k in zip(got, keys))
        True
    """
    n = targets.shape[0]
    cand, base = _Running(n, hidden.device), _Running(n, hidden.device)
    for start, q, p in _pieces(hidden, hidden_base, blocks, blocks_base, base_context):
        cand.add(q, p, start, targets)
        base.add(p, q, start, targets)
    lse_q, lse_p = cand.lse(), base.lse()
    kld = base.cross / base.sum - lse_p + lse_q
    kld_rev = cand.cross / cand.sum - lse_q + lse_p
    return lse_q - cand.picked, lse_p - base.picked, kld, kld_rev, cand.first == base.first, base.sum.reciprocal()
