"""What one rank knows about itself: host, devices and library versions, as JSON-serialisable data."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from typing import Any

import torch
import torch.distributed as dist

from lit_ppl.doctor.env import DistEnv

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
