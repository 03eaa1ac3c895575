"""Evaluation windows: which tokens each forward pass sees and which of its predictions it scores.

All modes work on one flat token array, the concatenation of ``[BOS] + document`` for every document. A
window is ``(start, end, score_from)`` in that array: the model reads ``tokens[start:end]``, predicts
``tokens[start + 1 : end + 1]`` and scores the predicted positions ``p`` with ``p >= score_from`` that are
not a document's BOS. Every document token is scored by exactly one window in every mode:

* ``rolling`` — lm-evaluation-harness ``loglikelihood_rolling`` (``get_rolling_token_windows`` with
  ``context_len=1`` then ``make_disjoint_window``): per document, disjoint prediction windows of
  ``seq_len`` tokens; later windows read exactly ``seq_len`` inputs ending just before their last target.
* ``sliding`` — the Hugging Face strided window (``max_length=seq_len``, ``stride``): each window reads up
  to ``seq_len - 1`` inputs and scores only the targets the previous window did not.
* ``block`` — the whole stream cut into disjoint blocks of ``seq_len`` inputs; documents share windows,
  each block's first input is context only (it was the previous block's last target).

``llamacpp`` — llama.cpp's ``llama-perplexity`` — is the exception: it scores part of each chunk only. Its windows
are in *joined* coordinates: the documents' tokens concatenated with no BOS between them, after one leading BOS
when the tokenizer adds one (``[BOS] + tokenize(file)``, as ``llama-perplexity -f`` reads a file). The stream is cut
into disjoint chunks of ``n_ctx = seq_len`` tokens, the tail dropped; the collator puts BOS in place of each chunk's
first token (when the tokenizer adds one) and only the targets at chunk positions ``n_ctx/2 + 1 … n_ctx − 1`` are
scored (``first = n_ctx/2``), ``n_ctx − 1 − n_ctx/2`` per chunk. :func:`joined_to_flat` maps them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lit_ppl.config.values import EVAL_MODES
from lit_ppl.errors import LitPplError


@dataclass(frozen=True)
class Windows:
    """Evaluation windows as parallel int64 arrays, one entry per window.

    ``documents``/``words``/``bytes`` count the documents whose *first* token the window scores, so that
    summing them over any partition of the windows counts each document exactly once.

    ``joined``: the bounds are in the joined coordinates of ``llamacpp`` mode (see the module), whose stream begins
    with a BOS when ``bos_first``; ``bos_first`` also puts BOS in place of every window's first input there.
    """

    start: np.ndarray
    end: np.ndarray
    score_from: np.ndarray
    documents: np.ndarray
    words: np.ndarray
    bytes: np.ndarray
    joined: bool = False
    bos_first: bool = False

    def __len__(self) -> int:
        return len(self.start)

    @property
    def lengths(self) -> np.ndarray:
        """Input tokens of each window (its compute cost)."""
        return self.end - self.start


def doc_offsets(doc_lengths: np.ndarray) -> np.ndarray:
    """Position of each document's BOS in the flat ``[BOS] + doc`` concatenation."""
    sizes = np.asarray(doc_lengths, dtype=np.int64) + 1
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def joined_to_flat(pos: np.ndarray, doc_lengths: np.ndarray, bos_first: bool) -> np.ndarray:
    """Flat ``[BOS] + doc`` positions of joined-stream positions ``pos`` (``llamacpp`` mode); the leading BOS
    (position 0 when ``bos_first``) is the first document's BOS."""
    k = np.asarray(pos, dtype=np.int64) - int(bos_first)  # index among the documents' tokens only
    firsts = np.cumsum(doc_lengths) - doc_lengths  # each document's first token's index among them
    doc = np.searchsorted(firsts, k, side="right") - 1
    return np.where(k < 0, 0, k + doc + 1)  # each document before k's, and k's own, adds one BOS


def _llamacpp(lengths: np.ndarray, n_ctx: int, bos_first: bool) -> Windows:
    # llama-perplexity: chunk i is stream[i·n_ctx, (i+1)·n_ctx); its logits at positions first … n_ctx − 2
    # predict the tokens at first + 1 … n_ctx − 1. The last input's prediction is never used, so a window
    # reads n_ctx − 1 inputs: the same logits (causal attention), one position less.
    total = int(lengths.sum()) + int(bos_first)
    if total < 2 * n_ctx:
        raise LitPplError(
            f"eval.mode=llamacpp needs at least 2·n_ctx = {2 * n_ctx} tokens for eval.seq_len={n_ctx} (as "
            f"llama-perplexity does); the corpus has {total}: give more text or a smaller eval.seq_len"
        )
    start = np.arange(total // n_ctx, dtype=np.int64) * n_ctx
    firsts = np.cumsum(lengths) - lengths + int(bos_first)  # each document's first token in the stream
    owner = firsts // n_ctx  # the chunk holding each document's first token (a tail one's is dropped)
    kept = owner < len(start)
    counts = [np.bincount(owner[kept], minlength=len(start)).astype(np.int64)]
    # Words and bytes are not counted: a chunk scores part of its tokens only, so word/byte perplexity is undefined.
    counts += [np.zeros(len(start), dtype=np.int64)] * 2
    return Windows(start, start + n_ctx - 1, start + n_ctx // 2 + 1, *counts, joined=True, bos_first=bos_first)


def _groups(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts[d]`` windows of each document ``d``: every window's document and its index within it."""
    doc = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return doc, np.arange(int(counts.sum()), dtype=np.int64) - first[doc]


def _rolling(offsets: np.ndarray, n: np.ndarray, seq_len: int) -> tuple[np.ndarray, ...]:
    # Window j of a document predicts its tokens [j·L, min(n, (j+1)·L)); the first reads [BOS] + its first
    # tokens, later ones read exactly L inputs ending just before their last target.
    counts = -(-n // seq_len)
    doc, j = _groups(counts)
    off, n_d = offsets[doc], n[doc]
    end = np.minimum(n_d, (j + 1) * seq_len)
    start = np.where(j == 0, 0, end - seq_len)
    return off + start, off + end, off + j * seq_len + 1, counts


def _sliding(offsets: np.ndarray, n: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, ...]:
    # HF's loop over the stream [BOS] + doc of length n + 1: window i begins at i·stride, reads up to
    # end_loc = min(begin + L, n + 1) (end_loc - begin - 1 inputs) and scores the targets from the previous
    # window's end_loc on; the loop stops at the first window reaching the stream's end.
    counts = np.maximum(0, -(-(n + 1 - seq_len) // stride)) + 1
    doc, i = _groups(counts)
    off, stream = offsets[doc], n[doc] + 1
    begin = i * stride
    end_loc = np.minimum(begin + seq_len, stream)
    prev_end = np.where(i == 0, 1, begin - stride + seq_len)
    return off + begin, off + end_loc - 1, off + np.maximum(prev_end, begin + 1), counts


def build_windows(
    mode: str,
    doc_lengths: np.ndarray,
    seq_len: int,
    stride: int | None = None,
    doc_words: np.ndarray | None = None,
    doc_bytes: np.ndarray | None = None,
    bos_first: bool = True,
) -> Windows:
    """Cut documents of ``doc_lengths`` tokens into evaluation windows of at most ``seq_len`` inputs.

    ``bos_first`` (``llamacpp`` mode only): whether the tokenizer adds a BOS, as llama.cpp's ``add_bos``.

    Examples:
        >>> w = build_windows("rolling", np.array([5]), seq_len=2)
        >>> [(int(a), int(b), int(s)) for a, b, s in zip(w.start, w.end, w.score_from)]
        [(0, 2, 1), (2, 4, 3), (3, 5, 5)]
    """
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    if mode not in EVAL_MODES:
        raise LitPplError(f"eval.mode={mode!r} is not one of {', '.join(EVAL_MODES)}")
    least = {"sliding": 2, "llamacpp": 3}.get(mode, 1)  # llamacpp: at least one scored position per chunk
    if seq_len < least:
        raise LitPplError(f"eval.seq_len={seq_len} is too small for mode {mode!r} (need >= {least})")
    if mode == "sliding" and (stride is None or not 1 <= stride <= seq_len - 1):
        raise LitPplError(f"eval.stride={stride} must be in [1, seq_len - 1 = {seq_len - 1}] for sliding mode")
    if len(lengths) == 0 or (lengths < 1).any():
        bad = np.flatnonzero(lengths < 1)
        raise LitPplError(f"documents {bad[:5].tolist()} have no tokens; every document needs at least one")
    words = np.zeros_like(lengths) if doc_words is None else np.asarray(doc_words, dtype=np.int64)
    nbytes = np.zeros_like(lengths) if doc_bytes is None else np.asarray(doc_bytes, dtype=np.int64)
    offsets = doc_offsets(lengths)

    if mode == "llamacpp":
        return _llamacpp(lengths, seq_len, bos_first)
    if mode == "block":
        total = int(offsets[-1] + lengths[-1] + 1)
        start = np.arange(0, total - 1, seq_len, dtype=np.int64)
        end = np.minimum(start + seq_len, total - 1)
        owner = (offsets + 1 - 1) // seq_len  # block scoring each document's first token
        counts = [
            np.bincount(owner, weights=v, minlength=len(start)).astype(np.int64)
            for v in (np.ones_like(lengths), words, nbytes)
        ]
        return Windows(start, end, start + 1, *counts)

    cut = _rolling(offsets, lengths, seq_len) if mode == "rolling" else _sliding(offsets, lengths, seq_len, stride)
    start, end, score_from, per_doc = cut
    firsts = np.concatenate([[0], np.cumsum(per_doc)[:-1]]).astype(np.int64)  # each document's first window
    counts = []
    for v in (np.ones_like(lengths), words, nbytes):
        c = np.zeros(len(start), dtype=np.int64)
        c[firsts] = v
        counts.append(c)
    return Windows(start, end, score_from, *counts)


def token_offsets(windows: Windows, doc_lengths: np.ndarray) -> np.ndarray:
    """Index of each window's first scored token in corpus order (document, position), plus the total at the end.

    A window scores the targets ``max(start + 1, score_from) … end`` that are not a document's BOS, in ascending
    order; windows follow each other through the stream, so the scored tokens of window ``w`` are corpus tokens
    ``offsets[w] … offsets[w + 1] - 1``: where any rank writes a per-token value, whatever the world size.
    """
    bos = doc_offsets(doc_lengths)
    low = np.maximum(windows.start + 1, windows.score_from)
    high = windows.end  # inclusive: the last target
    if len(low) > 1 and not (low[1:] > high[:-1]).all():
        raise AssertionError("evaluation windows score overlapping or unordered targets: a bug in lit-ppl")
    boundaries = np.searchsorted(bos, high, side="right") - np.searchsorted(bos, low, side="left")
    if windows.joined:  # llamacpp's stream holds no BOS between documents
        boundaries = np.zeros_like(boundaries)
    counts = np.maximum(high - low + 1, 0) - np.where(high >= low, boundaries, 0)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def scored_positions(windows: Windows, doc_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(document id, position in the document)`` of every scored token, in corpus order (int64 each)."""
    bos = doc_offsets(doc_lengths)
    low = np.maximum(windows.start + 1, windows.score_from)
    sizes = np.maximum(windows.end - low + 1, 0)
    starts = np.repeat(low - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    target = starts + np.arange(int(sizes.sum()), dtype=np.int64)  # every target position the windows read
    if windows.joined:
        target = joined_to_flat(target, doc_lengths, windows.bos_first)
    doc = np.searchsorted(bos, target, side="right") - 1
    keep = target != bos[doc]
    return doc[keep], (target - bos[doc] - 1)[keep]


def spread(length: int, count: int) -> np.ndarray:
    """Indices of ``min(count, length)`` items spread evenly over ``length`` (the first and the last among them):
    a rule on the count alone, so every rank and layout picks the same.

    Examples:
        >>> spread(10, 4).tolist()
        [0, 3, 6, 9]
        >>> spread(3, 5).tolist()
        [0, 1, 2]
    """
    if count <= 0 or length <= 0:
        return np.zeros(0, np.int64)
    return np.unique(np.linspace(0, length - 1, min(count, length)).round().astype(np.int64))


def sample_pages(first_token: np.ndarray, budget: int, page: int) -> np.ndarray:
    """The windows whose scored tokens a report shows: ``(k, 3)`` int64 rows of window, first corpus-order token and
    tokens. Every window when their tokens fit in ``budget``; else ``budget // page`` windows spread evenly over the
    corpus, the first ``page`` tokens of each. Depends on the windows alone, so every rank and layout picks the same.

    Examples:
        >>> sample_pages(np.array([0, 3, 5]), budget=10, page=4).tolist()
        [[0, 0, 3], [1, 3, 2]]
        >>> sample_pages(np.array([0, 5, 10, 15, 20]), budget=6, page=3).tolist()
        [[0, 0, 3], [3, 15, 3]]
    """
    counts = np.diff(np.asarray(first_token, dtype=np.int64))
    chosen = np.flatnonzero(counts > 0)
    if counts.sum() > budget:
        chosen = chosen[spread(len(chosen), max(1, budget // page))]
        return np.stack([chosen, first_token[chosen], np.minimum(counts[chosen], page)], axis=1)
    return np.stack([chosen, first_token[chosen], counts[chosen]], axis=1)


def page_starts(windows: Windows, doc_lengths: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(document, position)`` of the first scored token of each window in ``ids``."""
    pick = {f: getattr(windows, f)[ids] for f in ("start", "end", "score_from", "documents", "words", "bytes")}
    sub = Windows(**pick, joined=windows.joined, bos_first=windows.bos_first)
    doc, pos = scored_positions(sub, doc_lengths)
    firsts = token_offsets(sub, doc_lengths)[:-1]
    return doc[firsts], pos[firsts]
