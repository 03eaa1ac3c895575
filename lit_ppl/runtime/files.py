"""The one way lit-ppl writes a file: a temp file in the same directory, fsync, then ``os.replace``.

A crash or a full disk leaves the previous file intact, never a truncated one, and concurrent writers (one per
Slurm job of a sweep, or two ranks) each replace it whole: a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
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


RUN_LOCK = ".lit_ppl.lock"


def first_process() -> bool:
    """Whether this process is the run's first (global rank 0), from the launchers' variables alone: the lock below
    is taken before any process group exists (torchrun's ``RANK``, Slurm's ``SLURM_PROCID``, Lightning's relaunched
    ``NODE_RANK``/``LOCAL_RANK``)."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name) is not None:
            return os.environ[name] == "0"
    return os.environ.get("NODE_RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def run_lock(directory: Path, holder: bool) -> Iterator[None]:
    """``directory/.lit_ppl.lock`` while a run writes there (only ``holder``, the run's first process, takes it): a
    second run into the same ``output_dir`` is refused in one line instead of racing the first's files. A lock
    left by a process that is gone (on this host) or by an earlier attempt of the same Slurm job is taken over."""
    import socket

    if not holder:
        yield
        return
    lock = directory / RUN_LOCK
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID")}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(lock.read_text())
            except (OSError, ValueError):
                owner = {}
            same_host = owner.get("host") == mine["host"]
            gone = same_host and isinstance(owner.get("pid"), int) and not process_alive(owner["pid"])
            requeued = mine["slurm_job"] is not None and owner.get("slurm_job") == mine["slurm_job"]
            if not (gone or requeued or (owner.get("pid") == mine["pid"] and same_host)):
                raise LitPplError(
                    f"output_dir={str(directory)!r} is in use by another run ({owner.get('host')} pid "
                    f"{owner.get('pid')}); give another output_dir, or delete {lock} if that run is gone"
                ) from None
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        break
    else:  # taken over and retaken by others three times over: not ours to take
        raise LitPplError(f"output_dir={str(directory)!r}: could not take {lock}; another run keeps taking it")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(lock.read_text()) == mine:
                lock.unlink()


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
