"""The one way lit-ppl writes a file: a temp file in the same directory, fsync, then ``os.replace``.

A crash or a full disk leaves the previous file intact, never a truncated one, and concurrent writers (one per
Slurm job of a sweep, or two ranks) each replace it whole: a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a private temp path beside ``path``; once the block has written it, fsync it and rename it over
    ``path``. On any exception the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        # Name the file the caller asked for, not a temp name it never heard of (OSError picks the subclass).
        raise OSError(err.errno, err.strerror, str(path)) from err
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide results from others on shared storage
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it: set and restore
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """``obj`` as strict JSON (no NaN/inf: other readers reject them), written by :func:`write_text_atomic`."""
    return write_text_atomic(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")
