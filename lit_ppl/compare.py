"""Compare a candidate model with a reference token by token: llama.cpp's KL-divergence report, distributed.

For every scored token both models' log-probabilities over the full vocabulary are computed in float64, one
chunk of positions at a time (never both models' logits for a whole batch), and reduced to per-token values:
the two NLLs, KL(reference ‖ candidate), Δp = p_candidate(target) − p_reference(target), and whether the two
top-1 tokens agree. Sums sync across ranks like the perplexity metric, so means, standard errors and the top-1
agreement are exact. Percentiles come from fixed-size log-spaced histograms (:mod:`lit_ppl.histogram`), within
0.1% (relative) of llama.cpp's exact ones, with the exact min and max: the state is the same few hundred KB
whatever the number of tokens, not 16 bytes per token on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lit_ppl.exact import SumStates
from lit_ppl.histogram import LogBins, percentiles
from lit_ppl.models import ModelSpec
from lit_ppl.module import LOAD_DTYPE, PerplexityModule
from lit_ppl.quantize import build as build_quantize
from lit_ppl.scorer import TokenScorer, check_scorer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUMS = ("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base", "kld", "kld2", "p_diff", "p_diff2", "p_diff4")
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
P_DIFF_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)
# Bins of ratio ≈ 1 + 2e-3 read back within 0.1%. KLD: float64 rounding noise sits near 1e-16, and a KLD of 10^4
# nats means a broken candidate (read back as the exact max). Δp ∈ [−1, 1]: the top bins reach past ±1.
HISTOGRAMS = {
    "kld": LogBins(low=1e-15, high=1e4, alpha=1e-3),
    "p_diff": LogBins(low=1e-15, high=1.0, alpha=1e-3, signed=True),
}


class CompareScorer(TokenScorer):
    """A :class:`TokenScorer` that can also return the hidden states of the scored positions."""

    def forward(self, input_ids: Tensor, score_index: Tensor, targets: Tensor | None = None) -> Tensor:
        if targets is not None:
            return super().forward(input_ids, score_index, targets)
        hidden = self.hidden(input_ids)
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, score_index)  # (n, d)


def token_stats(
    hidden: Tensor,
    hidden_base: Tensor,
    targets: Tensor,
    head: Callable[[Tensor], Tensor],
    head_base: Callable[[Tensor], Tensor],
    chunk_size: int,
    base_context: Callable[[], Any] = contextlib.nullcontext,
) -> dict[str, Tensor]:
    """Per-token NLLs, KL(base ‖ candidate), Δp and top-1 agreement, ``chunk_size`` positions at a time.

    Args:
        hidden: ``(n, d)`` candidate hidden states of the scored positions.
        hidden_base: ``(n, d')`` reference hidden states of the same positions.
        targets: ``(n,)`` target ids.
        head: the candidate's output head; ``head_base`` the reference's.
        chunk_size: positions per chunk: peak extra memory is a few ``chunk_size × vocab`` float64 arrays.
        base_context: context manager the reference head runs in (e.g. autocast disabled).

    Returns:
        ``nll``, ``nll_base``, ``kld``, ``p_diff`` (float64) and ``same_top`` (bool), each ``(n,)``.
    """
    parts: dict[str, list[Tensor]] = {k: [] for k in ("nll", "nll_base", "kld", "p_diff", "same_top")}
    for start in range(0, targets.shape[0], chunk_size):
        end = start + chunk_size
        logq = head(hidden[start:end]).to(torch.float64).log_softmax(-1)
        with base_context():
            logp = head_base(hidden_base[start:end]).to(torch.float64).log_softmax(-1)
        if logq.shape[-1] != logp.shape[-1]:
            raise ValueError(f"the reference's vocabulary has {logp.shape[-1]} entries, the model's {logq.shape[-1]}")
        tgt = targets[start:end, None]
        nll, nll_base = -logq.gather(1, tgt)[:, 0], -logp.gather(1, tgt)[:, 0]
        p = logp.exp()
        # p·(log p − log q) with 0·(−inf) taken as 0: tokens the reference gives no mass add nothing.
        parts["kld"].append(torch.where(p > 0, p * (logp - logq), 0.0).sum(-1))
        parts["nll"].append(nll)
        parts["nll_base"].append(nll_base)
        parts["p_diff"].append(torch.exp(-nll) - torch.exp(-nll_base))
        parts["same_top"].append(logq.argmax(-1) == logp.argmax(-1))
    empty = {"same_top": torch.zeros(0, dtype=torch.bool, device=hidden.device)}
    return {
        k: torch.cat(v) if v else empty.get(k, torch.zeros(0, dtype=torch.float64, device=hidden.device))
        for k, v in parts.items()
    }


def _mean_unc(total: float, total2: float, n: float) -> tuple[float, float]:
    mean = total / n
    return mean, math.sqrt(max(total2 / n - mean * mean, 0.0) / max(n - 1, 1.0))


class KLDivergence(SumStates):
    """llama.cpp's ``--kl-divergence`` statistics over all tokens of all ranks, in states of fixed size.

    Means, standard errors and the top-1 agreement come from float64 sums (exact fixed-point ones under
    ``exact=True``). KLD and Δp percentiles come from int64 histograms (:data:`HISTOGRAMS`, bins of ratio
    ``(1 + 1e-3)/(1 − 1e-3)``) and are within 0.1% (relative) of llama.cpp's exact ones whenever the two sorted
    values they interpolate between have magnitudes in ``[1e-15, 1e4)`` for KLD, ``[1e-15, 1]`` for Δp, and share a
    sign; within 1e-15 (absolute) below that; a KLD past the top bin (≈ 1e4) reads as the exact max; min and max
    are exact (:mod:`lit_ppl.histogram` states the bound in full). The state is 451,488 bytes per rank whatever the
    number of tokens (:meth:`state_bytes`; 56,420 int64 counts), synced by one all-reduce per state; the counts are
    integers, so they are the same at any world size and in any order.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, exact: bool = False, **kwargs: Any) -> None:
        super().__init__(exact=exact, **kwargs)
        for name in SUMS:
            self.add_sum_state(f"sum_{name}")
        for name in ("same_top", "count"):
            self.add_state(name, default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        for name, bins in HISTOGRAMS.items():
            self.add_count_state(f"{name}_counts", bins.size)
            self.add_state(f"{name}_lowest", default=torch.tensor(math.inf, dtype=torch.float64), dist_reduce_fx="min")
            self.add_state(
                f"{name}_highest", default=torch.tensor(-math.inf, dtype=torch.float64), dist_reduce_fx="max"
            )

    def state_bytes(self) -> int:
        """Bytes of every state of this rank: fixed at construction, whatever the number of tokens."""
        return sum(v.numel() * v.element_size() for v in self.metric_state.values())

    def update(self, nll: Tensor, nll_base: Tensor, kld: Tensor, p_diff: Tensor, same_top: Tensor) -> None:
        """Add the per-token values of one batch (from :func:`token_stats`)."""
        d = torch.float64
        nll, nll_base, kld, p_diff = (x.detach().to(d) for x in (nll, nll_base, kld, p_diff))
        for name, value in (
            ("nll", nll),
            ("nll2", nll * nll),
            ("nll_base", nll_base),
            ("nll_base2", nll_base * nll_base),
            ("nll_nll_base", nll * nll_base),
            ("kld", kld),
            ("kld2", kld * kld),
            ("p_diff", p_diff),
            ("p_diff2", p_diff**2),
            ("p_diff4", p_diff**4),
        ):
            self.add_to(f"sum_{name}", value)
        self.same_top += same_top.sum()
        self.count += nll.numel()
        for name, values in (("kld", kld), ("p_diff", p_diff)):
            idx = HISTOGRAMS[name].index(values)
            getattr(self, f"{name}_counts").index_add_(0, idx, torch.ones_like(idx))  # no host sync, unlike bincount
            if values.numel():  # an empty padding batch has no min
                setattr(self, f"{name}_lowest", torch.minimum(getattr(self, f"{name}_lowest"), values.min()))
                setattr(self, f"{name}_highest", torch.maximum(getattr(self, f"{name}_highest"), values.max()))

    def compute(self) -> dict[str, float]:
        """The statistics, named after llama.cpp's report; probabilities as fractions (not %)."""
        n = float(self.count)
        if n == 0:
            raise ValueError("no tokens were compared")
        self.check_range()
        s = {name: float(self.sum_of(f"sum_{name}")) for name in SUMS}
        ln_q, ln_q_unc = _mean_unc(s["nll"], s["nll2"], n)
        ln_b, ln_b_unc = _mean_unc(s["nll_base"], s["nll_base2"], n)
        cov = (s["nll_nll_base"] / n - ln_q * ln_b) / max(n - 1, 1.0)
        ppl, ppl_base = math.exp(ln_q), math.exp(ln_b)
        ln_ratio, ln_ratio_unc = ln_q - ln_b, math.sqrt(max(ln_q_unc**2 + ln_b_unc**2 - 2 * cov, 0.0))
        kld, kld_unc = _mean_unc(s["kld"], s["kld2"], n)
        dp, dp_unc = _mean_unc(s["p_diff"], s["p_diff2"], n)
        mse = s["p_diff2"] / n
        mse_unc = math.sqrt(max(s["p_diff4"] / n - mse * mse, 0.0) / max(n - 1, 1.0))
        rms = math.sqrt(mse)
        top = float(self.same_top) / n
        pct = {}
        for name, wanted in (("kld", KLD_PERCENTILES), ("p_diff", P_DIFF_PERCENTILES)):
            lowest, highest = float(getattr(self, f"{name}_lowest")), float(getattr(self, f"{name}_highest"))
            got = percentiles(HISTOGRAMS[name], getattr(self, f"{name}_counts"), lowest, highest, wanted)
            pct[name] = {"max": highest, **{f"p{p:g}": got[p] for p in wanted}, "min": lowest}
        denom = ln_q_unc * ln_b_unc
        out = {
            "tokens": int(n),
            "ppl": ppl,
            "ppl_unc": ppl * ln_q_unc,
            "ppl_base": ppl_base,
            "ppl_base_unc": ppl_base * ln_b_unc,
            "ln_ppl_correlation": cov / denom if denom > 0 else 1.0,
            "ln_ppl_ratio": ln_ratio,
            "ln_ppl_ratio_unc": ln_ratio_unc,
            "ppl_ratio": math.exp(ln_ratio),
            "ppl_ratio_unc": math.exp(ln_ratio) * ln_ratio_unc,
            "ppl_diff": ppl - ppl_base,
            "ppl_diff_unc": math.sqrt(
                max((ppl * ln_q_unc) ** 2 + (ppl_base * ln_b_unc) ** 2 - 2 * ppl * ppl_base * cov, 0.0)
            ),
            "kld_mean": kld,
            "kld_mean_unc": kld_unc,
            **{f"kld_{k}": v for k, v in pct["kld"].items()},
            "p_diff_mean": dp,
            "p_diff_mean_unc": dp_unc,
            **{f"p_diff_{k}": v for k, v in pct["p_diff"].items()},
            "p_diff_rms": rms,
            "p_diff_rms_unc": 0.5 / rms * mse_unc if rms > 0 else 0.0,
            "same_top": top,
            "same_top_unc": math.sqrt(top * (1 - top) / max(n - 1, 1.0)),
        }
        return out


class CompareModule(PerplexityModule):
    """:class:`PerplexityModule` that also runs a reference model and compares the two on every scored token.

    The candidate (``model`` + ``quantize``) gives the usual perplexity result; ``compare_result`` holds
    :class:`KLDivergence`'s statistics. The reference is quantized, wrapped and sharded like the candidate.

    Args:
        model: the candidate model.
        reference: the reference model (same tokenizer and vocabulary).
        chunk_size: scored positions per output-head chunk, for both models.
        shard: as for :class:`PerplexityModule`; applied to both models.
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
        shard: Any = None,
        quantize: Any = None,
        reference_quantize: Any = None,
        reference_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, chunk_size=chunk_size, shard=shard, quantize=quantize, **kwargs)
        self.ref_spec, self.ref_quantize, self.ref_dtype = reference, reference_quantize, reference_dtype
        self.reference: CompareScorer | None = None
        self.reference_report: Any = None
        self.kl = KLDivergence(exact=self.deterministic)
        self.compare_result: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        dtype = LOAD_DTYPE.get(precision, torch.float32)
        ref_dtype = self.ref_dtype or dtype
        if precision in LOAD_DTYPE and ref_dtype != dtype:
            raise ValueError(
                f"compare.reference.dtype={ref_dtype} cannot hold under precision={precision}, which casts every "
                "weight to its dtype; use a mixed precision (e.g. bf16-mixed) or 32-true for the run"
            )
        lm, ref = self.spec.build(dtype), self.ref_spec.build(ref_dtype)
        self.quant_report = self.quantize(lm) if self.quantize is not None else None
        self.reference_report = self.ref_quantize(ref) if self.ref_quantize is not None else None
        ignore = [f"scorer.lm.{n}" for n in (self.quant_report.quantized_params if self.quant_report else [])]
        ignore += [
            f"reference.lm.{n}" for n in (self.reference_report.quantized_params if self.reference_report else [])
        ]
        self._ddp_params_and_buffers_to_ignore = ignore
        self.scorer, self.reference = CompareScorer(lm, self.chunk_size), CompareScorer(ref, self.chunk_size)
        if self.shard is not None:
            self.shard(self.scorer, self)
            # The shard function reads the ignored (quantized) parameters from ``quant_report``.
            candidate_report, self.quant_report = self.quant_report, self.reference_report
            try:
                self.shard(self.reference, self)
            finally:
                self.quant_report = candidate_report

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
        hidden = self.scorer(ids, index)
        with self._base_context():
            hidden_base = self.reference(ids, index)
        for scorer in (self.scorer, self.reference):
            if hasattr(scorer, "unshard"):  # FSDP2 root: make sure its head is gathered outside forward
                scorer.unshard()
        stats = token_stats(
            hidden, hidden_base, targets, self.scorer.head, self.reference.head, self.chunk_size, self._base_context
        )
        self.kl.update(**stats)
        return stats["nll"]

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.compare_result = self.kl.compute()


def reference_spec(reference: str | dict[str, Any], model: ModelSpec) -> tuple[ModelSpec, Any, torch.dtype | None]:
    """``(spec, quantize callable, dtype)`` of ``compare.reference``: a path, or ``{path, dtype, quant}``."""
    ref = {"path": reference} if isinstance(reference, str) else dict(reference)
    path = ref.get("path") or model.path
    spec = dataclasses.replace(model, path=path) if path != model.path else model
    dtype = ref.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"compare.reference.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if spec is not model and (
        spec.limits()[0] != model.limits()[0] or spec.tokenizer().fingerprint != model.tokenizer().fingerprint
    ):
        raise ValueError(f"the reference {path} has another tokenizer or vocabulary than {model.path}")
    return spec, build_quantize(ref.get("quant") or {"name": "none"}), DTYPES.get(dtype) if dtype else None


def build_module(
    compare: dict[str, Any] | None, model: ModelSpec, chunk_size: int, shard: Any, quantize: Any, **kwargs: Any
) -> PerplexityModule:
    """A :class:`CompareModule` when ``compare.reference`` is set, else a plain :class:`PerplexityModule`.

    ``kwargs`` go to the module's constructor unchanged.
    """
    reference = (compare or {}).get("reference")
    if not reference:
        return PerplexityModule(model, chunk_size=chunk_size, shard=shard, quantize=quantize, **kwargs)
    spec, ref_quantize, ref_dtype = reference_spec(reference, model)
    return CompareModule(model, spec, chunk_size, shard, quantize, ref_quantize, ref_dtype, **kwargs)


def extra_results(module: PerplexityModule) -> dict[str, Any]:
    """What ``results.json`` gains: the quantization report(s) and, when comparing, the statistics."""
    out: dict[str, Any] = {"quant": module.quant_report.to_dict() if module.quant_report is not None else None}
    if isinstance(module, CompareModule):
        ref = module.reference_report
        out["reference_quant"] = ref.to_dict() if ref is not None else None
        out["compare"] = module.compare_result
    return out


def print_table(compare: dict[str, Any]) -> None:
    """Print llama.cpp-style headline statistics of a comparison."""
    from rich.console import Console
    from rich.table import Table

    c = compare
    table = Table(title=f"candidate vs reference · {c['tokens']:,} tokens")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    rows = [
        ("PPL(Q) · PPL(base)", f"{c['ppl']:.6f} ± {c['ppl_unc']:.6f} · {c['ppl_base']:.6f} ± {c['ppl_base_unc']:.6f}"),
        ("Cor(ln PPL(Q), ln PPL(base))", f"{100 * c['ln_ppl_correlation']:.2f}%"),
        ("PPL(Q)/PPL(base)", f"{c['ppl_ratio']:.6f} ± {c['ppl_ratio_unc']:.6f}"),
        ("mean KLD", f"{c['kld_mean']:.6f} ± {c['kld_mean_unc']:.6f}"),
        (
            "KLD max · 99% · median · min",
            f"{c['kld_max']:.6f} · {c['kld_p99']:.6f} · {c['kld_p50']:.6f} · {c['kld_min']:.6f}",
        ),
        ("mean Δp · RMS Δp", f"{100 * c['p_diff_mean']:.3f}% · {100 * c['p_diff_rms']:.3f}%"),
        ("same top-1", f"{100 * c['same_top']:.3f} ± {100 * c['same_top_unc']:.3f}%"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
