"""Compare a candidate model with a reference token by token: llama.cpp's KL-divergence report, distributed.

:class:`CompareModule` runs both models, each built by :class:`PerplexityModule`'s one pipeline, and feeds the
per-token values of :func:`lit_ppl.metrics.kl.token_stats` into :class:`lit_ppl.metrics.kl.KLDivergence`;
``compare.reference``
names the reference (:func:`reference_spec`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lit_ppl.config.values import REFERENCE_DTYPES
from lit_ppl.errors import LitPplError
from lit_ppl.evaluation.module import LOAD_DTYPE, PerplexityModule
from lit_ppl.metrics.kl import KLDivergence, token_stats
from lit_ppl.model.scorer import TokenScorer, check_scorer
from lit_ppl.model.spec import ModelSpec
from lit_ppl.parallel.layout import Layout
from lit_ppl.quant.apply import build as build_quantize

DTYPES = {name: getattr(torch, name) for name in REFERENCE_DTYPES}


# What a scorer's forward hands its scored hidden states ``(n, d)`` and its head to (see CompareScorer).
Then = Callable[[Tensor, Callable[[Tensor], Tensor]], Any]


class CompareScorer(TokenScorer):
    """A :class:`TokenScorer` whose forward can hand its scored hidden states and its head to ``then``.

    The comparison needs both models' heads at once. Run inside each scorer's own forward, both FSDP2 roots
    (embeddings, final norm, head) are gathered by FSDP's pre-forward hooks and resharded by its post-forward
    hooks, as in a plain step: no ``unshard()`` by hand, which gathered each root a second time every step and
    left it gathered between steps.
    """

    def forward(
        self,
        input_ids: Tensor,
        score_index: Tensor,
        targets: Tensor,
        then: Then | None = None,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> Any:
        """The per-token NLL, or with ``then``: ``then(hidden states of the scored positions, head)``.

        ``context`` wraps the decoder (e.g. autocast off for a reference of another dtype); ``then`` runs outside
        it, so that it can choose the context of each head itself.
        """
        if then is None:
            return super().forward(input_ids, score_index, targets)
        with context():
            hidden = self.hidden(input_ids)
            scored = hidden.reshape(-1, hidden.shape[-1]).index_select(0, score_index)  # (n, d)
        return then(scored, self.head)


class CompareModule(PerplexityModule):
    """:class:`PerplexityModule` that also runs a reference model and compares the two on every scored token.

    The candidate (``model`` + ``quantize``) gives the usual perplexity result; ``compare_result`` holds
    :class:`KLDivergence`'s statistics. The reference is quantized, wrapped and sharded like the candidate.

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

    scorer_cls = CompareScorer

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
        self.reference: CompareScorer | None = None  # built by the same pipeline as the candidate
        self.reference_report: Any = None
        self.kl = KLDivergence(exact=self.deterministic)
        self.compare_result: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        if self.layout is not None and self.layout.tp > 1:
            raise LitPplError(
                f"compare.reference with parallel.tp={self.layout.tp}: the KL divergence needs both models' full "
                "vocabulary per token, which tensor parallelism splits; use parallel.tp=1 (e.g. strategy=fsdp)"
            )
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

    def score(self, batch: dict[str, Any]) -> Tensor:
        ids, index, targets = batch["input_ids"], batch["score_index"], batch["targets"]

        def candidate(hidden: Tensor, head: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
            # Inside the candidate's forward; the reference's forward nests in it, so both heads are gathered.
            def reference(hidden_base: Tensor, head_base: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
                return token_stats(hidden, hidden_base, targets, head, head_base, self.chunk_size, self._base_context)

            return self.reference(ids, index, targets, then=reference, context=self._base_context)

        stats = self.scorer(ids, index, targets, then=candidate)
        self.kl.update(**stats)
        return stats["nll"]

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.compare_result = self.kl.compute()

    def holds_quantized_weights(self) -> bool:
        return super().holds_quantized_weights() or self.ref_quantize is not None

    def result_fields(self) -> dict[str, Any]:
        """The candidate's fields, the reference's quantization and the comparison's statistics."""
        ref = self.reference_report
        return {
            **super().result_fields(),
            "reference_quant": ref.to_dict() if ref is not None else None,
            "compare": self.compare_result,
        }


def reference_spec(reference: str | dict[str, Any], model: ModelSpec) -> tuple[ModelSpec, Any, torch.dtype | None]:
    """``(spec, quantize callable, dtype)`` of ``compare.reference``: a path, or ``{path, dtype, quant}``."""
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
    return spec, build_quantize(ref.get("quant") or {"name": "none"}), DTYPES.get(dtype) if dtype else None
