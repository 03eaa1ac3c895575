"""Per-token ``.npy`` arrays in corpus order, written by whichever rank scores a window, and checked whole at the end.

Every scored token has one row in corpus order (:func:`lit_ppl.data.windows.token_offsets`), carried by each batch
as ``token_index``; whichever rank scores a window writes its tokens' rows in shared memory-mapped files
(:func:`lit_ppl.runtime.files.shared_npy`), so the files do not depend on the world size or layout that wrote
them, and a resumed run rewrites only what it scores again. A fresh run creates its files whole, space allocated
and every row set to a value no scored token has (NaN, or target -1), so a row no rank wrote is found at the end:
:func:`corpus_rows` gives what each row must hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_ppl.data.sampler import PAD
from lit_ppl.data.windows import Windows, doc_offsets, scored_positions
from lit_ppl.runtime.files import create_npy, npy_problem, shared_npy

ROWS_PER_CHUNK = 1 << 22  # rows checked at a time at the end: a few arrays of this many int64s at most


class TokenArrays:
    """Named ``.npy`` arrays in ``directory``: ``fields[name] = (shape, dtype, fill)``, ``fill`` what a fresh file
    holds in every element (a value no written row has, or ``None``: zeros)."""

    def __init__(self, directory: Path, fields: dict[str, tuple[tuple[int, ...], Any, Any]]) -> None:
        self.dir, self.fields = Path(directory), fields
        self.arrays: dict[str, np.memmap] = {}

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.npy"

    def create(self) -> None:
        """Fresh files, replacing any there (first process of a fresh run, once their owner is known)."""
        for name, (shape, dtype, fill) in self.fields.items():
            create_npy(self.path(name), shape, dtype, fill)

    def problems(self) -> list[str]:
        """What is wrong with the files a resumed run continues (``[]``: each is there, of its shape and dtype)."""
        return [
            f"{self.path(name).name} {problem}"
            for name, (shape, dtype, _) in self.fields.items()
            if (problem := npy_problem(self.path(name), shape, dtype))
        ]

    def open(self) -> None:
        """Every rank: the memory maps (a file absent here, in a directory this node does not share, is created)."""
        self.arrays = {
            name: shared_npy(self.path(name), shape, dtype, fill) for name, (shape, dtype, fill) in self.fields.items()
        }

    def read(self, name: str) -> np.ndarray:
        """The file as it is now, opened afresh: what every rank wrote, even on a filesystem whose clients cache
        (NFS revalidates a file when it is opened), never this process's view of its own writes."""
        return np.load(self.path(name), mmap_mode="r", allow_pickle=False)

    def write(self, index: torch.Tensor, **values: torch.Tensor) -> dict[str, np.ndarray]:
        """Write ``values`` at rows ``index``; returns each as the bytes written (numpy, the file's dtype)."""
        rows = index.cpu().numpy()
        written = {}
        for name, value in values.items():
            array = self.arrays[name]
            host = value.detach().cpu()
            if host.dtype == torch.bfloat16:
                host = host.view(torch.int16)  # the same bits, in a dtype numpy has
            written[name] = host.numpy().view(array.dtype).reshape(len(rows), *array.shape[1:])
            array[rows] = written[name]
        return written

    def flush(self) -> None:
        """Push the written rows to the file (each progress save: a preempted run's rows survive the node)."""
        for array in self.arrays.values():
            array.flush()

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def row_digest(rows: np.ndarray) -> int:
    """A 64-bit digest of ``rows``' bytes (one window's rows of one file): never 0, the value of a row unwritten."""
    value = int.from_bytes(hashlib.blake2b(np.ascontiguousarray(rows).data, digest_size=8).digest(), "little")
    return value or 1


def window_spans(window_ids: torch.Tensor, first_token: np.ndarray) -> list[tuple[int, slice]]:
    """``(window, its rows within the batch's scored tokens)`` for each real window of a batch, in batch order."""
    ids = window_ids.cpu().numpy().reshape(-1)
    real = ids[ids != PAD]
    counts = first_token[real + 1] - first_token[real]
    ends = np.cumsum(counts)
    return [(int(w), slice(int(e - n), int(e))) for w, e, n in zip(real, ends, counts, strict=True)]


def corpus_rows(windows: Windows, doc_lengths: np.ndarray, tokens: np.ndarray, first_token: np.ndarray) -> Iterator:
    """``(rows, documents, positions, targets)`` of every scored token in corpus order, a chunk of windows at a time:
    what the per-token files must agree with, from the windows and the token store alone."""
    bos = doc_offsets(doc_lengths)
    lo = 0
    while lo < len(windows):
        hi = int(np.searchsorted(first_token, first_token[lo] + ROWS_PER_CHUNK, side="right"))
        hi = min(max(hi - 1, lo + 1), len(windows))
        part = Windows(
            *(getattr(windows, k)[lo:hi] for k in ("start", "end", "score_from", "documents", "words", "bytes")),
            joined=windows.joined,
            bos_first=windows.bos_first,
        )
        doc, position = scored_positions(part, doc_lengths)
        rows = slice(int(first_token[lo]), int(first_token[hi]))
        yield rows, doc, position, np.asarray(tokens[bos[doc] + 1 + position])
        lo = hi
