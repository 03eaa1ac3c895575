"""Compare a candidate model with a reference token by token: llama.cpp's KL-divergence report, distributed.

:class:`CompareModule` runs both models, each built by :class:`PerplexityModule`'s one pipeline
(``compare.reference`` names the reference: :func:`reference_spec`); :class:`SavedCompareModule` reads a reference
saved once (``compare=saved``, :mod:`lit_ppl.evaluation.reference`). Both feed the per-token values of
:func:`lit_ppl.metrics.kl.token_stats` into :class:`lit_ppl.metrics.kl.KLDivergence`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lit_ppl.config.values import REFERENCE_DTYPES
from lit_ppl.errors import LitPplError
from lit_ppl.evaluation.module import LOAD_DTYPE, PerplexityModule
from lit_ppl.evaluation.reference import store_keys
from lit_ppl.evaluation.saved_reference import SavedReference, StoredHead, vocab_rows
from lit_ppl.metrics.kl import KLDivergence, token_stats
from lit_ppl.model.scorer import CHECK_TOLERANCE, CHECK_TOLERANCE_16BIT, TokenScorer, check_scorer
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel.layout import Layout
from lit_ppl.parallel.sharding import fsdp_mesh
from lit_ppl.quant.quantizer import Quantizer
from lit_ppl.quant.quantizer import build as build_quantizer

DTYPES = {name: getattr(torch, name) for name in REFERENCE_DTYPES}


class KLModule(PerplexityModule):
    """:class:`PerplexityModule` that also compares the candidate with a reference on every scored token.

    Subclasses give the reference's side of each batch as ``reference_stats(batch, hidden, scorer)``, called inside the
    candidate's forward with its scored hidden states; this class accumulates
    :class:`KLDivergence`'s statistics (``compare_result``) from inside the candidate's forward, with the candidate's
    hidden states and head. Under tensor parallelism both heads give the same vocabulary slice and the statistics are
    sums over the slices (:func:`lit_ppl.metrics.kl.token_stats`).
    """

    def __init__(self, model: ModelSpec, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.kl = KLDivergence(exact=self.deterministic)
        self.compare_result: dict[str, Any] = {}

    def stats(self, hidden: Tensor, targets: Tensor, scorer: TokenScorer, hidden_base: Tensor, head_base: Any) -> Any:
        """:func:`token_stats` of the candidate (``scorer``'s head) against a reference's hidden states and head."""
        group = scorer.tp.group if scorer.tp is not None else None
        start = int(getattr(scorer.head_module, "vocab_start", 0))
        return token_stats(
            hidden, hidden_base, targets, scorer.head, head_base, self.chunk_size, self._base_context, group, start
        )

    def _base_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def score(self, batch: dict[str, Any]) -> Tensor:
        stats = self.scorer(
            batch["input_ids"], batch["score_index"], batch["targets"], then=partial(self.reference_stats, batch)
        )
        if self.accumulate:  # a tensor-parallel group's ranks hold the same statistics: its first counts them
            self.kl.update(**stats)
        self._extra = {"kld": stats["kld"], "nll_base": stats["nll_base"]}
        return stats["nll"]

    def sample_fields(self) -> tuple[str, ...]:
        return (*super().sample_fields(), "kld", "nll_base")

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.compare_result = self.kl.compute()

    def result_fields(self) -> dict[str, Any]:
        return {**super().result_fields(), "compare": self.compare_result}


class CompareModule(KLModule):
    """A :class:`KLModule` whose reference is a second model, run on every batch.

    The candidate (``model`` + ``quantize``) gives the usual perplexity result. The reference is built by
    :class:`PerplexityModule`'s one pipeline, quantized, split and sharded like the candidate.

    Args:
        model: the candidate model.
        reference: the reference model (same tokenizer and vocabulary).
        chunk_size: scored positions per output-head chunk, for both models.
        layout: as for :class:`PerplexityModule`; both models are built, split and sharded alike.
        quantize: the candidate's quantization callable (or ``None``).
        reference_quantize: the reference's quantization callable (or ``None``).
        reference_dtype: the reference's weight dtype (``None``: the run's precision); under a mixed
            precision the reference then runs with autocast off, so it really computes in that dtype.
    """

    def __init__(
        self,
        model: ModelSpec,
        reference: ModelSpec,
        chunk_size: int = 1024,
        layout: Layout | None = None,
        quantize: Any = None,
        reference_quantize: Any = None,
        reference_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, chunk_size=chunk_size, layout=layout, quantize=quantize, **kwargs)
        self.ref_spec, self.ref_quantize, self.ref_dtype = reference, reference_quantize, reference_dtype
        self.reference: TokenScorer | None = None  # built by the same pipeline as the candidate
        self.reference_report: Any = None

    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        dtype = LOAD_DTYPE.get(precision, torch.float32)
        ref_dtype = self.ref_dtype or dtype
        if precision in LOAD_DTYPE and ref_dtype != dtype:
            raise LitPplError(
                f"compare.reference.dtype={ref_dtype} cannot hold under precision={precision}, which casts every "
                "weight to its dtype; use a mixed precision (e.g. bf16-mixed) or 32-true for the run"
            )
        super().configure_model()  # the candidate, through the one build pipeline
        self.reference, self.reference_report = self.build_scorer(self.ref_spec, self.ref_quantize, ref_dtype)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        with self._base_context():
            check_scorer(self.reference, self.device)  # the reference's path must be its model's too

    def _base_context(self) -> contextlib.AbstractContextManager:
        if self.ref_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, enabled=False)

    def reference_stats(self, batch: dict[str, Any], hidden: Tensor, scorer: TokenScorer) -> dict[str, Tensor]:
        # Inside the candidate's forward; the reference's forward nests in it, so both heads are gathered.
        def compare(hidden_base: Tensor, reference: TokenScorer) -> dict[str, Tensor]:
            return self.stats(hidden, batch["targets"], scorer, hidden_base, reference.head)

        ids, index, targets = batch["input_ids"], batch["score_index"], batch["targets"]
        return self.reference(ids, index, targets, then=compare, context=self._base_context)

    def holds_quantized_weights(self) -> bool:
        return super().holds_quantized_weights() or self.ref_quantize is not None

    def result_fields(self) -> dict[str, Any]:
        """The candidate's fields, the reference's quantization and the comparison's statistics."""
        ref = self.reference_report
        return {**super().result_fields(), "reference_quant": ref.to_dict() if ref is not None else None}


class SavedCompareModule(KLModule):
    """A :class:`KLModule` whose reference is a saved store (``compare=saved``): its hidden states are read for each
    batch's tokens and its head applied, so no reference model is loaded. Under tensor parallelism each rank keeps its
    vocabulary slice of the stored head; under FSDP the head is sharded like the candidate's."""

    def __init__(self, model: ModelSpec, store: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.store_dir = store
        self.saved: SavedReference | None = None
        self.stored_head: StoredHead | None = None
        self._checked = False

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.saved is None:
            dm = self.trainer.datamodule
            self.saved = SavedReference(self.store_dir, store_keys(dm), dm.first_token)

    def configure_model(self) -> None:
        if self.stored_head is not None:
            return
        super().configure_model()
        assert self.saved is not None and self.scorer is not None
        head = self.saved.head(vocab_rows(self.scorer)).to(self.device)
        dp_mesh = fsdp_mesh(self.mesh, self.layout) if self.layout is not None and self.layout.sharded else None
        if dp_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(head, mesh=dp_mesh, reshard_after_forward=False)  # gathered once per batch, then resharded
        self.stored_head = head

    def reference_stats(self, batch: dict[str, Any], hidden: Tensor, scorer: TokenScorer) -> dict[str, Tensor]:
        assert self.saved is not None and self.stored_head is not None
        hidden_base, nll_saved = self.saved.read(batch, hidden.device)
        head = self.stored_head
        sharded = hasattr(head, "unshard")  # its own FSDP root, called inside the candidate's: gathered by hand
        if sharded:
            head.unshard()
        try:
            stats = self.stats(hidden, batch["targets"], scorer, hidden_base.to(head.weight.dtype), head)
        finally:
            if sharded:
                head.reshard()
        if not self._checked and nll_saved.numel():
            self._check(stats["nll_base"], nll_saved)
        return stats

    def result_fields(self) -> dict[str, Any]:
        """The candidate's fields, the comparison's statistics and which reference they were measured against."""
        assert self.saved is not None
        manifest = self.saved.manifest
        source = {k: manifest.get(k) for k in ("model", "dtype", "quant")}
        source = {"store": self.store_dir, **source}
        return {**super().result_fields(), "reference_store": source}

    def _check(self, nll_base: Tensor, nll_saved: Tensor) -> None:
        """The stored head on the stored hidden states must give the NLLs the saving run scored (first batch)."""
        self._checked = True
        tolerance = CHECK_TOLERANCE.get(self.saved.dtype, CHECK_TOLERANCE_16BIT)
        gap = float((nll_base - nll_saved).abs().max())
        if not gap <= tolerance:
            raise LitPplError(
                f"compare.reference.store={self.store_dir!r}: its head and hidden states give NLLs {gap:.3g} away "
                f"from the ones it saved (tolerance {tolerance:g}): the store is damaged"
            )


def reference_spec(
    reference: str | dict[str, Any], model: ModelSpec, split: bool = False
) -> tuple[ModelSpec, Quantizer | None, torch.dtype | None]:
    """``(spec, quantizer, dtype)`` of ``compare.reference``: a path, or ``{path, dtype, quant}`` (``split``: the
    layout splits the model, so a reference stored quantized is restored as stored)."""
    ref = {"path": reference} if isinstance(reference, str) else dict(reference)
    path = ref.get("path") or model.path
    # gguf_file is the candidate's file, not the reference's (a reference FILE.gguf sets its own from its path).
    spec = dataclasses.replace(model, path=path, gguf_file=None) if path != model.path else model
    if spec is model and model.stored_quantization() is not None:  # else: the stored model against itself, KL 0
        raise LitPplError(
            f"model.path={model.path!r} is stored quantized ({model.stored_quantization()['name']}): it has no "
            "unquantized version to compare with; set compare.reference.path=the float checkpoint"
        )
    dtype = ref.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise LitPplError(f"compare.reference.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if spec is not model and (
        spec.limits()[0] != model.limits()[0] or spec.tokenizer().fingerprint != model.tokenizer().fingerprint
    ):
        raise LitPplError(f"the reference {path} has another tokenizer or vocabulary than {model.path}")
    quantizer = build_quantizer(ref.get("quant") or {"name": "none"}, model=spec, split=split)
    return spec, quantizer, DTYPES.get(dtype) if dtype else None
