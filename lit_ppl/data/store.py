"""The token store: a corpus tokenized once, kept on disk as one flat array that every rank memory-maps.

A store is a directory ``<cache>/tokens/<key>`` holding

* ``tokens.bin`` — ``[BOS] + document`` for every document, concatenated, in the narrowest unsigned dtype that
  holds the tokenizer's vocabulary (``uint16`` up to 65,536 ids, else ``uint32``): 2 or 4 bytes per token;
* ``documents.npy`` — ``(documents, 3)`` int64: each document's tokens, words and UTF-8 bytes;
* ``meta.json`` — dtype, counts, the largest token id, and what was tokenized.

No rank holds the corpus as Python objects or as a private copy: a window reads only its own pages.

Building is done by one process per store, whichever node it runs on: the builder holds ``<key>.lock``
(created with ``O_EXCL``, touched every few seconds while it lives), writes into a private temporary directory and
renames it into place, so a reader sees a complete store or none, and two nodes sharing the cache directory cannot
corrupt it. Others wait as long as the lock is touched; a lock unchanged for the timeout (its builder died) is
taken over, and a builder removes only its own lock. Tokenizing workers die with their builder, and the next
builder removes the temporary directories of dead ones.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lit_ppl.config.schema import DistributedConfig
from lit_ppl.data.sources import DataSpec
from lit_ppl.data.tokenize import encoded_batches, processes
from lit_ppl.data.windows import doc_offsets
from lit_ppl.errors import LitPplError
from lit_ppl.model.tokenizer import Tokenizer
from lit_ppl.runtime.files import process_alive

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
        """The store at ``directory``, checked against itself first: a store edited, truncated or half-deleted
        after it was built is one line naming the directory to delete, never a wrong number."""
        try:
            meta = json.loads((directory / "meta.json").read_text())
            docs = np.load(directory / "documents.npy", allow_pickle=False)
            problem = _inconsistency(directory, meta, docs)
        except (OSError, ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
            problem = f"{type(err).__name__}: {err}"
        if problem:
            raise LitPplError(
                f"the token store {directory} is damaged ({problem}); delete that directory and it is rebuilt"
            )
        tokens = np.memmap(directory / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["tokens"],))
        return cls(tokens, docs[:, 0], docs[:, 1], docs[:, 2], meta["max_token"])


def _inconsistency(directory: Path, meta: dict, docs: np.ndarray) -> str | None:
    """What does not add up between ``meta.json``, ``documents.npy`` and ``tokens.bin`` (``None``: all of it)."""
    if meta.get("version") != VERSION or meta.get("dtype") not in ("uint16", "uint32"):
        return f"meta.json says version {meta.get('version')!r}, dtype {meta.get('dtype')!r}"
    n_tokens, n_docs = int(meta["tokens"]), int(meta["documents"])
    if docs.ndim != 2 or docs.shape != (n_docs, 3) or docs.dtype != np.int64:
        return f"documents.npy is {docs.dtype} {docs.shape}, meta.json says {n_docs} documents"
    if int(docs[:, 0].sum()) + n_docs != n_tokens or (docs[:, 0] <= 0).any():
        return f"documents.npy's {int(docs[:, 0].sum()):,} tokens (+1 BOS each) are not meta.json's {n_tokens:,}"
    size, expected = (directory / "tokens.bin").stat().st_size, n_tokens * np.dtype(meta["dtype"]).itemsize
    if size != expected:
        return f"tokens.bin holds {size:,} bytes, {n_tokens:,} {meta['dtype']} tokens take {expected:,}"
    if int(meta["max_token"]) >= np.iinfo(meta["dtype"]).max + 1:
        return f"meta.json's max_token {meta['max_token']} does not fit {meta['dtype']}"
    return None


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


def prepare(
    spec: DataSpec, tokenizer: Tokenizer, timeout_s: float = DistributedConfig.timeout_s, progress: bool = True
) -> Path:
    """The store of ``spec`` tokenized by ``tokenizer``: found, built here, or waited for while another process
    builds it; a builder whose lock shows no progress for ``timeout_s`` seconds is taken over."""
    final = store_dir(spec, tokenizer)
    lock = final.with_name(final.name + ".lock")
    seen: tuple[int, float] | None = None  # the lock's mtime and when it last changed, by this process's clock
    while not (final / "meta.json").is_file():
        token = _take(lock)
        if token is not None:
            try:
                if not (final / "meta.json").is_file():  # another builder may have finished meanwhile
                    _remove_stale_builds(final, timeout_s)
                    _build_locked(spec, tokenizer, final, lock, progress, timeout_s)
            finally:
                _release(lock, token)
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


def _take(lock: Path) -> str | None:
    """Create ``lock`` if no one holds it; return what it says (this builder's token), else ``None``."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    except OSError as err:  # read-only, full, or a file where a directory should be
        raise LitPplError(
            f"cannot write the token store under {lock.parent.parent} ({err.strerror or err}); set data.cache_dir "
            "(or $LIT_PPL_CACHE) to a writable directory, or build the store there with python -m lit_ppl.fetch"
        ) from None
    token = f"{socket.gethostname()} pid {os.getpid()} at {time.time_ns()}"
    os.write(fd, (token + "\n").encode())
    os.close(fd)
    return token


def _release(lock: Path, token: str) -> None:
    """Remove ``lock`` only if it is still ours: a builder that took over a lock it thought stale owns it now."""
    try:
        if lock.read_text().strip() == token:
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def _remove_stale_builds(final: Path, timeout_s: float) -> None:
    """Temporary directories of builders that died (``<key>.tmp-HOST-PID``): this host's whose process is gone, any
    host's untouched for longer than the lock's timeout. Only the lock's holder calls this."""
    host = socket.gethostname()
    for tmp in final.parent.glob(f"{final.name}.tmp-*"):
        owner_host, _, pid = tmp.name.removeprefix(f"{final.name}.tmp-").rpartition("-")
        try:
            gone = owner_host == host and pid.isdigit() and not process_alive(int(pid))
            if gone or time.time() - tmp.stat().st_mtime > timeout_s + 60:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            continue


def _owner(lock: Path) -> str:
    try:
        return lock.read_text().strip() or "another process"
    except OSError:
        return "another process"


def _build_locked(
    spec: DataSpec, tokenizer: Tokenizer, final: Path, lock: Path, progress: bool, timeout_s: float
) -> None:
    tmp = final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    # The lock's mtime says this builder is alive: touched by a thread, so that one long batch (a large file read as
    # one document) never makes it look stale to a waiting process.
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lock, min(10.0, timeout_s / 4), stop), daemon=True)
    beat.start()
    try:
        build(spec, tokenizer, tmp, progress)
        try:
            os.rename(tmp, final)
        except OSError:  # a builder that took over our lock got there first: its store is as good
            if not (final / "meta.json").is_file():
                raise
    finally:
        stop.set()
        beat.join()
        shutil.rmtree(tmp, ignore_errors=True)


def _heartbeat(lock: Path, every_s: float, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        try:
            os.utime(lock)
        except FileNotFoundError:  # taken over (we looked stale after all): the other builder's lock is its own
            return


def build(
    spec: DataSpec,
    tokenizer: Tokenizer,
    directory: Path,
    progress: bool = True,
) -> None:
    """Tokenize ``spec``'s documents into a store at ``directory`` (which must not exist)."""
    directory.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    counts: list[np.ndarray] = []
    n_tokens = max_token = n_docs = 0
    has_text = False  # a corpus of whitespace alone would be scored as if it were text
    bar, t0 = None, time.monotonic()
    last: np.ndarray | None = None  # the last document's counts: the next batch may continue it
    with open(directory / "tokens.bin", "wb") as out:
        for texts, starts, (flat, piece_counts) in encoded_batches(spec, tokenizer, dtype):
            has_text = has_text or any(t.strip() for t in texts)
            out.write(flat.tobytes())
            doc_counts, last = _documents_of(piece_counts, starts, last)
            still_open = last[:1] if last is not None else np.zeros(0, np.int64)
            check_nonempty(np.concatenate([doc_counts[:, 0], still_open]), n_docs)  # with the one still open
            if len(doc_counts):
                counts.append(doc_counts)
                n_docs += len(doc_counts)
            n_tokens += len(flat)
            max_token = max(max_token, int(flat.max()) if len(flat) else 0)
            if bar is None and progress:  # once the source is open: an error comes before any bar
                bar = _bar(spec)
            if bar is not None:
                bar.set_postfix_str(f"{n_tokens / (time.monotonic() - t0):,.0f} tokens/s", refresh=False)
                bar.update(int(piece_counts[:, 2].sum()))
        out.flush()
        os.fsync(out.fileno())
    if bar is not None:
        bar.close()
    if last is not None:
        counts.append(last[None])
        n_docs += 1
    if n_docs == 0:
        raise LitPplError(f"{spec.describe()} has no documents")
    if not has_text:
        raise LitPplError(f"{spec.describe()} holds only whitespace: there is no text to score")
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


def _documents_of(
    pieces: np.ndarray, starts: list[bool], last: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """The finished documents' ``(tokens, words, bytes)`` rows from a batch of pieces' rows, and the last
    document's row, which the next batch may still continue (pieces of one document add up)."""
    rows: list[np.ndarray] = []
    for row, start in zip(pieces, starts, strict=True):
        if start:
            if last is not None:
                rows.append(last)
            last = row.copy()
        else:
            assert last is not None, "a continuation before any document: a bug in lit_ppl.data.tokenize"
            last += row
    return (np.stack(rows) if rows else np.zeros((0, 3), np.int64)), last


def _bar(spec: DataSpec):
    from tqdm.auto import tqdm

    # No total: compressed files and data.limit make the text's size unknown until it is read.
    return tqdm(unit="B", unit_scale=True, desc=f"tokenizing ({processes(spec)} proc)", file=sys.stderr)
