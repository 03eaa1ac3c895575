"""The LightningModule: score every batch's tokens, accumulate them in the float64 metric, sync once."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torchmetrics import Metric

from lit_ppl.config.schema import DistributedConfig, ValidateConfig
from lit_ppl.data.batch_plan import ScorerProbe
from lit_ppl.evaluation.outputs import TokenOutputs, per_document
from lit_ppl.evaluation.pages import ReportSample
from lit_ppl.metrics.perplexity import NLLBreakdown, Perplexity
from lit_ppl.model.placement import Placement, place, weight_bytes
from lit_ppl.model.scorer import TokenScorer, check_scorer
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel.layout import Layout
from lit_ppl.parallel.ranks import check_peers, control_group
from lit_ppl.quant.quantizer import Quantizer
from lit_ppl.runtime.memory import keep_freed_memory_in_heap, rank_memory, rank_peak_memory
from lit_ppl.runtime.precision import Precision


def _to_host(value: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return [v.detach().cpu().clone() for v in value]


class PerplexityModule(L.LightningModule):
    """Evaluates a causal LM's perplexity in ``trainer.validate``.

    Args:
        model: which LM to load; it is built in ``configure_model`` so that it can be split as it loads
            (:func:`lit_ppl.model.placement.place`).
        chunk_size: scored positions per output-head chunk (bounds the logits memory).
        precision: the run's precision (the weights' dtype; ``None``: the schema's default).
        layout: how the ranks split the model and the data (:mod:`lit_ppl.parallel.layout`); ``None``: one process.
        quantize: the :class:`~lit_ppl.quant.quantizer.Quantizer` applied once the model holds its weights (each
            rank's tensor-parallel slices) and before FSDP shards it, or ``None``; its report's ``quantized_params``
            (names in ``lm``) are kept out of DDP/FSDP wrapping, whose hooks cannot handle torchao's tensors.
        timeout_s: how long the final synchronisation waits for every rank before naming the missing ones.
        compile_decoder: ``torch.compile`` the decoder (:mod:`lit_ppl.model.compiling`).
        deterministic: accumulate in exact fixed-point sums (:mod:`lit_ppl.metrics.exact`), the same at any world size.
        breakdown: also sum the NLL per document and per window position (:class:`NLLBreakdown`: ``per_document``
            and ``result["nll_by_position"]``); off, the step loop skips its scatter-adds.
        outputs: per-token files (:mod:`lit_ppl.evaluation.outputs`), or ``None``.
        report_sample: the tokens ``report.html`` shows (:mod:`lit_ppl.evaluation.pages`), or ``None``.
    """

    def __init__(
        self,
        model: ModelSpec,
        chunk_size: int,
        precision: Precision | None = None,
        layout: Layout | None = None,
        quantize: Quantizer | None = None,
        timeout_s: float = DistributedConfig.timeout_s,
        compile_decoder: bool = False,
        deterministic: bool = False,
        breakdown: bool = False,
        outputs: TokenOutputs | None = None,
        report_sample: ReportSample | None = None,
    ) -> None:
        super().__init__()
        self.report_sample, self.sample_metric, self.report_text = report_sample, None, None
        self._extra: dict[str, torch.Tensor] = {}  # a step's values beside the NLL that the sample keeps
        self.outputs = outputs  # per-token files (report.per_token, save_reference), written in corpus order
        self._hidden: torch.Tensor | None = None  # the step's scored hidden states, when save_reference keeps them
        self.output_files: dict[str, Any] = {}  # rank 0: where the per-token files went (results.json)
        self.deterministic, self.want_breakdown, self.compile_decoder = deterministic, breakdown, compile_decoder
        self.spec, self.chunk_size, self.layout, self.quantize = model, chunk_size, layout, quantize
        self.precision = precision or Precision.of(ValidateConfig.precision)
        self.placement: Placement | None = None  # where the run's models go, decided once in configure_model
        self.accumulate = True  # False on tensor-parallel ranks other than the first: their NLLs are its copies
        self.timeout_s, self.quant_report, self.scorer = timeout_s, None, None
        self.metric = Perplexity(exact=deterministic)
        self.breakdown: NLLBreakdown | None = None  # with breakdown=True: sized in setup(), once the corpus is known
        self.per_document: tuple[torch.Tensor, torch.Tensor] | None = None  # (tokens, nll sum) per document
        self.result, self.scorer_check = {}, {}  # results.json's figures; the scoring path's self-check
        self.tokens_seen, self.steps = 0, 0  # host-side count for tokens/s: from shapes, no device sync

    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        broadcast = self.trainer.strategy.broadcast if self._trainer is not None else lambda obj: obj
        rows = not self.deterministic  # a vocabulary by rows cuts the head's matmul: not one process's bits
        self.placement = Placement(
            self.layout, self.device, self.chunk_size, broadcast, self.compile_decoder, vocab_rows=rows
        )
        if self.placement.split:
            self.accumulate = self.layout.tp_rank(self.global_rank) == 0
        self.scorer, self.quant_report = place(self.spec, self.placement, self.precision.weights, self.quantize)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """All of them: Lightning's DDP would broadcast rank 0's weights at validation start, a copy of every weight
        on each rank (benchmarks/README.md); every rank read the same checkpoint (or drew the same seeded weights),
        and quantized ones are compared by hash (:func:`lit_ppl.quant.consistency.check_ranks_agree`)."""
        names = [n for n, _ in self.named_parameters(remove_duplicate=False)]
        return names + [n for n, _ in self.named_buffers(remove_duplicate=False)]

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if self.outputs is not None and self.outputs.datamodule is None:
            self.outputs.setup(dm)
        if self.report_sample is not None and self.sample_metric is None and getattr(dm, "corpus", None) is not None:
            self.sample_metric = self.report_sample.metric(dm, self.sample_fields())
        if not self.want_breakdown or self.breakdown is not None:
            return
        if dm is not None and getattr(dm, "corpus", None) is not None:
            self.breakdown = NLLBreakdown(len(dm.corpus.doc_lengths), dm.seq_len, exact=self.deterministic)

    def scorer_probe(self) -> ScorerProbe:
        """The built scorer and how this run steps it: what the batch plan times (``batch_size=auto``, a measured
        balance)."""
        trainer = self.trainer
        context = trainer.precision_plugin.val_step_context
        return ScorerProbe(self.scorer, self.spec.path, self.precision.name, self.chunk_size, context, self.device)

    def sample_fields(self) -> tuple[str, ...]:
        """The per-token values ``report.html`` shows (a comparison adds its own)."""
        return ("nll", "target")

    def holds_quantized_weights(self) -> bool:
        """Whether any model of the run gets torchao's weights (which cannot be indexed under inference_mode)."""
        stored = self.spec.stored_quantization()
        return self.quantize is not None or (stored is not None and stored.get("format") == "torchao")

    def result_fields(self) -> dict[str, Any]:
        """What this module contributes to ``results.json`` beside the metric's statistics: its quantization."""
        stored = self.spec.stored_quantization()  # what the checkpoint itself holds (a GGUF's GGML types, ...)
        if self.quant_report is None:
            quant = stored
        elif self.quant_report.source == "checkpoint":  # restored on split layouts: the ranks' agreement with it
            quant = {**stored, "consistency": self.quant_report.consistency}
        else:
            quant = self.quant_report.to_dict() | ({"checkpoint": stored} if stored else {})
        return {"quant": quant, **self.output_files}

    def metrics(self) -> dict[str, Metric]:
        """Every torchmetrics state of the module: what syncs across ranks and what a resume restores."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Metric)}

    def on_validation_start(self) -> None:
        # Precision plugins cast the whole module, metric states included; restore float64.
        for metric in self.metrics().values():
            metric.set_dtype(torch.float64)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()  # no page faults per step (benchmarks/README.md)
        self._control = control_group()
        self.scorer_check = check_scorer(self.scorer, self.device)
        self._first_bad_step = torch.tensor(-1, device=self.device)
        self._t0 = time.perf_counter()

    def score(self, batch: dict[str, Any]) -> torch.Tensor:
        """Per-token NLL of the batch's scored tokens; subclasses may gather more statistics on the way."""
        if self.outputs is None or not self.outputs.wants_hidden:
            return self.scorer(batch["input_ids"], batch["score_index"], batch["targets"])

        def keep(hidden: torch.Tensor, scorer: TokenScorer) -> torch.Tensor:
            self._hidden = hidden
            return scorer.nll(hidden, batch["targets"])

        return self.scorer(batch["input_ids"], batch["score_index"], batch["targets"], then=keep)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        nll = self.score(batch)
        if self.accumulate:  # else a tensor-parallel copy of the first rank's NLLs: counted there, once
            finite = torch.isfinite(nll)  # once per step: the metric's non-finite count and the first bad step
            self.metric.update(nll, batch["words"], batch["bytes"], batch["documents"], finite=finite)
            if self.breakdown is not None:
                self.breakdown.update(nll, batch["doc_ids"], batch["score_index"] % batch["input_ids"].shape[1])
            # Remember the first step with a non-finite loss without a host sync in the loop.
            bad = ~finite.all()
            self._first_bad_step = torch.where(bad & (self._first_bad_step < 0), batch_idx, self._first_bad_step)
            if self.outputs is not None:
                self.outputs.write(batch, nll, self._hidden)
            if self.sample_metric is not None:
                self.sample_metric.update(batch["token_index"], nll=nll, target=batch["targets"], **self._extra)
        self._hidden = None
        self.tokens_seen += batch["targets"].numel()
        self.steps += 1

    def progress_state(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-identically (host copies; called between steps)."""
        if self.outputs is not None:
            self.outputs.flush()  # the per-token rows written so far: a resumed run rewrites only the later ones
        return {
            "metrics": {
                name: {k: _to_host(v) for k, v in metric.metric_state.items()}
                for name, metric in self.metrics().items()
            },
            "tokens_seen": self.tokens_seen,
            "steps": self.steps,
            "first_bad_step": int(self._first_bad_step),
        }

    def load_progress_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`progress_state` (after the precision plugin and ``set_dtype`` have run)."""
        metrics = self.metrics()
        for name, states in state["metrics"].items():
            for key, value in states.items():
                current = getattr(metrics[name], key)  # every state is a fixed-size tensor
                setattr(metrics[name], key, value.to(device=current.device, dtype=current.dtype))
        self.tokens_seen, self.steps = state["tokens_seen"], state["steps"]
        self._first_bad_step = torch.tensor(state["first_bad_step"], device=self.device)

    def on_validation_epoch_start(self) -> None:  # after the resume callback's: steps restored, or none
        if self.outputs is not None:
            self.outputs.start(self.scorer, self.steps > 0, self.global_rank == 0, self.trainer.strategy)

    def on_validation_epoch_end(self) -> None:
        seconds = time.perf_counter() - self._t0
        t_sync = time.perf_counter()
        check_peers(self._control, self.timeout_s, "the final metric sync")
        stats = self.metric.compute()  # the one cross-rank synchronisation of the metric
        sync_s = time.perf_counter() - t_sync
        mine = [self.tokens_seen, self.steps, int(self._first_bad_step), *rank_peak_memory(self.device)]
        mine.append(weight_bytes(self.scorer))
        per_rank = self.all_gather(torch.tensor(mine, device=self.device)).reshape(-1, 6)
        if int(stats["nonfinite"]) > 0:
            first = {r: int(s) for r, s in enumerate(per_rank[:, 2].tolist()) if s >= 0}
            hint = (
                "the model itself produces them: check its weights"
                if self.precision.full
                else f"the model overflows in precision={self.precision.name}: try 32-true or bf16-mixed"
            )
            raise FloatingPointError(
                f"{int(stats['nonfinite'])} tokens had a NaN/inf loss (first at batch {first} by rank); {hint}"
            )
        self.result = {
            **{k: v.item() for k, v in stats.items() if k != "nonfinite"},
            "seconds": seconds,
            "sync_seconds": sync_s,
            "rank_tokens": per_rank[:, 0].tolist(),
            "rank_steps": per_rank[:, 1].tolist(),
            **rank_memory(per_rank[:, 3].tolist(), per_rank[:, 4].tolist()),
            "rank_weight_bytes": per_rank[:, 5].tolist(),
            "scorer_check": self.scorer_check,
        }
        for k in ("tokens", "words", "bytes", "documents"):
            self.result[k] = round(self.result[k])
        if self.breakdown is not None:
            # Synced like the metric. torchmetrics squeezes a one-element result to 0-d (a one-document corpus):
            # reshape, so that the per-document table still has one row per document.
            parts = {k: v.cpu().reshape(-1) for k, v in self.breakdown.compute().items()}
            self.result["nll_by_position"] = {
                "sum": parts["pos_sum"].tolist(),
                "sum_sq": parts["pos_sum_sq"].tolist(),
                "count": parts["pos_count"].tolist(),
            }
            self.per_document = per_document(parts, self.result["nll_sum"], self.trainer.datamodule)  # checked
        if self.sample_metric is not None:
            values = self.sample_metric.compute()  # synced on every rank; the text is rank 0's to write
            self.report_text = self.report_sample.finish(values) if self.global_rank == 0 else None
        if self.outputs is not None:  # every rank's rows flushed, then checked by rank 0: one verdict for all
            self.output_files = self.outputs.finish(self.result, self.global_rank == 0, self.trainer.strategy)
        self.log_dict({"ppl": stats["ppl"].float(), "nll_mean": stats["nll_mean"].float()}, sync_dist=False)
