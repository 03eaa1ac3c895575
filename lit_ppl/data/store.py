"""The token store: a corpus tokenized once, kept on disk as one flat array that every rank memory-maps.

A store is a directory ``<cache>/tokens/<key>`` holding

* ``tokens.bin`` — ``[BOS] + document`` for every document, concatenated, in the narrowest unsigned dtype that
  holds the tokenizer's vocabulary (``uint16`` up to 65,536 ids, else ``uint32``): 2 or 4 bytes per token;
* ``documents.npy`` — ``(documents, 3)`` int64: each document's tokens, words and UTF-8 bytes;
* ``meta.json`` — dtype, counts, the largest token id, and what was tokenized.

No rank holds the corpus as Python objects or as a private copy: a window reads only its own pages.

Building is done by one process per store, whichever node it runs on: the builder holds ``<key>.lock``
(created with ``O_EXCL``, touched as batches are written), writes into a private temporary directory and renames
it into place, so a reader sees a complete store or none, and two nodes sharing the cache directory cannot
corrupt it. Others wait as long as the lock shows progress; a lock unchanged for the timeout (its builder died
or hangs) is taken over.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import numpy as np

from lit_ppl.data.sources import DataSpec, documents
from lit_ppl.data.windows import doc_offsets
from lit_ppl.errors import LitPplError
from lit_ppl.model.tokenizer import Tokenizer

VERSION = "2"  # bump when the stored tokens change, to invalidate caches


def default_cache_dir() -> Path:
    if os.environ.get("LIT_PPL_CACHE"):
        return Path(os.environ["LIT_PPL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lit_ppl"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids ``0 .. vocab_size - 1``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass(frozen=True)
class Corpus:
    """Tokenized documents laid out flat as ``[BOS] + doc`` for each document.

    ``tokens`` is a read-only memory map for a stored corpus; a window's ids are read (and widened to int64) only
    when its batch is built.
    """

    tokens: np.ndarray
    doc_lengths: np.ndarray
    doc_words: np.ndarray
    doc_bytes: np.ndarray
    max_token: int

    @property
    def offsets(self) -> np.ndarray:
        """Position of each document's BOS in ``tokens``."""
        return doc_offsets(self.doc_lengths)

    @classmethod
    def from_lists(cls, ids: list[list[int]], words: list[int], nbytes: list[int], context_id: int) -> Corpus:
        """An in-memory corpus (tests, small examples)."""
        lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
        check_nonempty(lengths, 0)
        flat = np.concatenate([np.asarray([context_id, *x], dtype=np.int64) for x in ids])
        return cls(flat, lengths, np.asarray(words, np.int64), np.asarray(nbytes, np.int64), int(flat.max()))

    @classmethod
    def open(cls, directory: Path) -> Corpus:
        meta = json.loads((directory / "meta.json").read_text())
        docs = np.load(directory / "documents.npy")
        tokens = np.memmap(directory / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["tokens"],))
        return cls(tokens, docs[:, 0], docs[:, 1], docs[:, 2], meta["max_token"])


def check_nonempty(lengths: np.ndarray, first_doc: int) -> None:
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        raise LitPplError(
            f"{len(empty)} of {len(lengths)} documents have no tokens (first: document {first_doc + int(empty[0])}); "
            "remove empty documents or adjust data.document_separator"
        )


def store_dir(spec: DataSpec, tokenizer: Tokenizer) -> Path:
    root = Path(spec.cache_dir).expanduser() if spec.cache_dir else default_cache_dir()
    return root / "tokens" / spec.fingerprint(tokenizer.fingerprint, VERSION)


def prepare(spec: DataSpec, tokenizer: Tokenizer, timeout_s: float = 300.0, progress: bool = True) -> Path:
    """The store of ``spec`` tokenized by ``tokenizer``: found, built here, or waited for while another process
    builds it; a builder whose lock shows no progress for ``timeout_s`` seconds is taken over."""
    final = store_dir(spec, tokenizer)
    lock = final.with_name(final.name + ".lock")
    seen: tuple[int, float] | None = None  # the lock's mtime and when it last changed, by this process's clock
    while not (final / "meta.json").is_file():
        if _take(lock):
            try:
                if not (final / "meta.json").is_file():  # another builder may have finished meanwhile
                    _build_locked(spec, tokenizer, final, lock, progress, timeout_s)
            finally:
                lock.unlink(missing_ok=True)
            break
        try:
            st = lock.stat()
        except FileNotFoundError:
            continue
        if seen is None and progress:
            print(f"waiting for {_owner(lock)} to tokenize {spec.describe()} (lock {lock})", file=sys.stderr)
        if seen is None or seen[0] != st.st_mtime_ns:
            seen = (st.st_mtime_ns, time.monotonic())
        # Stale: unchanged for timeout_s here, or (a lock left by a job long gone) older than that by the wall
        # clock, with a minute's grace for clocks of other nodes. Taking it over can cost a second build, never
        # a bad store: each builder writes its own directory and the first rename wins.
        elif time.monotonic() - seen[1] > timeout_s or time.time() - st.st_mtime > timeout_s + 60:
            lock.unlink(missing_ok=True)
            seen = None
            continue
        time.sleep(0.2)
    return final


def _take(lock: Path) -> bool:
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
    os.close(fd)
    return True


def _owner(lock: Path) -> str:
    try:
        return lock.read_text().strip() or "another process"
    except OSError:
        return "another process"


def _build_locked(
    spec: DataSpec, tokenizer: Tokenizer, final: Path, lock: Path, progress: bool, timeout_s: float
) -> None:
    tmp = final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    touched = time.monotonic()

    def heartbeat() -> None:  # after each batch written: the lock's mtime is the build's progress
        nonlocal touched
        if time.monotonic() - touched > min(10.0, timeout_s / 4):
            os.utime(lock)
            touched = time.monotonic()

    try:
        build(spec, tokenizer, tmp, progress, heartbeat)
        try:
            os.rename(tmp, final)
        except OSError:  # a builder that took over our lock got there first: its store is as good
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def _encoded(spec: DataSpec, tokenizer: Tokenizer, dtype: np.dtype) -> Iterator[tuple[list[str], tuple]]:
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


def build(
    spec: DataSpec,
    tokenizer: Tokenizer,
    directory: Path,
    progress: bool = True,
    on_batch: Callable[[], None] | None = None,
) -> None:
    """Tokenize ``spec``'s documents into a store at ``directory`` (which must not exist); ``on_batch`` is called
    after each batch is written."""
    directory.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    counts: list[np.ndarray] = []
    n_tokens = max_token = n_docs = 0
    bar, t0 = None, time.monotonic()
    with open(directory / "tokens.bin", "wb") as out:
        for texts, (flat, doc_counts) in _encoded(spec, tokenizer, dtype):
            check_nonempty(doc_counts[:, 0], n_docs)
            out.write(flat.tobytes())
            counts.append(doc_counts)
            n_tokens, n_docs = n_tokens + len(flat), n_docs + len(texts)
            max_token = max(max_token, int(flat.max()))
            if on_batch is not None:
                on_batch()
            if bar is None and progress:  # once the source is open: an error comes before any bar
                bar = _bar(spec)
            if bar is not None:
                bar.set_postfix_str(f"{n_tokens / (time.monotonic() - t0):,.0f} tokens/s", refresh=False)
                bar.update(int(doc_counts[:, 2].sum()))
        out.flush()
        os.fsync(out.fileno())
    if bar is not None:
        bar.close()
    if n_docs == 0:
        raise LitPplError(f"{spec.describe()} has no documents")
    np.save(directory / "documents.npy", np.concatenate(counts))
    meta = {
        "version": VERSION,
        "dtype": dtype.name,
        "tokens": n_tokens,
        "documents": n_docs,
        "max_token": max_token,
        "context_id": tokenizer.context_id,
        "source": spec.describe(),
        "files": spec.paths,
        "limit": spec.limit,
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2))  # written last: the store's completion mark


def _bar(spec: DataSpec):
    from tqdm.auto import tqdm

    # No total: compressed files and data.limit make the text's size unknown until it is read.
    return tqdm(unit="B", unit_scale=True, desc=f"tokenizing ({processes(spec)} proc)", file=sys.stderr)
