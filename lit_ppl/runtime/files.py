"""The one way lit-ppl writes a file: a temp file in the same directory, fsync, then ``os.replace``.

A crash or a full disk leaves the previous file intact, never a truncated one, and concurrent writers (one per
Slurm job of a sweep, or two ranks) each replace it whole: a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lit_ppl.errors import LitPplError


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
        raise no_space(err, path) or OSError(err.errno, err.strerror, str(path)) from err
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide results from others on shared storage
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and (space := no_space(err, path)) is not None:
            raise space from err
        raise


def no_space(err: OSError, path: str | Path) -> LitPplError | None:
    """A full disk (or quota) met while writing ``path``, as one line naming its directory; ``None`` for another
    error."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    path = Path(path)
    where = path if path.is_dir() else path.parent
    return LitPplError(f"no space left in {where} ({err.strerror}) while writing {path.name}; free space there")


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


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def shared_npy(path: str | Path, shape: tuple[int, ...], dtype: Any) -> Any:
    """A writable memory map of the ``.npy`` file ``path`` of ``shape`` and ``dtype``, created if absent.

    Every rank (on any node of a shared filesystem) may open it at once and write its own rows: each writes the same
    header and sets the same length (``ftruncate`` to the current size keeps what others wrote), so no rank has to
    wait for a creator, and a rerun after preemption keeps the rows written before. ``np.load`` reads the result.
    """
    import numpy as np

    dtype = np.dtype(dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    head = buffer.getvalue()
    size = len(head) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if os.fstat(fd).st_size not in (0, size):
            raise LitPplError(f"{path} holds {os.fstat(fd).st_size} bytes, not the {size} of a {shape} {dtype} array")
        os.ftruncate(fd, size)
        os.pwrite(fd, head, 0)
    finally:
        os.close(fd)
    return np.memmap(path, dtype=dtype, mode="r+", offset=len(head), shape=tuple(shape))
