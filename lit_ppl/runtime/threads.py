"""CPU threads per rank and PyTorch's deterministic kernels: process-wide settings made once per run."""

from __future__ import annotations

import os

import torch

DEFAULT_THREADS = torch.get_num_threads()  # at import: one per core unless OMP_NUM_THREADS says otherwise


def on_cpu(accelerator: str) -> bool:
    """Whether ``trainer.accelerator`` runs this process on the CPU."""
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def set_cpu_threads(accelerator: str, devices: int, deterministic: bool = False) -> None:
    """On CPU, split the cores between the node's ranks unless ``OMP_NUM_THREADS`` says otherwise.

    More threads than cores slow small matmuls several-fold; in deterministic mode every rank runs one thread
    whatever the world size, since a CPU matmul's bits depend on its thread count (benchmarks/README.md).
    """
    if not on_cpu(accelerator) or "OMP_NUM_THREADS" in os.environ:
        return
    if deterministic:
        torch.set_num_threads(1)
    elif devices > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    else:  # PyTorch's own default (an earlier deterministic run in this process may have changed it)
        torch.set_num_threads(DEFAULT_THREADS)


def use_deterministic_kernels(enabled: bool) -> None:
    """Deterministic mode: PyTorch's deterministic kernels (an op without one raises, naming itself) and cuBLAS's
    fixed-size workspace (its reductions otherwise depend on the workspace split)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
