"""Several torchrun "nodes" on 127.0.0.1, one of them optionally slowed down by a cgroup v1 CPU quota.

A heterogeneous job (one fast and one slow node) is emulated by starting one node's torchrun inside a cgroup
whose ``cpu.cfs_quota_us`` lets it use a fraction of one core (root and the cgroup v1 ``cpu`` controller needed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # a short period: the quota is enforced in 10 ms slices, not in 100 ms bursts


def slow_cgroup(name: str, share: float) -> Path | None:
    """A cgroup limited to ``share`` of one core, or ``None`` where cgroup v1 quotas cannot be set here."""
    group = CGROUP_CPU / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(share * PERIOD_US)))
    except OSError:
        return None
    return group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    args: list[str],
    cwd: Path,
    nodes: int = 2,
    per_node: int = 1,
    cgroups: dict[int, Path] | None = None,
    node_args: dict[int, list[str]] | None = None,
) -> list[subprocess.Popen]:
    """``python -m lit_ppl.validate ARGS`` as ``nodes`` torchrun launches; node ``k`` runs in ``cgroups[k]`` and
    adds ``node_args[k]`` to its command line."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node)]
        cmd += ["--nproc_per_node", str(per_node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
        cmd += [
            "-m",
            "lit_ppl.validate",
            *args,
            *(node_args or {}).get(node, []),
            f"hydra.run.dir={cwd / f'node{node}'}",
        ]
        group = (cgroups or {}).get(node)
        if group is not None:  # the shell joins the cgroup, then becomes torchrun: its ranks inherit the quota
            cmd = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """``(returncode, stderr)`` of every launch."""
    out = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        out.append((p.returncode, err))
    return out
