"""Evaluate a causal LM's perplexity: compose the Hydra config, build the objects, validate, report.

Single process (the offline default: a built-in random model on a text shipped with the package)::

    python -m lit_ppl.validate
    python -m lit_ppl.validate model.path=/ckpt/llama-3-8b data=wikitext2 precision=bf16-true

Several processes on one machine (Lightning launches them)::

    python -m lit_ppl.validate strategy=ddp trainer.devices=4

Several nodes (torchrun on each node, or srun: see slurm/)::

    torchrun --nnodes 2 --node_rank K --nproc_per_node 8 --master_addr HOST --master_port 29500 \\
        -m lit_ppl.validate strategy=fsdp trainer.num_nodes=2 trainer.devices=8
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from lit_ppl import balance, compare, loggers, quantize, strategies
from lit_ppl.data import PerplexityDataModule
from lit_ppl.distributed import RankFailure, first_line, rank
from lit_ppl.module import PerplexityModule
from lit_ppl.progress import TokensPerSecondBar, set_verbose
from lit_ppl.results import build_results, print_table, write_json_atomic, write_per_document
from lit_ppl.resume import EXIT_PREEMPTED, Preempted, ResumeCallback, install_signal_handlers, requeue_if_slurm
from lit_ppl.scorer import ScorerMismatchError

# Errors that mean "the input was wrong" or "a peer failed": reported as one line, without a traceback.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    FloatingPointError,
    RankFailure,
    quantize.RankMismatchError,  # ranks quantized differently: the message names the modules
    ScorerMismatchError,  # an architecture whose logits lit-ppl's head path does not reproduce
    MisconfigurationException,  # Lightning's word for a bad precision, accelerator or device count
    loggers.MissingPackageError,  # logger=mlflow etc. without its package: the line names the extra
)


def conf_dir() -> str:
    """The Hydra config tree: ``conf/`` in a source checkout, ``lit_ppl/conf`` once installed."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "validate.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no conf/validate.yaml next to {here}; reinstall lit-ppl")


# Keys that may change between attempts of the same run without changing its numbers.
VOLATILE_KEYS = ("output_dir", "distributed", "resume", "report")


def build(node: DictConfig) -> Any:
    """``instantiate``, but a bad value reported by the class itself surfaces as its own one-line error."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        if isinstance(err.__cause__, USER_ERRORS):
            raise err.__cause__ from None
        raise


def check_targets(cfg: DictConfig) -> None:
    """Only lit-ppl's own classes are instantiated from config, unless ``allow_any_target=true``.

    A ``_target_`` is an import and a call: from an untrusted override it would run arbitrary code.
    """
    if cfg.get("allow_any_target", False):
        return
    for group in ("model", "data"):
        target = OmegaConf.select(cfg, f"{group}._target_")
        if target is not None and not str(target).startswith("lit_ppl."):
            raise ValueError(
                f"{group}._target_={target!r} is not a lit_ppl class; set allow_any_target=true to instantiate it"
            )


def check_output_dir(path: str) -> Path:
    """Fail before hours of evaluation, not after, if results cannot be written."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ValueError(f"output_dir={path!r} is not writable: {err.strerror or err}") from err
    return out


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run one evaluation described by ``cfg``; return ``results.json``'s content (on every rank)."""
    set_verbose(bool(cfg.get("verbose", False)))
    check_targets(cfg)
    check_output_dir(cfg.output_dir)
    logger = loggers.build(cfg)  # before the model loads: a missing package fails in a second, not after loading
    L.seed_everything(cfg.seed, verbose=False)
    deterministic = bool(cfg.eval.deterministic)
    devices, num_nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
    balance.check(
        cfg.distributed.balance,
        cfg.distributed.weights,
        cfg.strategy.name,
        deterministic,
        devices * num_nodes,
        num_nodes,
    )
    strategies.check_devices(str(cfg.trainer.accelerator), int(cfg.trainer.devices))
    strategies.set_cpu_threads(str(cfg.trainer.accelerator), int(cfg.trainer.devices), deterministic)
    if deterministic:
        strategies.check_deterministic(cfg.batch_size, bool(cfg.compile))
    strategies.use_deterministic_kernels(deterministic)
    model_spec = build(cfg.model)
    limits = model_spec.limits()  # reads the checkpoint's config: fails fast on a path that is not a causal LM
    strategy, shard = strategies.build(cfg.strategy.name, cfg.distributed.timeout_s, devices, num_nodes)
    datamodule = PerplexityDataModule(
        build(cfg.data),
        model_spec.tokenizer(),
        mode=cfg.eval.mode,
        seq_len=cfg.eval.seq_len,
        stride=cfg.eval.stride,
        batch_size=cfg.batch_size,
        limits=limits,
        autobatch=OmegaConf.to_container(cfg.autobatch, resolve=True),
        deterministic=deterministic,
        balance=cfg.distributed.balance,
        weights=list(cfg.distributed.weights) if cfg.distributed.weights else None,
        timeout_s=cfg.distributed.timeout_s,
    )
    # The token store, before Lightning starts the process group: ranks that wait while another process
    # tokenizes a large corpus then wait on its progress, not inside a collective with a fixed timeout.
    datamodule.prepare_data()
    module = compare.build_module(
        OmegaConf.to_container(cfg.compare, resolve=True),
        model_spec,
        cfg.eval.chunk_size,
        shard,
        quantize.build(
            OmegaConf.to_container(cfg.quant, resolve=True),
            datamodule.tokenizer,  # calibrated methods tokenize their text now, like the evaluated text above
            datamodule.spec,  # the evaluated text, which calibration text must not be
            cfg.distributed.timeout_s,
        ),
        timeout_s=cfg.distributed.timeout_s,
        compile_decoder=bool(cfg.compile),
        deterministic=deterministic,
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    callbacks: list[L.Callback] = [TokensPerSecondBar()]
    if cfg.report.per_document not in (None, "csv", "parquet"):
        raise ValueError(f"report.per_document={cfg.report.per_document!r} is not one of null, csv, parquet")
    if cfg.resume.enabled:
        stable = {k: v for k, v in config.items() if k not in VOLATILE_KEYS}
        stable["data"] = {k: v for k, v in stable["data"].items() if k not in ("cache_dir", "num_proc")}
        callbacks.append(
            ResumeCallback(Path(cfg.output_dir) / "progress", stable, cfg.resume.save_every, cfg.resume.check_every)
        )
    if logger:
        callbacks.append(loggers.TokensPerSecondLogger())  # after ResumeCallback: it counts from restored progress
    precision = strategies.precision_args(cfg.strategy.name, str(cfg.precision), str(cfg.trainer.accelerator))
    # Under Slurm, Lightning's own SIGUSR1 handler would save a training checkpoint and requeue;
    # lit-ppl saves its progress and requeues itself (lit_ppl.resume).
    plugins = [*precision.pop("plugins", []), *strategies.cluster_plugins()]
    trainer = L.Trainer(
        **cfg.trainer,
        strategy=strategy,
        **precision,
        plugins=plugins or None,
        logger=logger,
        callbacks=callbacks,
        use_distributed_sampler=False,  # ours is exact: Lightning's repeats samples to even out ranks
        # no_grad, not inference_mode: torchao's quantized expert weights cannot be indexed under inference
        # mode ("Cannot set version_counter for inference tensor"); the numbers are the same either way.
        inference_mode=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.validate(module, datamodule=datamodule, verbose=False)
    run = {
        "mode": cfg.eval.mode,
        "seq_len": cfg.eval.seq_len,
        "stride": cfg.eval.stride,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "strategy": cfg.strategy.name,
        "batch_size": datamodule.batch_size,  # the resolved number under batch_size=auto
        "deterministic": deterministic,
        "balance": {
            "mode": cfg.distributed.balance,
            "rank_weights": datamodule.rank_weights,
            "measured_tokens_per_s": datamodule.measured_tokens_per_s,
        },
        "precision": str(cfg.precision),
        "model": model_spec.path,
        "data": datamodule.describe(),
    }
    results = build_results(module.result, run, config)
    results.update(compare.extra_results(module))  # "quant", and "reference_quant"/"compare" when comparing
    if trainer.is_global_zero:
        write_outputs(cfg, results, module)
    loggers.log_final(trainer, config, results, module.steps)
    return results


def write_outputs(cfg: DictConfig, results: dict[str, Any], module: PerplexityModule) -> None:
    """Rank 0: ``results.json`` (atomically), the optional per-document table and plot, and the summary table."""
    out = Path(cfg.output_dir)
    path = write_json_atomic(out / "results.json", results)
    if cfg.report.per_document and module.per_document is not None:
        table = write_per_document(out / f"per_document.{cfg.report.per_document}", *module.per_document)
        print(f"per-document table: {table}")
    if cfg.report.plots and results.get("nll_by_position"):
        from lit_ppl.plots import plot_nll_by_position

        plot_nll_by_position(results["nll_by_position"], out / "nll_by_position.png")
    print_table(results)
    if results.get("compare"):
        compare.print_table(results["compare"])
    if module.spec.is_builtin:
        print("note: the built-in model has random weights, so its perplexity is near its vocabulary size (258).")
    print(f"results: {path}")


def _fail(message: str, code: int) -> None:
    print(message, file=sys.stderr)
    # In a -m sweep, sys.exit would end the whole sweep: fail this job only (the summary marks it).
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise RuntimeError(message)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="validate")
def main(cfg: DictConfig) -> None:
    install_signal_handlers()
    try:
        evaluate(cfg)
    except Preempted as err:
        requeue_if_slurm()
        _fail(f"lit-ppl: {err}", EXIT_PREEMPTED)
    except USER_ERRORS as err:
        _fail(f"lit-ppl: error: {err}", 1)
    except torch.distributed.DistError as err:
        # A collective failed because a peer went away: one line per surviving rank, not a page of C++.
        _fail(f"lit-ppl: error: rank {rank()}: a collective failed, another rank probably died: {first_line(err)}", 1)


if __name__ == "__main__":
    main()
