"""Lightning strategies for evaluation, each with the timeout that keeps a dead rank from hanging the rest.

The layout (:mod:`lit_ppl.parallel.layout`) decides the strategy:

* one process — Lightning's ``auto``;
* data parallel only (``ddp``) — ``DDPStrategy``: the model replicated in every process;
* anything split (``fsdp``, ``hsdp``, ``tp``, ``fsdp_tp``) — Lightning's ``ModelParallelStrategy`` with
  ``data_parallel_size × tensor_parallel_size`` = the layout's; the module splits and shards the model itself in
  ``configure_model`` (:mod:`lit_ppl.parallel.sharding`). Lightning's ``FSDPStrategy`` refuses CPU; FSDP2 runs on CPU
  with gloo.
"""

from __future__ import annotations

from datetime import timedelta

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from lit_ppl.parallel.layout import Layout
from lit_ppl.runtime.precision import device_type


def precision_args(layout: Layout, precision: str, accelerator: str) -> dict:
    """Trainer keyword arguments that select ``precision`` under ``layout``'s strategy.

    Lightning refuses ``64-true`` and ``16-mixed`` with ``ModelParallelStrategy`` by a flag check only; given as
    plugin instances they work with FSDP2 (float64 weights are loaded as such, autocast wraps the step).
    """
    if not layout.sharded or precision not in ("64-true", "16-mixed", "64"):
        return {"precision": precision}
    from lightning.pytorch.plugins import DoublePrecision, MixedPrecision

    plugin = DoublePrecision() if precision.startswith("64") else MixedPrecision("16-mixed", device_type(accelerator))
    return {"plugins": [plugin]}


def cluster_plugins() -> list:
    """Under Slurm: Lightning's Slurm environment without its training-checkpoint auto-requeue."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def strategy_for(layout: Layout, timeout_s: float) -> Strategy | str:
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
