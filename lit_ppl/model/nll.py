"""Per-token negative log-likelihood without materialising the full logits.

A 70B model with a 128k vocabulary turns one batch of 4 × 2048 tokens into 4 GiB of float32 logits; the
loss needs none of them at once. We run the decoder to hidden states, gather only the positions that are
scored, and apply the output head plus the cross-entropy chunk by chunk, upcasting each chunk to float32.
The cross-entropy is computed in the chunk's own memory: ``F.cross_entropy`` would allocate a second
``(chunk, vocab)`` float32 tensor for its log-softmax, doubling the loss path's peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lit_ppl.errors import LitPplError
from lit_ppl.metrics.chunks import agreed_chunks

Head = Callable[[torch.Tensor], torch.Tensor]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def chunked_nll(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head,
    chunk_size: int = 1024,
    loss: Loss | None = None,
    lockstep: Any = None,
    blocks: Sequence[tuple[int, Head]] | None = None,
) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` given ``hidden`` states, computed ``chunk_size`` rows at a time.

    Args:
        hidden: ``(n, d)`` hidden states of the positions to score, any floating dtype.
        targets: ``(n,)`` token ids those positions predict.
        head: maps ``(m, d)`` hidden states to ``(m, vocab)`` logits (the model's output head).
        chunk_size: rows per chunk; peak extra memory is ``chunk_size × vocab`` float32 values.
        loss: ``loss(logits, targets)``, free to overwrite ``logits``; :func:`cross_entropy_` by default (a
            vocabulary-parallel head passes :func:`lit_ppl.parallel.tensor_parallel.vocab_parallel_cross_entropy_`).
        lockstep: the process group whose ranks must call ``head`` equally often (a head held by FSDP-sharded
            blocks of rows, :mod:`lit_ppl.parallel.vocab_rows`): each calls it as often as the one with most rows.
        blocks: the head as blocks of vocabulary columns, ``(first column, head of those columns)``, in place of
            ``head`` and ``loss``: the loss streams over them (:func:`streamed_cross_entropy`), so a chunk holds one
            block's logits, never its whole rows.

    Returns:
        ``(n,)`` float32 (or float64 for float64 inputs) per-token NLL in nats.

    Examples:
        >>> import torch
        >>> head = torch.nn.Linear(4, 10, bias=False)
        >>> h, y = torch.randn(5, 4), torch.tensor([1, 2, 3, 4, 5])
        >>> full = torch.nn.functional.cross_entropy(head(h), y, reduction="none")
        >>> torch.allclose(chunked_nll(h, y, head, chunk_size=2), full)
        True
    """
    if chunk_size < 1:
        raise LitPplError(f"chunk_size must be >= 1, got {chunk_size}")
    loss = loss or cross_entropy_
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out = torch.empty(targets.shape[0], dtype=out_dtype, device=hidden.device)
    for k in range(agreed_chunks(targets.shape[0], chunk_size, lockstep, hidden.device)):
        start, end = k * chunk_size, (k + 1) * chunk_size
        if blocks is not None:
            out[start:end] = streamed_cross_entropy(hidden[start:end], targets[start:end], blocks, out_dtype)
            continue
        logits = head(hidden[start:end]).to(out_dtype)  # (m, vocab), never wider than one chunk
        out[start:end] = loss(logits, targets[start:end])
        del logits  # else this chunk's logits stay alive while the next chunk's are computed: twice the peak
    return out


def cross_entropy_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, targets, reduction="none")`` without a second ``logits``-sized tensor.

    ``-log softmax(x)[t] = log Σ exp(x - max x) + max x - x[t]``, the same formula ``cross_entropy`` evaluates
    (a row with a NaN or an infinite maximum gives NaN in both), computed in place: ``logits`` is overwritten.

    Examples:
        >>> import torch
        >>> x, y = torch.randn(3, 5), torch.tensor([0, 4, 2])
        >>> torch.allclose(cross_entropy_(x.clone(), y), torch.nn.functional.cross_entropy(x, y, reduction="none"))
        True
    """
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    maxes = logits.amax(dim=1)
    logits.sub_(maxes[:, None]).exp_()
    return logits.sum(dim=1).log_().add_(maxes).sub_(picked)


def streamed_cross_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, blocks: Sequence[tuple[int, Head]], dtype: torch.dtype
) -> torch.Tensor:
    """:func:`cross_entropy_` of logits computed a block of vocabulary columns at a time: a running maximum and a
    float64 running sum of exponentials (rescaled when the maximum rises), the target's logit taken from its block.
    Memory: one block's ``(n, columns)`` logits in ``dtype``. Written here because the fused linear cross-entropies
    of PyTorch and transformers take one weight, not blocks that FSDP gathers one at a time. A row whose logits are
    all ``-inf`` in one block gives NaN (as ``cross_entropy_`` does for an infinite maximum).

    Examples:
        >>> import torch
        >>> w, h, y = torch.randn(10, 4), torch.randn(3, 4), torch.tensor([0, 9, 5])
        >>> blocks = [(0, lambda x: x @ w[:4].T), (4, lambda x: x @ w[4:].T)]
        >>> full = torch.nn.functional.cross_entropy(h @ w.T, y, reduction="none")
        >>> torch.allclose(streamed_cross_entropy(h, y, blocks, torch.float32), full)
        True
    """
    n = targets.shape[0]
    top = torch.full((n,), -torch.inf, dtype=dtype, device=hidden.device)
    total = torch.zeros(n, dtype=torch.float64, device=hidden.device)
    picked = torch.zeros(n, dtype=dtype, device=hidden.device)
    for start, head in blocks:
        part = head(hidden).to(dtype)  # (n, columns)
        width = part.shape[1]
        inside = (targets >= start) & (targets < start + width)
        mine = part.gather(1, (targets - start).clamp(0, width - 1)[:, None]).squeeze(1)
        picked = torch.where(inside, mine, picked)
        higher = torch.maximum(top, part.amax(dim=1))
        rescale = (top - higher).to(torch.float64).exp_()
        total = total.mul_(rescale).add_(part.sub_(higher[:, None]).exp_().sum(dim=1).to(torch.float64))
        top = higher
        del part  # before the next block's logits: one block's at a time
    return total.log_().add_(top).sub_(picked).to(dtype)


# Bytes per vocabulary entry of one chunk row at its peak: the loss keeps one float32 row of logits (computed in
# place); a comparison keeps float64 logits, log-softmaxes and probabilities of both models (lit_ppl.metrics.kl).
ROW_BYTES_PER_LOGIT = {"nll": 4, "compare": 48}


def auto_chunk(chunk_size: int | str, vocab: int, budget_mb: int, path: str = "nll") -> int:
    """``chunk_size``, or for ``"auto"`` the most rows whose logits stay within ``budget_mb`` MiB (at least 1):
    memory that follows the budget, not the vocabulary (a 262k vocabulary costs what a 32k one does)."""
    if chunk_size != "auto":
        return int(chunk_size)
    return max(1, budget_mb * 2**20 // (ROW_BYTES_PER_LOGIT[path] * vocab))
