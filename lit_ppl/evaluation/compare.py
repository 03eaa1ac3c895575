"""Compare a candidate model with a reference token by token: llama.cpp's KL-divergence report, distributed.

:class:`CompareModule` runs both models, each placed by :func:`lit_ppl.model.placement.place` (``compare.reference``
names the reference, checked by :func:`lit_ppl.preflight.resolve_reference`); :class:`SavedCompareModule` reads a
reference saved once (``compare=saved``, :mod:`lit_ppl.evaluation.saved_reference`). Both feed the per-token values of
:func:`lit_ppl.metrics.kl.token_stats` into :class:`lit_ppl.metrics.kl.KLDivergence`, and report the reference's
noise floor (:mod:`lit_ppl.evaluation.noise_floor`): measured on the live reference, read from the store for a saved
one.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lit_ppl.config.quant import CompareConfig
from lit_ppl.errors import LitPplError
from lit_ppl.evaluation.module import PerplexityModule
from lit_ppl.evaluation.noise_floor import Reference, measure, not_measured, reference_context
from lit_ppl.evaluation.reference import store_keys
from lit_ppl.evaluation.saved_reference import SavedReference, StoredHead, vocab_rows
from lit_ppl.metrics.kl import KLDivergence, token_stats
from lit_ppl.metrics.kl_blocks import widest
from lit_ppl.model.placement import place, place_head
from lit_ppl.model.scorer import CHECK_TOLERANCE, CHECK_TOLERANCE_16BIT, TokenScorer, check_scorer, logit_transform
from lit_ppl.model.spec import ModelSpec
from lit_ppl.quant.quantizer import Quantizer
from lit_ppl.runtime.memory import map_large_blocks


class KLModule(PerplexityModule):
    """:class:`PerplexityModule` that also compares the candidate with a reference on every scored token.

    Subclasses give the reference's side of each batch as ``reference_stats(batch, hidden, scorer)``, called inside the
    candidate's forward with its scored hidden states; this class accumulates
    :class:`KLDivergence`'s statistics (``compare_result``) from inside the candidate's forward, with the candidate's
    hidden states and head. Under tensor parallelism both heads give the same vocabulary slice and the statistics are
    sums over the slices (:func:`lit_ppl.metrics.kl.token_stats`).

    ``noise_floor``: windows re-scored in float64 for the reference's noise floor (0: off), reported as
    ``results.json["compare"]["noise_floor"]`` (``None`` when off; its keys: :mod:`lit_ppl.evaluation.noise_floor`).
    """

    def __init__(self, model: ModelSpec, noise_floor: int = CompareConfig.noise_floor, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.kl = KLDivergence(exact=self.deterministic)
        self.compare_result: dict[str, Any] = {}
        self.noise_windows, self.noise_floor = noise_floor, None

    def on_validation_start(self) -> None:
        if self.device.type == "cpu":
            map_large_blocks()  # the chunks' logits would fragment the heap by gigabytes over a few steps
        super().on_validation_start()

    def stats(
        self,
        hidden: Tensor,
        targets: Tensor,
        scorer: TokenScorer,
        hidden_base: Tensor,
        head_base: Any,
        lockstep: Any = None,
        blocks_base: Any = None,
    ) -> Any:
        """:func:`token_stats` of the candidate (``scorer``'s head) against a reference's hidden states and head
        (``lockstep``: the reference's, when its head is held by rows and the candidate's is not). Where both heads
        are held by blocks of rows (``blocks_base``: the reference's), the statistics stream over them, each chunk
        as many positions as whole rows of ``chunk_size`` would cost: every block is gathered once a chunk."""
        group = scorer.tp.group if scorer.tp is not None else None
        start = int(getattr(scorer.head_module, "vocab_start", 0))
        chunk, blocks = self.chunk_size, None
        if scorer.head_blocks is not None and blocks_base is not None:
            blocks = (scorer.head_blocks, blocks_base)
            vocab = scorer.head_module.weight.shape[0]
            chunk = max(chunk, chunk * vocab // max(widest(b, vocab) for b in blocks))
        return token_stats(
            hidden,
            hidden_base,
            targets,
            scorer.head,
            head_base,
            chunk,
            self._base_context,
            group,
            start,
            scorer.lockstep or lockstep,
            blocks,
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
        return {**super().result_fields(), "compare": {**self.compare_result, "noise_floor": self.noise_floor}}


class CompareModule(KLModule):
    """A :class:`KLModule` whose reference is a second model, run on every batch.

    The candidate (``model`` + ``quantize``) gives the usual perplexity result. The reference is placed by the
    same call (:func:`lit_ppl.model.placement.place`): quantized, split and sharded like the candidate.

    Args:
        model: the candidate model.
        reference: the reference model (same tokenizer and vocabulary: checked by :mod:`lit_ppl.preflight`).
        reference_quantize: the reference's :class:`~lit_ppl.quant.quantizer.Quantizer` (or ``None``).
        reference_dtype: the reference's weight dtype (``None``: the run's precision); under a mixed
            precision the reference then runs with autocast off, so it really computes in that dtype.
        kwargs: as for :class:`PerplexityModule` (``chunk_size``, ``layout``, ...), for both models.
    """

    def __init__(
        self,
        model: ModelSpec,
        reference: ModelSpec,
        reference_quantize: Quantizer | None = None,
        reference_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.ref_spec, self.ref_quantize, self.ref_dtype = reference, reference_quantize, reference_dtype
        self.reference: TokenScorer | None = None  # built by the same pipeline as the candidate
        self.reference_report: Any = None

    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        super().configure_model()  # the candidate, then the reference, through the one placement
        dtype = self.ref_dtype or self.precision.weights
        self.reference, self.reference_report = place(self.ref_spec, self.placement, dtype, self.ref_quantize)

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
            head, lockstep, blocks = reference.head, reference.lockstep, reference.head_blocks
            return self.stats(hidden, batch["targets"], scorer, hidden_base, head, lockstep, blocks)

        ids, index, targets = batch["input_ids"], batch["score_index"], batch["targets"]
        return self.reference(ids, index, targets, then=compare, context=self._base_context)

    def holds_quantized_weights(self) -> bool:
        return super().holds_quantized_weights() or self.ref_quantize is not None

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # the peers checked and the metrics synced first; not in the run's seconds
        self.noise_floor = self.measure_noise_floor()  # collective: every rank

    def measure_noise_floor(self) -> dict[str, Any] | None:
        """The live reference's noise floor (:func:`lit_ppl.evaluation.noise_floor.measure`)."""
        if self.noise_windows <= 0:
            return None
        if self.ref_quantize is not None or self.ref_spec.stored_quantization() is not None:
            return not_measured("the reference is quantized: a float64 re-score would measure its quantization")
        precision = self.precision.name
        if self.ref_dtype is not None:
            precision += f", reference {str(self.ref_dtype).removeprefix('torch.')}"
        context = reference_context(self, self._base_context)
        return measure(self, Reference(self.ref_spec, self.reference, context, precision), self.noise_windows)

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
        self.stored_lockstep: Any = None  # the group calling the stored head in step, where it is held by rows
        self.stored_blocks: Any = None  # its blocks of rows, where it is held by rows (kl_blocks streams over them)
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
        rows = vocab_rows(self.scorer)
        head = self.saved.head(rows, self.scorer.head_module if rows is None else None)
        own = head.linear is self.scorer.head_module
        if not own:  # the model's own head is placed already
            head.linear, self.stored_lockstep = place_head(head.linear, self.placement, self.scorer.lm)
        self.stored_head, self.stored_blocks = head, head.blocks()
        if own and (head.scale, head.cap) == logit_transform(self.scorer.lm.config):
            self.stored_blocks = self.scorer.head_blocks  # the model's own blocks: each gathered once for both sides

    def reference_stats(self, batch: dict[str, Any], hidden: Tensor, scorer: TokenScorer) -> dict[str, Tensor]:
        assert self.saved is not None and self.stored_head is not None
        hidden_base, nll_saved = self.saved.read(batch, hidden.device)
        head = self.stored_head
        sharded = hasattr(head.linear, "unshard")  # its own FSDP root, called inside the candidate's: gathered by hand
        if sharded:
            head.linear.unshard()
        try:
            base = hidden_base.to(head.weight.dtype)
            stats = self.stats(hidden, batch["targets"], scorer, base, head, self.stored_lockstep, self.stored_blocks)
        finally:
            if sharded:
                head.linear.reshard()
        if not self._checked and nll_saved.numel():
            self._check(stats["nll_base"], nll_saved)
        return stats

    def result_fields(self) -> dict[str, Any]:
        """The candidate's fields, the comparison's statistics and which reference they were measured against."""
        assert self.saved is not None
        manifest = self.saved.manifest
        source = {k: manifest.get(k) for k in ("model", "dtype", "quant")}
        shared = self.stored_head is not None and self.stored_head.linear is self.scorer.head_module
        source = {"store": self.store_dir, **source, "head": "the model's own" if shared else "stored"}
        return {**super().result_fields(), "reference_store": source}

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.noise_floor = self.stored_noise_floor()

    def stored_noise_floor(self) -> dict[str, Any] | None:
        """The noise floor the saving run measured on its live model, as its manifest holds it."""
        assert self.saved is not None
        if self.noise_windows <= 0:
            return None
        stored = self.saved.manifest.get("noise_floor")
        if not isinstance(stored, dict):
            return not_measured("the store holds none: saved with compare.noise_floor=0, or by an older lit-ppl")
        return {**stored, "source": "saved"} if stored.get("kld_mean") is not None else stored

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
