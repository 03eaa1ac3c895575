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


def npy_header(shape: tuple[int, ...], dtype: Any) -> bytes:
    """The ``.npy`` (version 1.0) header of a C-ordered array of ``shape`` and ``dtype``."""
    import numpy as np

    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def npy_size(shape: tuple[int, ...], dtype: Any) -> int:
    import numpy as np

    return len(npy_header(shape, dtype)) + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def npy_problem(path: Path, shape: tuple[int, ...], dtype: Any) -> str | None:
    """What keeps ``path`` from being the ``.npy`` file :func:`create_npy` writes for ``shape`` and ``dtype``."""
    head, size = npy_header(shape, dtype), npy_size(shape, dtype)
    try:
        with open(path, "rb") as f:
            found, actual = f.read(len(head)), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return "is missing"
    if actual != size or found != head:
        return f"holds {actual:,} bytes, not the {size:,} of a {tuple(shape)} {dtype} array"
    return None


def reserve(fd: int, nbytes: int, path: Path) -> None:
    """Allocate ``nbytes`` for the open file ``fd`` (to be ``path``) now, so that writing through a memory map later
    never meets a full disk (a ``SIGBUS``, "Bus error", with no message). A filesystem that cannot allocate ahead
    gets its free space checked instead: then a disk that fills up later can still end the run so."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    stat = os.fstatvfs(fd)
    free = stat.f_bavail * stat.f_frsize
    if full or free < nbytes:
        raise LitPplError(
            f"{path.parent} has no room for {path.name}: it needs {nbytes:,} bytes ({nbytes / 2**20:,.1f} MiB) and "
            f"{free:,} are free; free space there or give another directory"
        )
    os.ftruncate(fd, nbytes)


def create_npy(path: Path, shape: tuple[int, ...], dtype: Any, fill: Any = None, replace: bool = True) -> bool:
    """Write a ``.npy`` file of ``shape`` and ``dtype``, its space allocated (:func:`reserve`) and every element
    ``fill`` (zero if ``None``), beside ``path``, then put it there: over any file (``replace``) or only where there is
    none; ``False`` when another process put its own there first. A reader never sees a file half made."""
    import numpy as np

    head, size = npy_header(shape, dtype), npy_size(shape, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())
            reserve(fd, size, path)
            os.pwrite(fd, head, 0)
            if fill is not None and size > len(head):
                rows = np.memmap(tmp, dtype=dtype, mode="r+", offset=len(head), shape=tuple(shape))
                rows[...] = fill
                rows.flush()
                del rows
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        Path(tmp).unlink(missing_ok=True)


def shared_npy(path: str | Path, shape: tuple[int, ...], dtype: Any, fill: Any = None) -> Any:
    """A writable memory map of the ``.npy`` file ``path`` of ``shape`` and ``dtype``, created if absent
    (:func:`create_npy`, every element ``fill``).

    Every rank (on any node of a shared filesystem) may open it at once and write its own rows; a file created by two
    at once is one of theirs, whole, and a rerun after preemption keeps the rows written before. ``np.load`` reads
    the result.
    """
    import numpy as np

    path = Path(path)
    if not path.exists():
        create_npy(path, shape, dtype, fill, replace=False)
    problem = npy_problem(path, shape, dtype)
    if problem:
        raise LitPplError(f"{path} {problem}: another run's file; give another directory, or delete it")
    return np.memmap(path, dtype=dtype, mode="r+", offset=len(npy_header(shape, dtype)), shape=tuple(shape))
