"""The doctor's checks: do the ranks' self-reports agree, and do a live all_reduce and barrier work."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lit_ppl.doctor.env import DistEnv

# Number of elements in the live all_reduce: big enough to be a real transfer, small enough to be
# instant everywhere.
ALL_REDUCE_NUMEL = 1024


def check_consistency(infos: Sequence[Mapping[str, Any]]) -> list[str]:
    """Finds disagreements between the ranks' self-reports.

    Args:
        infos: One :func:`~lit_ppl.doctor.facts.collect_rank_info` dict per process, in any order.

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


def default_backend() -> str:
    """Picks NCCL when a GPU is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def join_process_group(env: DistEnv, backend: str, timeout_s: float) -> torch.device:
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


def gather_all(obj: object, world_size: int) -> list[Any]:
    """All-gathers a picklable object, so that every rank sees every rank's value."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def build_report(infos: Sequence[Mapping[str, Any]], live: Sequence[Mapping[str, Any]], backend: str) -> dict[str, Any]:
    """Combines the gathered infos and live results into the report rank 0 prints and saves.

    Args:
        infos: One :func:`~lit_ppl.doctor.facts.collect_rank_info` dict per rank.
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
