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

from lit_ppl.data.sources import DataSpec, documents
from lit_ppl.data.windows import doc_offsets
from lit_ppl.errors import LitPplError
from lit_ppl.model.tokenizer import Tokenizer


def encode_batch(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS] + tokens`` of each text, flat in ``dtype``, and each text's ``(tokens, words, bytes)``.

    Words and bytes follow lm-evaluation-harness: ``len(re.split(r"\\s+", doc))`` and the UTF-8 length.
    """
    ids = tokenizer.encode(texts)
    counts = np.asarray(
        [(len(x), len(re.split(r"\s+", t)), len(t.encode("utf-8"))) for x, t in zip(ids, texts, strict=True)],
        dtype=np.int64,
    ).reshape(-1, 3)
    body = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids]) if ids else np.zeros(0, np.int64)
    if len(body) and int(body.max()) > np.iinfo(dtype).max:
        raise LitPplError(f"token id {int(body.max())} does not fit {dtype}: the tokenizer's vocab_size is too small")
    bos = doc_offsets(counts[:, 0])
    flat = np.empty(len(body) + len(ids), dtype=dtype)
    flat[bos] = tokenizer.context_id
    keep = np.ones(len(flat), dtype=bool)
    keep[bos] = False
    flat[keep] = body
    return flat, counts


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


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None
    return encode_batch(_WORKER[0], texts, _WORKER[1])


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


def encoded_batches(spec: DataSpec, tokenizer: Tokenizer, dtype: np.dtype) -> Iterator[tuple[list[str], tuple]]:
    """Each batch of documents with its encoding, in order; with ``num_proc > 1`` encoded by a pool of processes,
    at most two batches per process in flight so that memory does not grow with the corpus."""
    batches = documents(spec, batch_size=64)  # a batch's encodings take ~100x its text in memory: keep it small
    workers = processes(spec)
    # num_proc is the parallelism: each process one thread (the Rust tokenizer would otherwise use every core in
    # every process, and its spinning threads fight). Spawned workers inherit the variable.
    with _env("TOKENIZERS_PARALLELISM", "false"):
        if workers == 1:
            for texts in batches:
                yield texts, encode_batch(tokenizer, texts, dtype)
            return
        # fork where there is one: spawned workers would import the parent's main module (lit_ppl.validate, hence
        # Lightning and torch: seconds per worker). A forked worker only runs the tokenizer and numpy, never the
        # parent's threads (torch, gloo), and TOKENIZERS_PARALLELISM keeps the Rust tokenizer off its thread pool.
        ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(workers, ctx, initializer=_init_worker, initargs=(tokenizer, dtype)) as pool:
            pending: deque[tuple[list[str], Future]] = deque()
            for texts in batches:
                pending.append((texts, pool.submit(_encode_in_worker, texts)))
                if len(pending) >= 2 * workers:
                    texts, done = pending.popleft()
                    yield texts, done.result()
            while pending:
                texts, done = pending.popleft()
                yield texts, done.result()
