"""Per-token negative log-likelihood without materialising the full logits.

A 70B model with a 128k vocabulary turns one batch of 4 × 2048 tokens into 4 GiB of float32 logits; the
loss needs none of them at once. We run the decoder to hidden states, gather only the positions that are
scored, and apply the output head plus ``cross_entropy`` chunk by chunk, upcasting each chunk to float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Head = Callable[[torch.Tensor], torch.Tensor]


def chunked_nll(hidden: torch.Tensor, targets: torch.Tensor, head: Head, chunk_size: int = 1024) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` given ``hidden`` states, computed ``chunk_size`` rows at a time.

    Args:
        hidden: ``(n, d)`` hidden states of the positions to score, any floating dtype.
        targets: ``(n,)`` token ids those positions predict.
        head: maps ``(m, d)`` hidden states to ``(m, vocab)`` logits (the model's output head).
        chunk_size: rows per chunk; peak extra memory is ``chunk_size × vocab`` float32 values.

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
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out = torch.empty(targets.shape[0], dtype=out_dtype, device=hidden.device)
    for start in range(0, targets.shape[0], chunk_size):
        end = start + chunk_size
        logits = head(hidden[start:end]).to(out_dtype)  # (m, vocab), never wider than one chunk
        out[start:end] = F.cross_entropy(logits, targets[start:end], reduction="none")
    return out
