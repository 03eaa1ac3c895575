"""Everything checkable before a weight loads, as one typed :class:`Plan`.

:func:`preflight` converts the composed config to its typed schema once, checks it against the world (ranks,
devices, the model's own config) and builds the small objects every later step reads: the rank layout, the model
and data specs, the batch plan, the quantization node. A run that cannot work stops here, in seconds, with one
line; :func:`lit_ppl.run.evaluate` then only builds and runs.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lit_ppl.config.numbers import progress_keys
from lit_ppl.config.quant import quant_node
from lit_ppl.config.schema import ParallelConfig, ValidateConfig
from lit_ppl.config.targets import check_targets, construct
from lit_ppl.data import autobatch, balance
from lit_ppl.data.batch_plan import BatchPlan
from lit_ppl.data.sources import DataSpec
from lit_ppl.errors import LitPplError
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel import layout as parallel
from lit_ppl.parallel import tensor_parallel
from lit_ppl.quant import apply as quantize


@dataclass
class Plan:
    """One evaluation, checked: what every later step is built from."""

    cfg: ValidateConfig  # the typed config, converted once
    config: dict[str, Any]  # the same, resolved to plain containers: results.json's "config"
    output_dir: Path
    layout: parallel.Layout
    model: ModelSpec
    data: DataSpec
    limits: tuple[int, int | None]  # the model's (vocabulary, positions)
    batch: BatchPlan
    quant: dict[str, Any]  # the quant node with every default (lit_ppl.quant reads it as it is)
    breakdown: bool  # per-document and per-position sums: kept only when a report reads them

    @property
    def deterministic(self) -> bool:
        return self.cfg.eval.deterministic

    def progress_config(self) -> dict[str, Any]:
        """What saved progress must match (:func:`lit_ppl.config.numbers.progress_keys`) and what its states hold."""
        return {**progress_keys(self.config), "breakdown": self.breakdown}


def check_output_dir(path: str) -> Path:
    """Fail before hours of evaluation, not after, if results cannot be written."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise LitPplError(f"output_dir={path!r} is not writable: {err.strerror or err}") from err
    return out


def resolve_layout(name: str, p: ParallelConfig, devices: int, num_nodes: int) -> parallel.Layout:
    """The rank layout of ``parallel`` (its values set by the ``strategy`` preset), checked against the world."""
    if name == "hsdp" and num_nodes < 2:
        raise LitPplError("strategy=hsdp replicates across nodes: it needs trainer.num_nodes >= 2")
    return parallel.resolve(p.dp_replicate, p.dp_shard, p.tp, devices * num_nodes, num_nodes, p.tp_across_nodes)


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


def preflight(cfg: DictConfig) -> Plan:
    """Check ``cfg`` (the schema, the targets, the layout, the model's config) and return the run's :class:`Plan`."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    check_targets(plain)  # the entries checked the whole config already; a config built in Python, its targets
    typed: ValidateConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ValidateConfig), plain))
    out = check_output_dir(typed.output_dir)
    trainer, dist = typed.trainer, typed.distributed
    devices, num_nodes, accelerator = int(trainer["devices"]), int(trainer["num_nodes"]), str(trainer["accelerator"])
    layout = resolve_layout(typed.strategy.name, typed.parallel, devices, num_nodes)
    deterministic = typed.eval.deterministic
    balance.check(dist.balance, dist.weights, layout.kind, deterministic, devices * num_nodes, num_nodes)
    check_devices(accelerator, devices)
    if deterministic:
        check_deterministic(typed.batch_size, typed.compile, layout.tp)
    model = construct(plain["model"])
    limits = model.limits()  # reads the checkpoint's config: fails fast on a path that is not a causal LM
    if layout.tp > 1:  # the model's numbers and plan, from its config: before any weights load
        model_config = model.config()
        layout.check_model(tensor_parallel.widths(model_config))
        tensor_parallel.check_plan(model_config)
    quant = quant_node(plain["quant"])
    quantize.check_layout(quant, layout)
    autobatch.check_layout(typed.batch_size, layout)
    batch = BatchPlan(typed.batch_size, dist.balance, dist.weights, dataclasses.asdict(typed.autobatch))
    breakdown = bool(typed.report.per_document) or typed.report.plots
    return Plan(typed, plain, out, layout, model, construct(plain["data"]), limits, batch, quant, breakdown)
