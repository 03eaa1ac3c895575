"""Environment doctor: checks that every rank of a (possibly multi-node) launch sees a sane setup.

Run it exactly like a real job (alone, under ``torchrun`` or under Slurm ``srun``)::

    python -m lit_ppl.doctor
    torchrun --nproc_per_node 2 -m lit_ppl.doctor --json doctor.json
    srun --ntasks-per-node 4 python -m lit_ppl.doctor

Every rank collects facts about itself (host, devices, library versions), all ranks exchange them
with ``all_gather_object``, and rank 0 prints one table row per rank plus the outcome of the
consistency checks and of a live ``all_reduce`` / ``barrier``. The exit status is 0 only if every
check passed, on every rank, so a launcher's own exit status is meaningful too.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lit_ppl.results import write_text_atomic

# Distributions whose versions must agree across ranks; a mismatch here is the classic cause of
# "works on one node, hangs on two". hydra-core is the distribution name of the `hydra` package.
PACKAGES: tuple[str, ...] = (
    "torch",
    "lightning",
    "torchmetrics",
    "transformers",
    "torchao",
    "datasets",
    "hydra-core",
)

# Number of elements in the live all_reduce: big enough to be a real transfer, small enough to be
# instant everywhere.
ALL_REDUCE_NUMEL = 1024

GIB = 1024**3


class DistEnvError(ValueError):
    """Raised when the launcher's environment variables are incomplete or contradictory."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as told by the launcher.

    Attributes:
        rank: Global rank, ``0 <= rank < world_size``.
        world_size: Total number of processes.
        local_rank: Rank among the processes on this node.
        node_rank: Index of this node.
        master_addr: Rendezvous host, or ``None`` for a lone process (no rendezvous needed).
        master_port: Rendezvous port, or ``None`` for a lone process.
        launcher: ``"torchrun"``, ``"slurm"`` or ``"single"``.
    """

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str


def _require_int(environ: Mapping[str, str], name: str, context: str) -> int:
    """Reads an integer variable, failing with a message that names it.

    Args:
        environ: The environment to read.
        name: Variable name.
        context: What kind of launch needed it, for the error message.

    Returns:
        The parsed value.

    Raises:
        DistEnvError: If the variable is missing or not an integer.
    """
    if name not in environ:
        raise DistEnvError(f"{context} launch detected but {name} is not set")
    try:
        return int(environ[name])
    except ValueError:
        raise DistEnvError(f"{name}={environ[name]!r} is not an integer") from None


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    """Reads an integer variable that may be absent.

    Args:
        environ: The environment to read.
        name: Variable name.

    Returns:
        The parsed value, or ``None`` if the variable is not set.

    Raises:
        DistEnvError: If the variable is set but not an integer.
    """
    if name not in environ:
        return None
    return _require_int(environ, name, "any")


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Expands a compressed Slurm nodelist (``node[01-03]``) the way Slurm itself does.

    Args:
        nodelist: Value of ``SLURM_JOB_NODELIST``.

    Returns:
        The host names, in Slurm's order.

    Raises:
        DistEnvError: If ``scontrol`` is unavailable or fails.
    """
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise DistEnvError(
            f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with `scontrol show hostnames` ({err}); "
            "set MASTER_ADDR explicitly"
        ) from err
    return out.split()


def _slurm_port(job_id: str) -> int:
    """Derives a rendezvous port from the job id, so that every task of a job agrees on it.

    Args:
        job_id: Value of ``SLURM_JOB_ID``.

    Returns:
        A port in ``[15000, 35000)``; jobs sharing a node rarely collide because ids differ.

    Raises:
        DistEnvError: If the job id has no digits.
    """
    digits = "".join(ch for ch in job_id if ch.isdigit())
    if not digits:
        raise DistEnvError(f"SLURM_JOB_ID={job_id!r} has no digits to derive MASTER_PORT from")
    return 15000 + int(digits) % 20000


def resolve_dist_env(
    environ: Mapping[str, str],
    hostnames: Callable[[str], list[str]] = scontrol_hostnames,
) -> DistEnv:
    """Works out rank, world size and rendezvous address from torchrun, Slurm or nothing.

    torchrun variables win over Slurm ones, because ``srun torchrun ...`` sets both and torchrun's
    describe the actual worker processes.

    Args:
        environ: The environment, usually ``os.environ``.
        hostnames: Expands a Slurm nodelist; only called under Slurm without ``MASTER_ADDR``.

    Returns:
        The resolved placement of this process.

    Raises:
        DistEnvError: If variables are missing, malformed or contradictory; the message names the
            offending variable.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        context = "torchrun-style"
        rank = _require_int(environ, "RANK", context)
        world_size = _require_int(environ, "WORLD_SIZE", context)
        local_rank = _require_int(environ, "LOCAL_RANK", context)
        if "MASTER_ADDR" not in environ:
            raise DistEnvError(f"{context} launch detected but MASTER_ADDR is not set")
        master_addr = environ["MASTER_ADDR"]
        master_port = _require_int(environ, "MASTER_PORT", context)
        # torchrun exports GROUP_RANK; other launchers use NODE_RANK or only LOCAL_WORLD_SIZE.
        node_rank = _optional_int(environ, "GROUP_RANK")
        if node_rank is None:
            node_rank = _optional_int(environ, "NODE_RANK")
        if node_rank is None:
            local_world_size = _optional_int(environ, "LOCAL_WORLD_SIZE")
            node_rank = rank // local_world_size if local_world_size else 0
        launcher = "torchrun"
        rank_name, world_name = "RANK", "WORLD_SIZE"
    elif "SLURM_PROCID" in environ:
        context = "Slurm"
        rank = _require_int(environ, "SLURM_PROCID", context)
        world_size = _require_int(environ, "SLURM_NTASKS", context)
        local_rank = _require_int(environ, "SLURM_LOCALID", context)
        node_rank = _require_int(environ, "SLURM_NODEID", context)
        if "MASTER_ADDR" in environ:
            master_addr = environ["MASTER_ADDR"]
        else:
            nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
            if not nodelist:
                raise DistEnvError("Slurm launch without MASTER_ADDR needs SLURM_JOB_NODELIST, which is not set")
            hosts = hostnames(nodelist)
            if not hosts:
                raise DistEnvError(f"SLURM_JOB_NODELIST={nodelist!r} expands to no hosts")
            master_addr = hosts[0]
        if "MASTER_PORT" in environ:
            master_port = _require_int(environ, "MASTER_PORT", context)
        elif "SLURM_JOB_ID" in environ:
            master_port = _slurm_port(environ["SLURM_JOB_ID"])
        else:
            raise DistEnvError("Slurm launch without MASTER_PORT needs SLURM_JOB_ID, which is not set")
        launcher = "slurm"
        rank_name, world_name = "SLURM_PROCID", "SLURM_NTASKS"
    else:
        return DistEnv(
            rank=0,
            world_size=1,
            local_rank=0,
            node_rank=0,
            master_addr=None,
            master_port=None,
            launcher="single",
        )

    if world_size < 1:
        raise DistEnvError(f"{world_name}={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise DistEnvError(f"{rank_name}={rank} is outside [0, {world_name}={world_size})")
    if local_rank < 0 or node_rank < 0:
        raise DistEnvError(f"local rank {local_rank} and node rank {node_rank} must be non-negative")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        launcher=launcher,
    )


def _package_version(name: str) -> str:
    """Returns an installed distribution's version without importing it (imports are slow).

    Args:
        name: Distribution name, e.g. ``"hydra-core"``.

    Returns:
        The version string, or ``"missing"``.
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def _total_ram_bytes() -> int | None:
    """Returns physical memory size, or ``None`` where the OS does not expose it via sysconf."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _usable_cores() -> int:
    """Returns cores this process may run on; affinity matters more than the machine total under Slurm."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _collect_devices() -> list[dict[str, Any]]:
    """Describes the accelerators this process can see, or the CPU if there are none.

    Returns:
        One dict per visible GPU (name, total and free bytes), or a single CPU entry.
    """
    if not torch.cuda.is_available():
        return [{"type": "cpu", "cores": _usable_cores(), "total_bytes": _total_ram_bytes()}]
    devices = []
    for index in range(torch.cuda.device_count()):
        # mem_get_info is the only portable source of *free* memory; it touches every visible
        # device, which is acceptable for a one-shot diagnostic.
        free, total = torch.cuda.mem_get_info(index)
        devices.append(
            {
                "type": "cuda",
                "index": index,
                "name": torch.cuda.get_device_name(index),
                "total_bytes": total,
                "free_bytes": free,
            }
        )
    return devices


def _collect_versions() -> dict[str, str]:
    """Returns python, package, CUDA and NCCL versions; absent ones are ``"missing"`` or ``"n/a"``."""
    versions = {"python": platform.python_version()}
    versions.update({name: _package_version(name) for name in PACKAGES})
    versions["cuda"] = torch.version.cuda or "n/a"
    nccl = "n/a"
    if torch.cuda.is_available() and dist.is_nccl_available():
        raw = torch.cuda.nccl.version()
        nccl = ".".join(str(part) for part in raw) if isinstance(raw, tuple) else str(raw)
    versions["nccl"] = nccl
    return versions


def collect_rank_info(env: DistEnv, backend: str) -> dict[str, Any]:
    """Collects everything this rank knows about itself, as JSON-serialisable data.

    Args:
        env: This process's placement.
        backend: The process-group backend in use.

    Returns:
        A dict with placement, host, backend, rendezvous address, devices and versions.
    """
    return {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "node_rank": env.node_rank,
        "world_size": env.world_size,
        "hostname": socket.gethostname(),
        "launcher": env.launcher,
        "backend": backend,
        "master_addr": env.master_addr,
        "master_port": env.master_port,
        "devices": _collect_devices(),
        "versions": _collect_versions(),
    }


def check_consistency(infos: Sequence[Mapping[str, Any]]) -> list[str]:
    """Finds disagreements between the ranks' self-reports.

    Args:
        infos: One :func:`collect_rank_info` dict per process, in any order.

    Returns:
        Human-readable problems, one per line; empty if everything is consistent.
    """
    problems: list[str] = []
    n = len(infos)

    by_package: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for info in infos:
        for package, version in info["versions"].items():
            by_package[package][version].append(info["rank"])
    for package, ranks_by_version in sorted(by_package.items()):
        if len(ranks_by_version) > 1:
            detail = "; ".join(f"{v} on ranks {sorted(r)}" for v, r in sorted(ranks_by_version.items()))
            problems.append(f"version mismatch for {package}: {detail}")
    for info in infos:
        missing = sorted(set(by_package) - set(info["versions"]))
        if missing:
            problems.append(f"rank {info['rank']} reports no version for {', '.join(missing)}")

    sizes = sorted({info["world_size"] for info in infos})
    if sizes != [n]:
        problems.append(f"world size mismatch: ranks report {sizes} but {n} processes answered")

    hosts_by_rank: dict[int, list[str]] = defaultdict(list)
    for info in infos:
        hosts_by_rank[info["rank"]].append(info["hostname"])
    for rank, hosts in sorted(hosts_by_rank.items()):
        if len(hosts) > 1:
            problems.append(f"global rank {rank} reported by {len(hosts)} processes (hosts {', '.join(hosts)})")
    missing_ranks = sorted(set(range(n)) - set(hosts_by_rank))
    if missing_ranks:
        problems.append(f"global ranks {missing_ranks} missing; expected each of 0..{n - 1} exactly once")
    unexpected = sorted(set(hosts_by_rank) - set(range(n)))
    if unexpected:
        problems.append(f"global ranks {unexpected} outside 0..{n - 1}")

    ranks_by_slot: dict[tuple[int, int], list[int]] = defaultdict(list)
    for info in infos:
        ranks_by_slot[(info["node_rank"], info["local_rank"])].append(info["rank"])
    for (node, local), ranks in sorted(ranks_by_slot.items()):
        if len(ranks) > 1:
            problems.append(f"node {node} local rank {local} claimed by global ranks {sorted(ranks)}")
    return problems


def _default_backend() -> str:
    """Picks NCCL when a GPU is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _init_process_group(env: DistEnv, backend: str, timeout_s: float) -> torch.device:
    """Joins the process group and returns the device collectives should use.

    Args:
        env: This process's placement.
        backend: ``"nccl"``, ``"gloo"``, ...
        timeout_s: Rendezvous and collective timeout, so a broken setup fails instead of hanging.

    Returns:
        The device for this rank's tensors.
    """
    timeout = timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    device_id = None
    if backend == "nccl":
        # NCCL needs the rank's GPU selected before the first collective, or ranks pile onto GPU 0.
        device = torch.device("cuda", env.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
        device_id = device
    if env.master_addr is None or env.master_port is None:
        # A lone process needs no network rendezvous; an in-memory store avoids hunting for a port.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device_id,
        )
    return device


def _timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Runs ``fn`` and returns its wall time in milliseconds, waiting for the GPU if there is one."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def run_live_checks(env: DistEnv, device: torch.device) -> dict[str, Any]:
    """Runs a float64 all_reduce and a barrier on the live process group.

    Each rank contributes ``rank + 1``, so the sum must be exactly ``N (N + 1) / 2``; float64 keeps
    that exact far beyond any realistic world size, so any deviation means corrupted traffic.

    Args:
        env: This process's placement.
        device: Where to allocate the tensor.

    Returns:
        This rank's results: ``all_reduce`` (ok, expected, got, ms) and ``barrier`` (ms).
    """
    n = env.world_size
    expected = n * (n + 1) / 2
    tensor = torch.full((ALL_REDUCE_NUMEL,), float(env.rank + 1), dtype=torch.float64, device=device)
    reduce_ms = _timed_ms(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM), device)
    got = tensor.cpu()
    ok = bool(torch.all(got == expected))
    barrier_ms = _timed_ms(dist.barrier, device)
    return {
        "rank": env.rank,
        "all_reduce": {"ok": ok, "expected": expected, "got": sorted(set(got.tolist())), "ms": reduce_ms},
        "barrier": {"ok": True, "ms": barrier_ms},
    }


def _gather(obj: object, world_size: int) -> list[Any]:
    """All-gathers a picklable object, so that every rank sees every rank's value."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _gib(num_bytes: int | None) -> str:
    """Formats bytes as GiB for the table."""
    return "?" if num_bytes is None else f"{num_bytes / GIB:.1f}"


def _describe_devices(devices: Sequence[Mapping[str, Any]]) -> str:
    """One line per device, for a table cell."""
    lines = []
    for dev in devices:
        if dev["type"] == "cpu":
            lines.append(f"cpu, {dev['cores']} cores, {_gib(dev['total_bytes'])} GiB RAM")
        else:
            lines.append(
                f"cuda:{dev['index']} {dev['name']} {_gib(dev['free_bytes'])}/{_gib(dev['total_bytes'])} GiB free"
            )
    return "\n".join(lines)


def print_report(report: Mapping[str, Any]) -> None:
    """Prints the per-rank table, the versions and the checks with Rich.

    Args:
        report: The gathered report, as written by ``--json``.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    ranks = Table(title=f"lit-ppl doctor: {report['world_size']} rank(s), backend {report['backend']}")
    for column in ("rank", "node", "local", "host", "world", "master", "devices"):
        ranks.add_column(column, justify="right" if column in {"rank", "node", "local", "world"} else "left")
    for info in report["ranks"]:
        master = "n/a" if info["master_addr"] is None else f"{info['master_addr']}:{info['master_port']}"
        ranks.add_row(
            str(info["rank"]),
            str(info["node_rank"]),
            str(info["local_rank"]),
            escape(info["hostname"]),
            str(info["world_size"]),
            escape(master),
            escape(_describe_devices(info["devices"])),
        )
    console.print(ranks)

    versions = Table(title="versions")
    versions.add_column("package")
    versions.add_column("version")
    for package in report["ranks"][0]["versions"]:
        seen = sorted({info["versions"].get(package, "?") for info in report["ranks"]})
        versions.add_row(package, escape(seen[0] if len(seen) == 1 else "MISMATCH: " + ", ".join(seen)))
    console.print(versions)

    checks = Table(title="checks")
    checks.add_column("check")
    checks.add_column("result")
    checks.add_column("detail")
    for check in report["checks"]:
        verdict = "[green]pass[/green]" if check["ok"] else "[red]FAIL[/red]"
        checks.add_row(check["name"], verdict, escape(check["detail"]))
    console.print(checks)


def build_report(infos: Sequence[Mapping[str, Any]], live: Sequence[Mapping[str, Any]], backend: str) -> dict[str, Any]:
    """Combines the gathered infos and live results into the report rank 0 prints and saves.

    Args:
        infos: One :func:`collect_rank_info` dict per rank.
        live: One :func:`run_live_checks` dict per rank.
        backend: Process-group backend.

    Returns:
        The report: ``ok``, ``world_size``, ``backend``, ``ranks``, ``live``, ``checks`` and ``problems``.
    """
    problems = check_consistency(infos)
    checks: list[dict[str, Any]] = [
        {"name": "consistency", "ok": not problems, "detail": "; ".join(problems) or "ranks agree"}
    ]

    bad_reduce = [r for r in live if not r["all_reduce"]["ok"]]
    reduce_ms = max(r["all_reduce"]["ms"] for r in live)
    for r in bad_reduce:
        result = r["all_reduce"]
        problems.append(f"all_reduce on rank {r['rank']}: expected {result['expected']}, got {result['got']}")
    # Report the slowest rank: a collective is only as fast as its last participant.
    checks.append(
        {
            "name": "all_reduce",
            "ok": not bad_reduce,
            "detail": f"float64 x{ALL_REDUCE_NUMEL}, max {reduce_ms:.2f} ms over ranks",
            "ms": reduce_ms,
        }
    )
    barrier_ms = max(r["barrier"]["ms"] for r in live)
    checks.append({"name": "barrier", "ok": True, "detail": f"max {barrier_ms:.2f} ms over ranks", "ms": barrier_ms})
    return {
        "ok": not problems,
        "world_size": len(infos),
        "backend": backend,
        "ranks": sorted(infos, key=lambda info: info["rank"]),
        "live": sorted(live, key=lambda r: r["rank"]),
        "checks": checks,
        "problems": problems,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(prog="python -m lit_ppl.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="process-group backend (default: nccl with CUDA, else gloo)")
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="rendezvous/collective timeout in seconds (default: 60)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the gathered report here (rank 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the doctor on this rank.

    Args:
        argv: Command-line arguments; ``None`` means ``sys.argv[1:]``.

    Returns:
        0 if every check passed on every rank, 1 otherwise.
    """
    args = parse_args(argv)
    try:
        env = resolve_dist_env(os.environ)
    except DistEnvError as err:
        print(f"FAILED: launch environment: {err}", file=sys.stderr)
        return 1
    backend = args.backend or _default_backend()

    stage = "init_process_group"
    try:
        device = _init_process_group(env, backend, args.timeout_s)
        stage = "collect"
        info = collect_rank_info(env, backend)
        stage = "all_gather_object"
        infos = _gather(info, env.world_size)
        stage = "all_reduce/barrier"
        live = _gather(run_live_checks(env, device), env.world_size)
    except Exception as err:
        # Print on every rank: the rank that broke may not be rank 0.
        where = f"{env.launcher} rank {env.rank}/{env.world_size}"
        if env.master_addr is not None:
            where += f" via {env.master_addr}:{env.master_port}"
        print(f"FAILED: {stage} on {where}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

    # Every rank builds the same report from the same gathered data, so all exit codes agree.
    report = build_report(infos, live, backend)
    if env.rank == 0:
        print_report(report)
        if args.json is not None:
            write_text_atomic(args.json, json.dumps(report, indent=2) + "\n")
        if report["ok"]:
            reduce_ms, barrier_ms = report["checks"][1]["ms"], report["checks"][2]["ms"]
            print(
                f"OK: {report['world_size']} rank(s), backend {backend}, "
                f"all_reduce {reduce_ms:.2f} ms, barrier {barrier_ms:.2f} ms"
            )
        else:
            for problem in report["problems"]:
                print(f"FAILED: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
