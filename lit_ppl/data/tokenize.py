"""Tokenizing a corpus's documents for the token store: in this process, or a pool of single-threaded forked
workers that die with their builder."""

from __future__ import annotations

import contextlib
import os
import re
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_all_start_methods, get_context

import numpy as np

from lit_ppl.data.reading import Part, documents
from lit_ppl.data.sources import DataSpec
from lit_ppl.errors import LitPplError
from lit_ppl.model.tokenizer import Tokenizer

PIECE_CHARS = 1 << 20  # a document read in parts is tokenized about this many characters at a time
JUNCTION_CHARS = 256  # the text either side of a cut whose tokens must not change for the cut to be taken
_CUTS = re.compile(r"(?<=\S)[ \n]")  # before a space or newline that ends a word: whitespace runs stay whole


def encode_batch(
    tokenizer: Tokenizer, texts: list[str], dtype: np.dtype, starts: list[bool] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS] + tokens`` of each text, flat in ``dtype``, and each text's ``(tokens, words, bytes)``; a text with
    ``starts[i]`` false continues the previous one's document: no BOS, and its words are those it adds.

    Words and bytes follow lm-evaluation-harness: ``len(re.split(r"\\s+", doc))`` and the UTF-8 length (a
    continuation begins with the whitespace run the cut left whole, so its runs add up to the document's).
    """
    starts = [True] * len(texts) if starts is None else starts
    ids = tokenizer.encode(texts)
    counts = np.asarray(
        [
            (len(x), len(re.split(r"\s+", t)) - (not s), len(t.encode("utf-8")))
            for x, t, s in zip(ids, texts, starts, strict=True)
        ],
        dtype=np.int64,
    ).reshape(-1, 3)
    body = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids]) if ids else np.zeros(0, np.int64)
    if len(body) and int(body.max()) > np.iinfo(dtype).max:
        raise LitPplError(f"token id {int(body.max())} does not fit {dtype}: the tokenizer's vocab_size is too small")
    first = np.asarray(starts, dtype=bool)
    sizes = counts[:, 0] + first
    bos = (np.cumsum(sizes) - sizes)[first]
    flat = np.empty(int(sizes.sum()), dtype=dtype)
    flat[bos] = tokenizer.context_id
    keep = np.ones(len(flat), dtype=bool)
    keep[bos] = False
    flat[keep] = body
    return flat, counts


def _cut(text: str, tokenizer: Tokenizer) -> int | None:
    """A position after :data:`PIECE_CHARS` where tokenizing the two sides apart gives the tokens of both together
    (checked on :data:`JUNCTION_CHARS` either side), or ``None``: this document is tokenized whole."""
    for tried, m in enumerate(_CUTS.finditer(text, PIECE_CHARS, len(text) - JUNCTION_CHARS)):
        if tried == 8:  # a tokenizer that joins pieces its own way (a prefix space on each call) fails them all
            return None
        p = m.start()
        before, after = text[p - JUNCTION_CHARS : p], text[p : p + JUNCTION_CHARS]
        a, b, both = tokenizer.encode([before, after, before + after])
        if a + b == both:
            return p
    return None


def pieces(batches: Iterator[list[str]], tokenizer: Tokenizer) -> Iterator[tuple[list[str], list[bool]]]:
    """Documents (and the :class:`~lit_ppl.data.sources.Part` items of one read in parts) as batches of texts to
    encode, with whether each starts its document: a document read in parts is re-cut where :func:`_cut` finds the
    tokens unchanged, so its tokens are those of the whole text and no encoding holds more than ~2 pieces."""
    texts: list[str] = []
    starts: list[bool] = []
    size = 0
    open_text, open_first, cuttable = "", True, True

    def add(text: str, start: bool) -> None:
        nonlocal size
        texts.append(text)
        starts.append(start)
        size += len(text)

    for batch in batches:
        for item in batch:
            continues = getattr(item, "continues", False)
            if not continues and (open_text or isinstance(item, Part)):
                if open_text:
                    add(open_text, open_first)
                open_text, open_first, cuttable = "", True, True
            if not isinstance(item, Part):
                add(str(item), True)
                continue
            open_text += item
            while cuttable and len(open_text) > 2 * PIECE_CHARS:
                p = _cut(open_text, tokenizer)
                if p is None:
                    cuttable = False
                    break
                add(open_text[:p], open_first)
                open_text, open_first = open_text[p:], False
        if size >= PIECE_CHARS or len(texts) >= 64:
            yield texts, starts
            texts, starts, size = [], [], 0
    if open_text:
        add(open_text, open_first)
    if texts:
        yield texts, starts


_WORKER: tuple[Tokenizer, np.dtype] | None = None


def _init_worker(tokenizer: Tokenizer, dtype: np.dtype) -> None:
    global _WORKER
    _WORKER = (tokenizer, dtype)
    _die_with_parent()


def _die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when its builder dies, even by SIGKILL (which runs no cleanup)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):  # not Linux: the pool's own shutdown is all there is
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the builder died before prctl took effect
        os._exit(1)


def _encode_in_worker(texts: list[str], starts: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None
    return encode_batch(_WORKER[0], texts, _WORKER[1], starts)


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


SMALL_BYTES = 16 << 20  # below this, starting processes costs more than it saves


def processes(spec: DataSpec) -> int:
    """Tokenizing processes: ``data.num_proc`` if set; else the CPUs this process may use (a Slurm allocation's),
    or one for a small local corpus."""
    if spec.num_proc is not None:
        return spec.num_proc
    if spec.paths and sum(os.path.getsize(p) for p in spec.paths) < SMALL_BYTES:
        return 1
    return len(os.sched_getaffinity(0))


def encoded_batches(
    spec: DataSpec, tokenizer: Tokenizer, dtype: np.dtype
) -> Iterator[tuple[list[str], list[bool], tuple[np.ndarray, np.ndarray]]]:
    """Each batch of texts, whether each starts its document, and their encoding, in order; with ``num_proc > 1``
    encoded by a pool of processes, at most two batches per process in flight so that memory does not grow with
    the corpus."""
    # A batch's encodings take ~100x its text in memory: at most 64 documents or ~PIECE_CHARS characters.
    batches = pieces(documents(spec, batch_size=64), tokenizer)
    workers = processes(spec)
    # num_proc is the parallelism: each process one thread (the Rust tokenizer would otherwise use every core in
    # every process, and its spinning threads fight). Spawned workers inherit the variable.
    with _env("TOKENIZERS_PARALLELISM", "false"):
        if workers == 1:
            for texts, starts in batches:
                yield texts, starts, encode_batch(tokenizer, texts, dtype, starts)
            return
        # fork where there is one: spawned workers would import the parent's main module (lit_ppl.validate, hence
        # Lightning and torch: seconds per worker). A forked worker only runs the tokenizer and numpy, never the
        # parent's threads (torch, gloo), and TOKENIZERS_PARALLELISM keeps the Rust tokenizer off its thread pool.
        ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(workers, ctx, initializer=_init_worker, initargs=(tokenizer, dtype)) as pool:
            pending: deque[tuple[list[str], list[bool], Future]] = deque()
            for texts, starts in batches:
                pending.append((texts, starts, pool.submit(_encode_in_worker, texts, starts)))
                if len(pending) >= 2 * workers:
                    texts, starts, done = pending.popleft()
                    yield texts, starts, done.result()
            while pending:
                texts, starts, done = pending.popleft()
                yield texts, starts, done.result()
