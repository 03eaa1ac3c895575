"""The run lock: ``output_dir/.lit_ppl.lock`` while a run writes there, so that a second run is refused, not raced
(and the same lock, ``.lit_ppl.store.lock``, on a reference being saved: :mod:`lit_ppl.evaluation.reference`).

A lock names its holder: host, pid (with the process's start time and pid namespace, so a reused pid or another
container's is not taken for it), Slurm job and restart count, and a random token. It is written whole to a temp
file first and then hard-linked into place, so a full disk never leaves an empty lock behind, and the holder
touches it every :data:`HEARTBEAT_S` while it runs. It is taken over only when its holder is provably gone:

- on this host (same hostname and pid namespace): its process is gone — a live pid is proof enough, whatever
  its heartbeat says (a run suspended by ``scontrol suspend`` is still alive);
- an earlier attempt of this Slurm job (the same ``SLURM_JOB_ID`` with a lower ``SLURM_RESTART_COUNT``): Slurm
  ends every step of an attempt before it requeues the job. Two ``srun`` steps of one allocation share the job id
  and the restart count, so neither takes the other's lock;
- on another host, its heartbeat stopped :data:`STALE_S` ago: nothing else about a process on another node can
  be seen from here, and the margin covers NFS's attribute caching (up to 60 s) and clock differences.

Taking over is a compare-and-swap built from ``O_EXCL``-like ``link``: the taker first creates the claim
``.lit_ppl.lock.<stale token>.<k>``, which only one process can create, then checks that the lock still holds
the stale token and renames its own record over it. Every other process that judged the same lock stale finds
the claim taken and looks again at the (now live) lock. A claim whose taker died is passed over with ``k + 1``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lit_ppl.errors import LitPplError
from lit_ppl.runtime.files import no_space, process_alive

RUN_LOCK = ".lit_ppl.lock"
HEARTBEAT_S = 10.0  # how often the holder touches its lock
STALE_S = 300.0  # a lock of another host untouched this long: its holder is gone
TRIES = 50  # looks at a lock that other processes keep taking over, 0.05 s apart
_held: set[str] = set()  # tokens of the locks this process holds now


def first_process() -> bool:
    """Whether this process is the run's first (global rank 0), from the launchers' variables alone: the lock below
    is taken before any process group exists (torchrun's ``RANK``, Slurm's ``SLURM_PROCID``, Lightning's relaunched
    ``NODE_RANK``/``LOCAL_RANK``)."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name) is not None:
            return os.environ[name] == "0"
    return os.environ.get("NODE_RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``), or ``None`` where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22; the command name before ")" may hold spaces


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def holder_record() -> dict[str, Any]:
    """This process as a lock's holder."""
    return {
        "token": uuid.uuid4().hex,
        "host": socket.gethostname(),
        "pid_namespace": _pid_namespace(),
        "pid": os.getpid(),
        "started": _started(os.getpid()),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_step": os.environ.get("SLURM_STEP_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
    }


def read_lock(path: Path) -> tuple[dict[str, Any] | None, os.stat_result] | None:
    """A lock's holder (``None`` if unreadable, e.g. an empty lock an older lit-ppl left on a full disk) and its
    ``stat``; ``None`` if there is no lock."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    try:
        owner = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None, st
    return (owner if isinstance(owner, dict) else None), st


def gone(owner: dict[str, Any] | None, st: os.stat_result, mine: dict[str, Any]) -> str | None:
    """Why the holder of a lock (``owner``, its file's ``st``) is gone, or ``None`` if it may be alive."""
    age = time.time() - st.st_mtime
    if owner is None:
        return f"it cannot be read and was untouched for {age:.0f} s" if age > STALE_S else None
    if owner.get("token") in _held:
        return None  # this process holds it (a run inside a run)
    job, restart, pid = owner.get("slurm_job"), _count(owner.get("slurm_restart")), _count(owner.get("pid"))
    if job is not None and job == mine["slurm_job"] and restart < mine["slurm_restart"]:
        return f"it is an earlier attempt of Slurm job {job}, which Slurm ended before requeueing it"
    namespace = owner.get("pid_namespace", mine["pid_namespace"])  # not recorded by lit-ppl before issue 34
    if owner.get("host") == mine["host"] and namespace == mine["pid_namespace"] and 0 < pid < 1 << 31:
        if not process_alive(pid):
            return f"its process {pid} is gone"
        now = _started(pid)
        if owner.get("started") is not None and now is not None and now != owner["started"]:
            return f"pid {pid} is now another process"
        return None  # alive on this host: a stopped heartbeat only means it is suspended
    return f"its heartbeat stopped {age:.0f} s ago" if age > STALE_S else None


def _count(value: Any) -> int:
    """A lock's count (a pid, a restart count) as written, or 0 for anything else (a lock is read, not trusted)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _write_record(directory: Path, record: dict[str, Any], name: str = RUN_LOCK, key: str = "output_dir") -> Path:
    """``record`` in a new temp file of ``directory``, written whole (one line naming the directory if it cannot)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=directory)
    except OSError as err:
        raise _unwritable(directory, err, name, key) from err
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise _unwritable(directory, err, name, key) from err
    return Path(tmp)


def _unwritable(directory: Path, err: OSError, name: str = RUN_LOCK, key: str = "output_dir") -> Exception:
    if (space := no_space(err, directory / name)) is not None:
        return space
    return LitPplError(f"{key}={str(directory)!r}: cannot write its lock {name} ({err.strerror or err})")


def _create(source: Path, dest: Path) -> bool:
    """Put ``source``'s content at ``dest`` if nothing is there (whole, or not at all); whether it did."""
    try:
        os.link(source, dest)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
    # A filesystem without hard links: create exclusively and write, removing a file that could not be written.
    try:
        fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, source.read_bytes())
        os.fsync(fd)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return True


def _identity(owner: dict[str, Any] | None, st: os.stat_result) -> str:
    """What names one lock among all locks ever at that path: its token, or for one that cannot be read its file."""
    token = (owner or {}).get("token")
    mine = isinstance(token, str) and token.isalnum() and len(token) <= 64  # it names a file: nothing else
    return token if mine else f"file{st.st_ino}-{st.st_mtime_ns}"


def _take_over(lock: Path, stale: str, tmp: Path, mine: dict[str, Any]) -> bool:
    """Replace the lock ``stale`` (its :func:`_identity`) by ``tmp`` if this process is the one to claim it."""
    k = 1
    while True:
        claim = lock.with_name(f"{lock.name}.{stale}.{k}")
        if _create(tmp, claim):
            break
        found = read_lock(claim)
        if found is None or gone(*found, mine) is None:
            return False  # another process is taking it over, or has
        k += 1  # its taker died between claiming and renaming
    try:
        now = read_lock(lock)
        if now is None or _identity(*now) != stale:
            return False  # taken over and maybe released meanwhile: look again
        os.replace(tmp, lock)
        return True
    finally:
        for old in lock.parent.glob(f"{lock.name}.{stale}.*"):
            with contextlib.suppress(OSError):
                old.unlink()


def acquire(directory: Path, name: str = RUN_LOCK, key: str = "output_dir") -> tuple[Path, dict[str, Any]]:
    """Take ``directory``'s lock ``name`` (the run lock; ``key`` names the setting that gave ``directory``), or raise
    a one-line error naming the run that holds it."""
    lock = directory / name
    mine = holder_record()
    tmp = _write_record(directory, mine, name, key)
    try:
        for _ in range(TRIES):
            if _create(tmp, lock):
                return lock, mine
            found = read_lock(lock)
            if found is None:
                continue  # released meanwhile
            owner, st = found
            why = gone(owner, st, mine)
            if why is None:
                raise LitPplError(_in_use(directory, lock, owner, st, key))
            if _take_over(lock, _identity(owner, st), tmp, mine):
                print(f"lit-ppl: took over {lock}: {why}", file=sys.stderr)
                return lock, mine
            time.sleep(0.05)
    except OSError as err:
        raise _unwritable(directory, err, name, key) from err
    finally:
        tmp.unlink(missing_ok=True)
    raise LitPplError(f"{key}={str(directory)!r}: could not take {lock}; other runs keep taking it over")


def _in_use(directory: Path, lock: Path, owner: dict[str, Any] | None, st: os.stat_result, key: str) -> str:
    who = "an unreadable lock" if owner is None else f"{owner.get('host')} pid {owner.get('pid')}"
    job = f", Slurm job {owner['slurm_job']}" if owner and owner.get("slurm_job") else ""
    return (
        f"{key}={str(directory)!r} is in use by another run ({who}){job}, its lock touched "
        f"{max(0.0, time.time() - st.st_mtime):.0f} s ago; give another {key}, or delete {lock} if that run is "
        f"gone (a lock of another host is taken over once untouched for {STALE_S:.0f} s)"
    )


def _heartbeat(lock: Path, token: str, stop: threading.Event, key: str) -> None:
    while not stop.wait(HEARTBEAT_S):
        found = read_lock(lock)
        if found is None or (found[0] or {}).get("token") != token:
            owner = (found[0] or {}) if found else {}
            what = f"taken over by {owner.get('host')} pid {owner.get('pid')}" if found else "deleted"
            print(
                f"lit-ppl: warning: {lock} was {what} while this run held it: another run may now write to that "
                f"{key} too",
                file=sys.stderr,
            )
            return
        with contextlib.suppress(OSError):
            os.utime(lock)


def holds(lock: Path) -> bool:
    """Whether this process holds ``lock`` now (not taken over, not deleted)."""
    found = read_lock(lock)
    return found is not None and (found[0] or {}).get("token") in _held


@contextlib.contextmanager
def directory_lock(directory: Path, holder: bool, name: str = RUN_LOCK, key: str = "output_dir") -> Iterator[None]:
    """``directory/name`` while a run writes there (only ``holder``, the run's first process, takes it): a second
    run into the same directory (``key`` names its setting) is refused in one line instead of racing the first's
    files."""
    if not holder:
        yield
        return
    lock, mine = acquire(Path(directory), name, key)
    _held.add(mine["token"])
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lock, mine["token"], stop, key), daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        _held.discard(mine["token"])
        found = read_lock(lock)
        if found is not None and (found[0] or {}).get("token") == mine["token"]:
            lock.unlink(missing_ok=True)


def run_lock(directory: Path, holder: bool) -> contextlib.AbstractContextManager:
    """``directory/.lit_ppl.lock`` while a run writes there: a second run into the same ``output_dir`` is refused in
    one line instead of racing the first's files (:func:`directory_lock`)."""
    return directory_lock(directory, holder)
