"""One evaluation from a composed config: preflight, build, validate, write the results; and how a run ends.

The Hydra entry (:mod:`lit_ppl.validate`), the Lightning CLI (:mod:`lit_ppl.cli`) and :mod:`lit_ppl.fetch` call
into this module, which holds everything that imports torch and Lightning, so that ``--help`` and ``--cfg job``
never do. :func:`exit_for` is the one mapping from an exception to the line and exit code every entry reports.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from lit_ppl import errors
from lit_ppl.data.datamodule import PerplexityDataModule
from lit_ppl.errors import first_line
from lit_ppl.evaluation.agreement import AgreementCheck
from lit_ppl.evaluation.compare import CompareModule, SavedCompareModule
from lit_ppl.evaluation.module import PerplexityModule
from lit_ppl.evaluation.outputs import TokenOutputs
from lit_ppl.evaluation.pages import ReportSample
from lit_ppl.evaluation.reference import saving_run, store_lock
from lit_ppl.evaluation.resume import ResumeCallback
from lit_ppl.evaluation.trainer import build_trainer
from lit_ppl.parallel.ranks import peer_failure, rank
from lit_ppl.parallel.strategies import join_launched_ranks
from lit_ppl.preflight import Plan, preflight
from lit_ppl.quant.quantizer import build as build_quantizer
from lit_ppl.report import loggers
from lit_ppl.report.progress import TokensPerSecondBar
from lit_ppl.report.results import build_results, write_hydra_files, write_per_document
from lit_ppl.report.summary import print_compare_table, print_results_table
from lit_ppl.runtime.files import write_json_atomic
from lit_ppl.runtime.lock import first_process, run_lock
from lit_ppl.runtime.threads import set_cpu_threads, use_deterministic_kernels

# What an entry reports as one line without a traceback (lit_ppl.errors.USER_ERRORS), and Lightning's word for a
# bad precision, accelerator or device count.
USER_ERRORS = (*errors.USER_ERRORS, MisconfigurationException)


def evaluate(cfg: DictConfig, plan: Plan | None = None) -> dict[str, Any]:
    """Run one evaluation described by ``cfg`` (``plan``: its :func:`lit_ppl.preflight.preflight`, if the entry
    checked it already); return ``results.json``'s content (on every rank)."""
    plan = plan or preflight(cfg)
    holder = first_process()
    # Two runs into one output_dir, or two into one saved reference, would race each other's files.
    with run_lock(plan.output_dir, holder), store_lock(plan.cfg.save_reference, holder):
        if holder:
            write_hydra_files(plan.output_dir, cfg)
        return _evaluate(plan)


def _evaluate(plan: Plan) -> dict[str, Any]:
    run = plan.cfg
    logger = loggers.build(run.logger, plan.config)  # before the model loads: a missing package fails in a second
    L.seed_everything(run.seed, verbose=False)
    set_cpu_threads(str(run.trainer["accelerator"]), plan.devices, plan.deterministic)
    use_deterministic_kernels(plan.deterministic)
    datamodule = build_datamodule(plan)
    # The token store, before Lightning starts the process group: ranks that wait while another process tokenizes
    # a large corpus then wait on its progress, not inside a collective with a fixed timeout.
    datamodule.prepare_data()
    module = build_module(plan, datamodule)
    callbacks = build_callbacks(plan, logger)
    trainer = build_trainer(
        run.trainer, plan.layout, run.precision, run.distributed.timeout_s, module, callbacks, logger
    )
    trainer.validate(module, datamodule=datamodule, verbose=False)
    results = build_results(module.result, module.result_fields(), run_facts(plan, trainer, datamodule), plan.config)
    if trainer.is_global_zero:
        write_outputs(plan, results, module)
    loggers.log_final(trainer, plan.config, results, module.steps)
    join_launched_ranks(trainer.strategy, run.distributed.timeout_s)
    return results


def build_callbacks(plan: Plan, logger: Any) -> list[L.Callback]:
    """The progress bar, the ranks' agreement check, resume (unless ``resume.enabled=false``), the logger's rate."""
    callbacks: list[L.Callback] = [TokensPerSecondBar(), AgreementCheck(plan.agreement())]
    resume = plan.cfg.resume
    if resume.enabled:
        directory = plan.output_dir / "progress"
        callbacks.append(
            ResumeCallback(directory, plan.progress_config(), plan.batch, resume.save_every, resume.check_every)
        )
    if logger:
        callbacks.append(loggers.TokensPerSecondLogger())  # after ResumeCallback: it counts from restored progress
    return callbacks


def build_datamodule(plan: Plan) -> PerplexityDataModule:
    """The windows of ``plan.data`` under the run's eval mode, served by the plan's batches."""
    ev = plan.cfg.eval
    return PerplexityDataModule(
        plan.data,
        plan.model.tokenizer(),
        mode=ev.mode,
        seq_len=ev.seq_len,
        stride=ev.stride,
        limits=plan.limits,
        deterministic=ev.deterministic,
        timeout_s=plan.cfg.distributed.timeout_s,
        layout=plan.layout,
        plan=plan.batch,
    )


def build_module(plan: Plan, datamodule: PerplexityDataModule) -> PerplexityModule:
    """A :class:`SavedCompareModule` for ``compare.reference.store``, a :class:`CompareModule` for a live
    ``compare.reference``, else a :class:`PerplexityModule`; each with the run's per-token files
    (``report.per_token``, ``save_reference``)."""
    run = plan.cfg
    # Calibrated methods tokenize their text now, like the evaluated text, which theirs must not be.
    timeout, split = run.distributed.timeout_s, plan.layout.sharded
    quantizer = build_quantizer(plan.quant, datamodule.tokenizer, datamodule.spec, timeout, plan.model, split)
    outputs = None
    if run.report.per_token or run.save_reference:
        save = Path(run.save_reference).expanduser() if run.save_reference else None
        identity = (plan.model_identity, run.precision, plan.quant, plan.model.stored_quantization()) if save else None
        saving = saving_run(plan.model.path, *identity) if identity else None
        per_token = plan.output_dir if run.report.per_token else None
        outputs = TokenOutputs(per_token, save, saving, run.compare.noise_floor)
    options = {
        "chunk_size": plan.chunk_size,
        "precision": plan.precision,
        "layout": plan.layout,
        "quantize": quantizer,
        "timeout_s": timeout,
        "compile_decoder": run.compile,
        "deterministic": plan.deterministic,
        "breakdown": plan.breakdown,
        "outputs": outputs,
        "report_sample": ReportSample() if run.report.html else None,
    }
    compared = {**options, "noise_floor": run.compare.noise_floor}
    store = run.compare.reference.get("store") if isinstance(run.compare.reference, dict) else None
    if store:
        return SavedCompareModule(plan.model, str(Path(store).expanduser()), **compared)
    ref = plan.reference
    if ref is None:
        return PerplexityModule(plan.model, **options)
    ref_quantizer = build_quantizer(ref.quant, model=ref.model, split=split)
    return CompareModule(plan.model, ref.model, reference_quantize=ref_quantizer, reference_dtype=ref.dtype, **compared)


def run_facts(plan: Plan, trainer: L.Trainer, datamodule: PerplexityDataModule) -> dict[str, Any]:
    """What ``results.json`` says of how the run ran: its windows, layout, batch plan and precision."""
    run, batch = plan.cfg, plan.batch
    return {
        "mode": run.eval.mode,
        "seq_len": run.eval.seq_len,
        "stride": run.eval.stride if run.eval.mode == "sliding" else None,  # the other modes have none
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "strategy": run.strategy.name,
        "parallel": plan.layout.describe(),
        "batch_size": batch.batch_size,  # the resolved number under batch_size=auto
        "deterministic": plan.deterministic,
        "balance": {
            "mode": batch.balance,
            "rank_weights": batch.rank_weights,
            "measured_tokens_per_s": batch.measured_tokens_per_s,
        },
        "precision": run.precision,
        "chunk_size": plan.chunk_size,  # the resolved number under eval.chunk_size=auto
        "model": plan.model.path,
        "model_identity": plan.model_identity,
        "data": datamodule.describe(),
    }


def write_outputs(plan: Plan, results: dict[str, Any], module: PerplexityModule) -> None:
    """Rank 0: ``results.json`` (atomically), the optional per-document table and plot, and the summary table."""
    out, report = plan.output_dir, plan.cfg.report
    path = write_json_atomic(out / "results.json", results)
    auto = (results.get("quant") or {}).get("auto")
    if auto:
        from lit_ppl.quant.auto.policy import POLICY_FILE, write_policy

        print(f"quant=auto policy: {write_policy(out / POLICY_FILE, auto)}")
    if report.per_document and module.per_document is not None:
        table = write_per_document(out / f"per_document.{report.per_document}", *module.per_document)
        print(f"per-document table: {table}")
    if report.plots and results.get("nll_by_position"):
        from lit_ppl.report.plots import plot_nll_by_position

        plot_nll_by_position(results["nll_by_position"], out / "nll_by_position.png")
    print_results_table(results)
    if results.get("compare"):
        print_compare_table(results["compare"])
    if report.html:
        from lit_ppl.report.html import write_run_page

        print(f"report: {write_run_page(out / 'report.html', results, module.report_text)}")
    if module.spec.is_builtin:
        print(
            "note: the built-in model has random weights, so its perplexity is near its vocabulary size (258); "
            "model=demo data=alice evaluates a real one (README: Two commands)."
        )
    print(f"results: {path}")


def exit_for(err: BaseException) -> tuple[str, int]:
    """The one line and exit code with which every entry reports ``err``; a bug's traceback is printed first."""
    import torch.distributed as dist

    found = errors.input_error(err)
    if found is not None:
        return found
    if isinstance(err, dist.DistNetworkError | dist.DistStoreError):
        # Raised while the ranks find each other (TCPStore): nothing ran yet, no peer "died".
        return f"lit-ppl: error: rank {rank()}: could not reach the other ranks at start-up: {first_line(err)}", 1
    if peer_failure(err):
        # A collective failed because a peer went away: one line per surviving rank, not a page of C++.
        return f"lit-ppl: error: rank {rank()}: a collective failed, another rank probably died: {first_line(err)}", 1
    traceback.print_exception(err)
    return (
        f"lit-ppl: internal error: {type(err).__name__}: {first_line(err)} — not a problem lit-ppl found in "
        "the input; a bug in lit-ppl or a library it calls: please report it with the traceback above"
    ), 1
