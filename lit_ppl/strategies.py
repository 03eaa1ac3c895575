"""Lightning strategies for evaluation, each with the timeout that keeps a dead rank from hanging the rest.

* ``auto`` — one process (one device); with several, ``ddp``.
* ``ddp`` — the model replicated in every process.
* ``fsdp`` — FSDP2 (``fully_shard`` on every decoder block, then the root) over all ranks, through
  Lightning's ``ModelParallelStrategy`` with ``data_parallel_size=world`` and ``tensor_parallel_size=1``
  (its ``"auto"`` defaults would mean tensor parallelism on 2 devices). Lightning's ``FSDPStrategy``
  refuses CPU; FSDP2 runs on CPU with gloo.
* ``hsdp`` — FSDP2 on a 2D mesh: replicate across nodes, shard within a node.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch import nn

STRATEGIES = ("auto", "ddp", "fsdp", "hsdp")
DEFAULT_THREADS = torch.get_num_threads()  # at import: one per core unless OMP_NUM_THREADS says otherwise
Shard = Callable[[nn.Module, L.LightningModule], None]


def decoder_blocks(lm: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: Hugging Face names their classes in ``_no_split_modules``."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    blocks = [m for m in lm.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(lm).__name__} declares no _no_split_modules; cannot find its decoder blocks")
    return blocks


def shard_fsdp2(scorer: nn.Module, module: L.LightningModule, hybrid: bool = False) -> None:
    """``fully_shard`` every decoder block, then the scorer (whose root holds embeddings, norm and head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hybrid:
        nodes = module.trainer.num_nodes
        world = module.trainer.world_size
        # Dim 0 replicates across nodes, dim 1 shards within a node: all-gathers stay on the fast links.
        mesh = init_device_mesh(module.device.type, (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = module.device_mesh["data_parallel"]
    # torchao's quantized tensors do not support the ops FSDP2 shards with (aten.split): they stay
    # replicated on every rank.
    report = getattr(module, "quant_report", None)
    names = set(report.quantized_params) if report is not None else set()
    ignored = {p for n, p in scorer.lm.named_parameters() if n in names}
    for block in decoder_blocks(scorer.lm):
        fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)
    fully_shard(scorer, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)


def precision_args(name: str, precision: str, accelerator: str) -> dict:
    """Trainer keyword arguments that select ``precision`` under strategy ``name``.

    Lightning refuses ``64-true`` and ``16-mixed`` with ``ModelParallelStrategy`` by a flag check only; given as
    plugin instances they work with FSDP2 (float64 weights are loaded as such, autocast wraps the step).
    """
    if name not in ("fsdp", "hsdp") or precision not in ("64-true", "16-mixed", "64"):
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
        raise ValueError(
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


def check_deterministic(batch_size: int | str, compile_decoder: bool) -> None:
    """What deterministic mode cannot promise the same bits for, refused before anything loads."""
    if batch_size == "auto":
        raise ValueError(
            "batch_size=auto with eval.deterministic=true: the probed size can differ between machines and world "
            "sizes, and a window's batch decides its bits; give a number"
        )
    if compile_decoder:
        raise ValueError(
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


def build(name: str, timeout_s: float, devices: int, num_nodes: int) -> tuple[Strategy | str, Shard | None]:
    """The Lightning strategy for ``name`` and the function that shards the model for it (or ``None``)."""
    timeout = timedelta(seconds=timeout_s)
    world = devices * num_nodes
    if name == "auto" and world == 1:
        return "auto", None
    if name in ("auto", "ddp"):  # auto on several processes: replicate, as Lightning's "auto" would
        return DDPStrategy(timeout=timeout), None
    if name in ("fsdp", "hsdp"):
        if name == "hsdp" and num_nodes < 2:
            raise ValueError("strategy=hsdp replicates across nodes: it needs trainer.num_nodes >= 2")
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timeout)
        return strategy, partial(shard_fsdp2, hybrid=name == "hsdp")
    raise ValueError(f"strategy={name!r} is not one of {', '.join(STRATEGIES)}")
