"""Lightning strategies for evaluation, each with the timeout that keeps a dead rank from hanging the rest.

The layout (:mod:`lit_ppl.parallel`) decides the strategy:

* one process — Lightning's ``auto``;
* data parallel only (``ddp``) — ``DDPStrategy``: the model replicated in every process;
* anything split (``fsdp``, ``hsdp``, ``tp``, ``fsdp_tp``) — Lightning's ``ModelParallelStrategy`` with
  ``data_parallel_size × tensor_parallel_size`` = the layout's; the module splits and shards the model itself in
  ``configure_model`` (:mod:`lit_ppl.sharding`). Lightning's ``FSDPStrategy`` refuses CPU; FSDP2 runs on CPU with gloo.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from lit_ppl.errors import LitPplError
from lit_ppl.parallel import Layout

STRATEGIES = ("auto", "ddp", "fsdp", "hsdp", "tp", "fsdp_tp")  # the presets under conf/strategy/
DEFAULT_THREADS = torch.get_num_threads()  # at import: one per core unless OMP_NUM_THREADS says otherwise


def precision_args(layout: Layout, precision: str, accelerator: str) -> dict:
    """Trainer keyword arguments that select ``precision`` under ``layout``'s strategy.

    Lightning refuses ``64-true`` and ``16-mixed`` with ``ModelParallelStrategy`` by a flag check only; given as
    plugin instances they work with FSDP2 (float64 weights are loaded as such, autocast wraps the step).
    """
    if not layout.sharded or precision not in ("64-true", "16-mixed", "64"):
        return {"precision": precision}
    from lightning.pytorch.plugins import DoublePrecision, MixedPrecision

    device = (
        "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) else "cpu"
    )
    plugin = DoublePrecision() if precision.startswith("64") else MixedPrecision("16-mixed", device)
    return {"plugins": [plugin]}


def check_devices(accelerator: str, devices: int) -> None:
    """``trainer.devices`` GPUs must exist; Lightning's own message ("No supported gpu backend found!") says less."""
    if accelerator not in ("gpu", "cuda"):
        return  # CPU "devices" are processes: more than the cores is slow but valid
    visible = torch.cuda.device_count()
    if devices > visible:
        raise LitPplError(
            f"trainer.accelerator={accelerator} trainer.devices={devices}, but {visible} CUDA devices are visible "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use trainer.devices<={visible} or "
            "trainer.accelerator=cpu"
        )


def set_cpu_threads(accelerator: str, devices: int, deterministic: bool = False) -> None:
    """On CPU, split the cores between the node's ranks unless ``OMP_NUM_THREADS`` says otherwise.

    Every process defaults to one thread per core: two ranks on two cores then run four threads and small
    matmuls slow down several-fold (measured: 37 µs → 290 µs). In deterministic mode every rank runs one thread
    whatever the world size: a CPU matmul's result can depend on its thread count (measured: one 5 × 77-token
    batch of stories260K differs by up to 5.7e-6 in NLL between 1 and 2 threads).
    """
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if not on_cpu or "OMP_NUM_THREADS" in os.environ:
        return
    if deterministic:
        torch.set_num_threads(1)
    elif devices > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    else:  # PyTorch's own default (an earlier deterministic run in this process may have changed it)
        torch.set_num_threads(DEFAULT_THREADS)


def check_deterministic(batch_size: int | str, compile_decoder: bool, tp: int = 1) -> None:
    """What deterministic mode cannot promise the same bits for, refused before anything loads."""
    if tp > 1:
        raise LitPplError(
            f"parallel.tp={tp} with eval.deterministic=true: tensor parallelism splits every matmul's sum over the "
            "group, so its bits differ from tp=1's (by ~1e-9 relative in PPL); use parallel.tp=1 (ddp, fsdp, hsdp)"
        )
    if batch_size == "auto":
        raise LitPplError(
            "batch_size=auto with eval.deterministic=true: the probed size can differ between machines and world "
            "sizes, and a window's batch decides its bits; give a number"
        )
    if compile_decoder:
        raise LitPplError(
            "compile=true with eval.deterministic=true: the kernels torch.compile generates for a batch shape depend "
            "on the shapes a rank compiled before; use compile=false"
        )


def use_deterministic_kernels(enabled: bool) -> None:
    """Deterministic mode: PyTorch's deterministic kernels (an op without one raises, naming itself) and cuBLAS's
    fixed-size workspace (its reductions otherwise depend on the workspace split)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)


def cluster_plugins() -> list:
    """Under Slurm: Lightning's Slurm environment without its training-checkpoint auto-requeue."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def build(layout: Layout, timeout_s: float) -> Strategy | str:
    """The Lightning strategy for ``layout``."""
    timeout = timedelta(seconds=timeout_s)
    if layout.world_size == 1:
        return "auto"
    if not layout.sharded:
        return DDPStrategy(timeout=timeout)
    return ModelParallelStrategy(data_parallel_size=layout.dp_size, tensor_parallel_size=layout.tp, timeout=timeout)


def join_launched_ranks(strategy: Strategy, timeout_s: float) -> None:
    """Rank 0 returns only once the ranks Lightning launched as its subprocesses have exited.

    Lightning does not wait for them. A rank still tearing down when the next job of an in-process sweep starts
    would find that job's rendezvous on the same ``MASTER_PORT`` (one set by the user stays fixed) and join it;
    and a single run whose rank 1 failed after rank 0 finished would still exit 0.
    """
    import subprocess

    procs = getattr(getattr(strategy, "launcher", None), "procs", None) or []
    for local_rank, proc in enumerate(procs, start=1):
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(
                f"local rank {local_rank} (pid {proc.pid}) was still running {timeout_s:g} s after rank 0 finished "
                "(distributed.timeout_s); killed it"
            ) from None
        if code != 0:
            raise RuntimeError(f"local rank {local_rank} (pid {proc.pid}) exited with code {code}")
