"""Pytest helper: a real, local two-node Slurm cluster (started by ``.ci/slurm.sh``).

Not a test module. Use it from a conftest.py (preferred, one cluster per session)::

    import pytest
    from helpers.slurm_cluster import slurm_cluster

    @pytest.fixture(scope="session")
    def slurm(tmp_path_factory):
        yield from slurm_cluster(tmp_path_factory)

or import the ready-made session fixture ``slurm`` (``from helpers.slurm_cluster import slurm``).
Several definitions share one cluster per process (reference counted).

If Slurm cannot be installed/started (not root, no apt, ...) the requesting test is
skipped -- unless ``CI=true`` is set, then it fails.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SLURM_SH = REPO_ROOT / ".ci" / "slurm.sh"

#: job states after which a job will not run again (a requeued job goes back to PENDING)
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
    }
)

# environment variables that must not leak from an outer Slurm job into our cluster
_SLURM_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCONTROL_")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def _unavailable(reason: str) -> None:
    """Skip (locally) or fail (CI=true) because the cluster is not usable."""
    if _in_ci():
        pytest.fail(f"slurm cluster unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"slurm cluster unavailable: {reason}")


class SlurmCluster:
    """Handle on a running local cluster.

    Attributes:
        dir:     state directory (slurm.conf, logs in ``dir/log``, env.sh)
        conf:    path of slurm.conf
        env:     environment for subprocesses talking to the cluster: os.environ without
                 inherited SLURM_* vars, plus SLURM_CONF, MASTER_ADDR=127.0.0.1,
                 PYTHON=sys.executable, venv bin dir first on PATH, repo root first on
                 PYTHONPATH.
        workdir: default working directory for submitted jobs (contains ``logs/``)
        nodes:   ["n1", "n2"]
    """

    nodes = ("n1", "n2")

    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir)
        self.conf = self.dir / "slurm.conf"
        self.workdir = self.dir / "work"
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SLURM_ENV_PREFIXES)}
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "/usr/bin:/bin")])
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH")] if p)
        env["PYTHON"] = sys.executable
        env["SLURM_CONF"] = str(self.conf)
        env["MASTER_ADDR"] = "127.0.0.1"  # node names n1/n2 do not resolve
        env["PYTHONUNBUFFERED"] = "1"
        self.env: dict[str, str] = env

    # ------------------------------------------------------------------ low level
    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sinfo``, ``scontrol`` ...) against this cluster."""
        kw.setdefault("cwd", self.workdir)
        r = subprocess.run([str(c) for c in cmd], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    # ------------------------------------------------------------------ jobs
    def submit(
        self,
        script: str | os.PathLike,
        args: Sequence[str] = (),
        sbatch_args: Sequence[str] = (),
        cwd: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """``sbatch [sbatch_args] script [args]``; returns the job id (a string).

        ``cwd`` (default ``self.workdir``) is the job's working directory; a ``logs/``
        sub-directory is created there (the lit_ppl templates write ``logs/%x-%j.out``).
        ``env`` entries are added to ``self.env`` (sbatch exports the environment).
        """
        script = Path(script).resolve()
        cwd = Path(cwd) if cwd is not None else self.workdir
        (cwd / "logs").mkdir(parents=True, exist_ok=True)
        full_env = {**self.env, **(env or {})}
        cmd = ["sbatch", "--parsable", *map(str, sbatch_args), str(script), *map(str, args)]
        r = subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
        return r.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str] | None:
        """``scontrol show job -o`` as a dict (JobState, Restarts, ExitCode, StdOut, NodeList, ...);
        None if slurmctld does not know the job."""
        r = self.run("scontrol", "show", "job", "-o", str(job_id), check=False, timeout=30)
        if r.returncode != 0 or "JobId=" not in r.stdout:
            return None
        line = r.stdout.strip().splitlines()[0]
        info: dict[str, str] = {}
        # values may contain spaces only in a few fields (e.g. Command args); good enough
        for m in re.finditer(r"(\S+?)=(\S*)", line):
            info.setdefault(m.group(1), m.group(2))
        return info

    def state(self, job_id: str) -> str | None:
        """Base job state (e.g. PENDING, RUNNING, COMPLETED) or None if unknown."""
        info = self.job_info(job_id)
        return None if info is None else info.get("JobState")

    def wait(
        self,
        job_id: str,
        timeout: float = 120,
        states: Sequence[str] | frozenset[str] = TERMINAL_STATES,
        poll: float = 0.5,
    ) -> str:
        """Poll until the job state is in ``states`` (default: a terminal state) and return it.

        A requeued job passes through PENDING again and is waited for. Raises
        TimeoutError (with job info and log tails) if ``timeout`` seconds pass.
        """
        states = frozenset(states)
        deadline = time.monotonic() + timeout
        last = None
        while True:
            last = self.state(job_id)
            if last in states:
                return last
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} not in {sorted(states)} after {timeout}s (last state {last})\n"
                    + self.diagnostics(job_id)
                )
            time.sleep(poll)

    def wait_running(self, job_id: str, timeout: float = 60) -> str:
        """Wait until the job is RUNNING (or already finished); returns the state."""
        return self.wait(job_id, timeout, states=TERMINAL_STATES | {"RUNNING"})

    def cancel(self, job_id: str, signal: str | None = None, *extra: str) -> None:
        """``scancel [--signal=SIG] [extra] job_id``. With a signal (e.g. "USR1") it goes to
        all job steps (the srun tasks), not the batch shell -- like ``--signal=USR1@T``."""
        cmd = ["scancel"] + ([f"--signal={signal}"] if signal else []) + list(extra) + [str(job_id)]
        self.run(*cmd)

    def output(self, job_id: str) -> str:
        """Contents of the job's stdout file ('' if not there yet)."""
        info = self.job_info(job_id) or {}
        path = info.get("StdOut")
        if not path:
            return ""
        try:
            return Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def diagnostics(self, job_id: str | None = None) -> str:
        """Job info, job output and daemon log tails, for assertion messages."""
        parts = []
        for cmd in (("sinfo", "-N", "-l"), ("squeue",)):
            r = self.run(*cmd, check=False, timeout=20)
            parts.append(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        if job_id is not None:
            r = self.run("scontrol", "show", "job", str(job_id), check=False, timeout=20)
            parts.append(f"$ scontrol show job {job_id}\n{r.stdout}{r.stderr}")
            parts.append(f"---- job output\n{self.output(job_id)[-4000:]}")
        for log in sorted((self.dir / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"---- {log.name}\n" + "\n".join(lines))
        return "\n".join(parts)


# ---------------------------------------------------------------------- start/stop
_CLUSTER: SlurmCluster | None = None
_REFS = 0


def _state_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("slurm")
    if len(str(d)) > 80:  # unix socket paths are limited to ~108 bytes
        d = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    return d


def _stop(state_dir: Path) -> None:
    subprocess.run(["bash", str(SLURM_SH), "stop", str(state_dir)], capture_output=True, timeout=120)


def start_cluster(state_dir: Path) -> SlurmCluster:
    """Start a cluster in ``state_dir`` (skip/fail via pytest if impossible)."""
    if not sys.platform.startswith("linux"):
        _unavailable(f"needs Linux (platform {sys.platform})")
    if os.geteuid() != 0:
        _unavailable("needs root (slurm daemons run as SlurmUser=root, may need apt-get)")
    try:
        r = subprocess.run(
            ["bash", str(SLURM_SH), "start", str(state_dir)],
            capture_output=True,
            text=True,
            timeout=600,  # includes apt-get install on a fresh machine
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        _stop(state_dir)
        _unavailable(f".ci/slurm.sh start failed: {e!r}")
    if r.returncode != 0:
        _stop(state_dir)
        _unavailable(f".ci/slurm.sh start failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}")
    return SlurmCluster(state_dir)


def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """Generator for a session-scoped fixture: starts the cluster (once per process,
    shared by all fixtures built on this function), yields a SlurmCluster, stops it
    when the last user is torn down."""
    global _CLUSTER, _REFS
    if _CLUSTER is None:
        state_dir = _state_dir(tmp_path_factory)
        _CLUSTER = start_cluster(state_dir)
        atexit.register(_stop, state_dir)  # safety net if teardown never runs
    _REFS += 1
    cluster = _CLUSTER
    try:
        yield cluster
    finally:
        _REFS -= 1
        if _REFS == 0:
            _CLUSTER = None
            _stop(cluster.dir)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    """Session fixture: a running local 2-node SlurmCluster."""
    yield from slurm_cluster(tmp_path_factory)
