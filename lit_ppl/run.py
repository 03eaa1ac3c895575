"""One evaluation from a composed config: build the objects, validate, write the results.

The Hydra entry (:mod:`lit_ppl.validate`) and the Lightning CLI (:mod:`lit_ppl.cli`) both call :func:`evaluate`;
this module holds everything that imports torch and Lightning, so that ``--help`` and ``--cfg job`` never do.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from lit_ppl import autobatch, balance, compare, loggers, parallel, quantize, strategies, tensor_parallel
from lit_ppl.data import PerplexityDataModule
from lit_ppl.distributed import RankFailure
from lit_ppl.errors import LitPplError
from lit_ppl.models import ModelSpec
from lit_ppl.module import PerplexityModule
from lit_ppl.progress import TokensPerSecondBar, set_verbose
from lit_ppl.results import (
    build_results,
    print_compare_table,
    print_table,
    write_json_atomic,
    write_per_document,
)
from lit_ppl.resume import ResumeCallback
from lit_ppl.scorer import ScorerMismatchError

# Errors that mean "the input was wrong" or "a peer failed": reported as one line, without a traceback.
USER_ERRORS = (
    LitPplError,  # raised by lit-ppl's own checks only: a ValueError from elsewhere is a bug and keeps its traceback
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
            raise LitPplError(
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
        raise LitPplError(f"output_dir={path!r} is not writable: {err.strerror or err}") from err
    return out


def resolve_layout(cfg: DictConfig, devices: int, num_nodes: int) -> parallel.Layout:
    """The rank layout of ``cfg.parallel`` (its values set by the ``strategy`` preset), checked against the world."""
    name = cfg.strategy.name
    if name not in strategies.STRATEGIES:
        raise LitPplError(f"strategy={name!r} is not one of {', '.join(strategies.STRATEGIES)}")
    if name == "hsdp" and num_nodes < 2:
        raise LitPplError("strategy=hsdp replicates across nodes: it needs trainer.num_nodes >= 2")
    p = cfg.parallel
    return parallel.resolve(
        p.dp_replicate, p.dp_shard, p.tp, devices * num_nodes, num_nodes, bool(p.get("tp_across_nodes", False))
    )


def build_module(
    compare_cfg: dict[str, Any] | None,
    model: ModelSpec,
    chunk_size: int,
    layout: parallel.Layout | None,
    quantizer: Any,
    **kwargs: Any,
) -> PerplexityModule:
    """A :class:`~lit_ppl.compare.CompareModule` when ``compare.reference`` is set, else a :class:`PerplexityModule`.

    ``quantizer`` quantizes the candidate (:func:`lit_ppl.quantize.build`); ``kwargs`` go to the module's constructor
    unchanged.
    """
    reference = (compare_cfg or {}).get("reference")
    if not reference:
        return PerplexityModule(model, chunk_size=chunk_size, layout=layout, quantize=quantizer, **kwargs)
    spec, ref_quantize, ref_dtype = compare.reference_spec(reference, model)
    return compare.CompareModule(model, spec, chunk_size, layout, quantizer, ref_quantize, ref_dtype, **kwargs)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run one evaluation described by ``cfg``; return ``results.json``'s content (on every rank)."""
    set_verbose(bool(cfg.get("verbose", False)))
    check_targets(cfg)
    check_output_dir(cfg.output_dir)
    logger = loggers.build(cfg)  # before the model loads: a missing package fails in a second, not after loading
    L.seed_everything(cfg.seed, verbose=False)
    deterministic = bool(cfg.eval.deterministic)
    devices, num_nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
    layout = resolve_layout(cfg, devices, num_nodes)
    balance.check(
        cfg.distributed.balance,
        cfg.distributed.weights,
        layout.kind,
        deterministic,
        devices * num_nodes,
        num_nodes,
    )
    strategies.check_devices(str(cfg.trainer.accelerator), int(cfg.trainer.devices))
    strategies.set_cpu_threads(str(cfg.trainer.accelerator), int(cfg.trainer.devices), deterministic)
    if deterministic:
        strategies.check_deterministic(cfg.batch_size, bool(cfg.compile), layout.tp)
    strategies.use_deterministic_kernels(deterministic)
    model_spec = build(cfg.model)
    limits = model_spec.limits()  # reads the checkpoint's config: fails fast on a path that is not a causal LM
    if layout.tp > 1:  # the model's numbers and plan, from its config: before any weights load
        config = model_spec.config()
        layout.check_model(tensor_parallel.widths(config))
        tensor_parallel.check_plan(config)
    quantize.check_layout(OmegaConf.to_container(cfg.quant, resolve=True), layout)
    autobatch.check_layout(cfg.batch_size, layout)
    strategy = strategies.build(layout, cfg.distributed.timeout_s)
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
        layout=layout,
    )
    # The token store, before Lightning starts the process group: ranks that wait while another process
    # tokenizes a large corpus then wait on its progress, not inside a collective with a fixed timeout.
    datamodule.prepare_data()
    # The per-document and per-position sums cost a scatter-add per step: kept only when a report reads them.
    breakdown = bool(cfg.report.per_document) or bool(cfg.report.plots)
    module = build_module(
        OmegaConf.to_container(cfg.compare, resolve=True),
        model_spec,
        cfg.eval.chunk_size,
        layout,
        quantize.build(
            OmegaConf.to_container(cfg.quant, resolve=True),
            datamodule.tokenizer,  # calibrated methods tokenize their text now, like the evaluated text above
            datamodule.spec,  # the evaluated text, which calibration text must not be
            cfg.distributed.timeout_s,
        ),
        timeout_s=cfg.distributed.timeout_s,
        compile_decoder=bool(cfg.compile),
        deterministic=deterministic,
        breakdown=breakdown,
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    callbacks: list[L.Callback] = [TokensPerSecondBar()]
    if cfg.report.per_document not in (None, "csv", "parquet"):
        raise LitPplError(f"report.per_document={cfg.report.per_document!r} is not one of null, csv, parquet")
    if cfg.resume.enabled:
        stable = {k: v for k, v in config.items() if k not in VOLATILE_KEYS}
        stable["data"] = {k: v for k, v in stable["data"].items() if k not in ("cache_dir", "num_proc")}
        # The batch plan is checked as resolved (ResumeCallback): batch_size=auto and the number it resolved to are
        # the same plan, and the autobatch options only decide that number.
        stable.pop("batch_size", None)
        stable.pop("autobatch", None)
        stable["breakdown"] = breakdown  # report.* may change between attempts, but not what the saved states hold
        callbacks.append(
            ResumeCallback(Path(cfg.output_dir) / "progress", stable, cfg.resume.save_every, cfg.resume.check_every)
        )
    if logger:
        callbacks.append(loggers.TokensPerSecondLogger())  # after ResumeCallback: it counts from restored progress
    precision = strategies.precision_args(layout, str(cfg.precision), str(cfg.trainer.accelerator))
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
        # inference_mode skips autograd's per-op bookkeeping (measured on stories260K: 7% of a 1 × 128-token step,
        # nothing measurable at 16 × 512); the numbers are the same either way. no_grad where it cannot be used:
        # torchao's quantized weights cannot be indexed under it ("Cannot set version_counter for inference tensor"),
        # and the split layouts' DTensors stay on the path their tests run (gloo, under which Lightning uses no_grad
        # whatever this says).
        inference_mode=not layout.sharded and module.quantize is None and getattr(module, "ref_quantize", None) is None,
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
        "parallel": layout.describe(),
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
    strategies.join_launched_ranks(trainer.strategy, cfg.distributed.timeout_s)
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
        print_compare_table(results["compare"])
    if module.spec.is_builtin:
        print("note: the built-in model has random weights, so its perplexity is near its vocabulary size (258).")
    print(f"results: {path}")
