"""llama.cpp's KL-divergence statistics of a candidate against a reference, token by token, distributed.

For every scored token both models' log-probabilities over the full vocabulary are computed in float64, one
chunk of positions at a time (never both models' logits for a whole batch), and reduced to per-token values
(:func:`token_stats`): the two NLLs, KL(reference ‖ candidate) and the reverse KL(candidate ‖ reference),
Δp = p_candidate(target) − p_reference(target), whether the two top-1 tokens agree and the reference's top-1
probability. :class:`KLDivergence` sums them like the perplexity metric, so means, standard errors and the top-1
agreement are exact across ranks, and also per bucket of the reference's top-1 probability (exllamav3's qbench:
the mean is dominated by the tokens where the reference is undecided). Percentiles come from fixed-size log-spaced
histograms (:mod:`lit_ppl.metrics.histogram`), within 0.1% (relative) of llama.cpp's exact ones, with the exact min and
max: the state is the same few hundred KB whatever the number of tokens, not 16 bytes per token on every rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lit_ppl.errors import LitPplError
from lit_ppl.metrics.chunks import agreed_chunks
from lit_ppl.metrics.exact import SumStates
from lit_ppl.metrics.histogram import LogBins, coarse, percentiles
from lit_ppl.metrics.kl_blocks import Blocks, streamed_stats
from lit_ppl.metrics.perplexity import mean_stderr

SUMS = (
    "nll",
    "nll2",
    "nll_base",
    "nll_base2",
    "nll_nll_base",
    "kld",
    "kld2",
    "kld_rev",
    "kld_rev2",
    "p_diff",
    "p_diff2",
    "p_diff4",
)
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
P_DIFF_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)
# Bins of ratio ≈ 1 + 2e-3 read back within 0.1%. KLD: float64 rounding noise sits near 1e-16, and a KLD of 10^4
# nats means a broken candidate (read back as the exact max). Δp ∈ [−1, 1]: the top bins reach past ±1.
HISTOGRAMS = {
    "kld": LogBins(low=1e-15, high=1e4, alpha=1e-3),
    "kld_rev": LogBins(low=1e-15, high=1e4, alpha=1e-3),
    "p_diff": LogBins(low=1e-15, high=1.0, alpha=1e-3, signed=True),
}
PERCENTILES = {"kld": KLD_PERCENTILES, "kld_rev": KLD_PERCENTILES, "p_diff": P_DIFF_PERCENTILES}
# The reference's top-1 probability: buckets [0, .25), [.25, .5), [.5, .75), [.75, .95), [.95, 1] (exllamav3's qbench).
TOP_P_EDGES = (0.0, 0.25, 0.5, 0.75, 0.95, 1.0)
STATS = ("nll", "nll_base", "kld", "kld_rev", "p_diff", "same_top", "top_p")


def token_stats(
    hidden: Tensor,
    hidden_base: Tensor,
    targets: Tensor,
    head: Callable[[Tensor], Tensor],
    head_base: Callable[[Tensor], Tensor],
    chunk_size: int,
    base_context: Callable[[], Any] = contextlib.nullcontext,
    vocab_group: Any = None,
    vocab_start: int = 0,
    lockstep: Any = None,
    blocks: tuple[Blocks, Blocks] | None = None,
) -> dict[str, Tensor]:
    """Per-token NLLs, KL(base ‖ candidate) both ways, Δp, top-1 agreement and the base's top-1 probability,
    ``chunk_size`` positions at a time.

    Args:
        hidden: ``(n, d)`` candidate hidden states of the scored positions.
        hidden_base: ``(n, d')`` reference hidden states of the same positions.
        targets: ``(n,)`` target ids.
        head: the candidate's output head; ``head_base`` the reference's.
        chunk_size: positions per chunk: peak extra memory is a few ``chunk_size × vocab`` float64 arrays.
        base_context: context manager the reference head runs in (e.g. autocast disabled).
        vocab_group: under tensor parallelism, the process group over which both heads split the vocabulary (each
            rank's heads give the same slice, starting at ``vocab_start``): every statistic is then a sum, max or min
            over the slices (:func:`_vocab_parallel`), four all-reduces per chunk, never a full row of logits.
        lockstep: as for :func:`lit_ppl.model.nll.chunked_nll` (heads held by FSDP-sharded blocks of rows).
        blocks: both heads as blocks of vocabulary columns (the candidate's, the reference's), in place of ``head``
            and ``head_base``: the statistics stream over them (:func:`lit_ppl.metrics.kl_blocks.streamed_stats`),
            one block of each model's logits at a time.

    Returns:
        ``nll``, ``nll_base``, ``kld`` (KL(base ‖ candidate)), ``kld_rev`` (KL(candidate ‖ base)), ``p_diff``,
        ``top_p`` (the base's largest probability; float64) and ``same_top`` (bool), each ``(n,)``.
    """
    parts: dict[str, list[Tensor]] = {k: [] for k in STATS}
    for k in range(agreed_chunks(targets.shape[0], chunk_size, lockstep, hidden.device)):
        start, end = k * chunk_size, (k + 1) * chunk_size
        tgt = targets[start:end]
        if blocks is not None:
            stats = streamed_stats(hidden[start:end], hidden_base[start:end], tgt, *blocks, base_context)
            _keep(parts, stats)
            continue
        split = vocab_group is not None
        # Whole rows are log-softmaxed as they come: the float64 logits are never held beside their log-softmax.
        q = _float64(head(hidden[start:end]), not split)
        with base_context():
            p = _float64(head_base(hidden_base[start:end]), not split)
        if q.shape[-1] != p.shape[-1]:
            raise LitPplError(f"the reference's vocabulary has {p.shape[-1]} entries, the model's {q.shape[-1]}")
        stats = _vocab_parallel(q, p, tgt, vocab_group, vocab_start) if split else _full_vocab(q, p, tgt)
        del q, p  # else this chunk's rows stay alive while the next chunk's are computed
        _keep(parts, stats)
    empty = {"same_top": torch.zeros(0, dtype=torch.bool, device=hidden.device)}
    return {
        k: torch.cat(v) if v else empty.get(k, torch.zeros(0, dtype=torch.float64, device=hidden.device))
        for k, v in parts.items()
    }


def _keep(parts: dict[str, list[Tensor]], stats: tuple[Tensor, ...]) -> None:
    """Add one chunk's ``(nll, nll_base, kld, kld_rev, same_top, top_p)`` and its Δp to ``parts``."""
    for k, v in zip(("nll", "nll_base", "kld", "kld_rev", "same_top", "top_p"), stats, strict=True):
        parts[k].append(v)
    parts["p_diff"].append(torch.exp(-stats[0]) - torch.exp(-stats[1]))


def _float64(logits: Tensor, log_softmax: bool) -> Tensor:
    return logits.to(torch.float64).log_softmax(-1) if log_softmax else logits.to(torch.float64)


def _kld(logp: Tensor, logq: Tensor) -> Tensor:
    """``Σ p·(log p − log q)`` per row, with ``0·(−inf)`` taken as 0: tokens the reference gives no mass add nothing.
    Two rows-sized float64 temporaries (computed in place)."""
    terms, p = logp - logq, logp.exp()
    terms.mul_(p)
    return terms.masked_fill_(~(p > 0), 0.0).sum(-1)


def _full_vocab(logq: Tensor, logp: Tensor, targets: Tensor) -> tuple[Tensor, ...]:
    tgt = targets[:, None]
    nll, nll_base = -logq.gather(1, tgt)[:, 0], -logp.gather(1, tgt)[:, 0]
    same = logq.argmax(-1) == logp.argmax(-1)
    return nll, nll_base, _kld(logp, logq), _kld(logq, logp), same, logp.amax(-1).exp()


def _vocab_parallel(q: Tensor, p: Tensor, targets: Tensor, group: Any, start: int) -> tuple[Tensor, ...]:
    """:func:`_full_vocab` of logits split over ``group`` by vocabulary: log-sum-exp, the target's logit and KLD as
    sums over the slices, the top-1 token as the first index holding the largest logit (``argmax``'s tie rule), the
    reference's top-1 probability from the reduced largest logit and log-sum-exp."""
    import torch.distributed as dist

    both = torch.stack([q, p])  # (2, m, v): candidate, reference
    maxes = both.amax(-1)  # (2, m)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    local = targets - start
    mine = (local >= 0) & (local < q.shape[-1])
    picked = both.gather(2, local.clamp(0, q.shape[-1] - 1).expand(2, -1)[..., None])[..., 0]
    picked = torch.where(mine, picked, 0.0)
    sums = torch.cat([(both - maxes[..., None]).exp().sum(-1), picked])  # (4, m)
    dist.all_reduce(sums, group=group)
    lse = sums[:2].log() + maxes  # (2, m)
    logq, logp = q - lse[0, :, None], p - lse[1, :, None]
    first = torch.where(both.amax(-1) == maxes, both.argmax(-1) + start, torch.iinfo(torch.int64).max)
    kld = torch.stack([_kld(logp, logq), _kld(logq, logp)])  # both directions in one all-reduce
    dist.all_reduce(kld, group=group)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    nll, nll_base = lse[0] - sums[2], lse[1] - sums[3]
    return nll, nll_base, kld[0], kld[1], first[0] == first[1], (maxes[1] - lse[1]).exp()


class KLDivergence(SumStates):
    """llama.cpp's ``--kl-divergence`` statistics over all tokens of all ranks, in states of fixed size.

    Means, standard errors and the top-1 agreement come from float64 sums (exact fixed-point ones under
    ``exact=True``), overall and per bucket of :data:`TOP_P_EDGES` (token counts, mean KLD both ways, top-1
    agreement: ``kld_by_top_p``). KLD (both ways) and Δp percentiles come from int64 histograms (:data:`HISTOGRAMS`,
    bins of ratio ``(1 + 1e-3)/(1 − 1e-3)``) and are within 0.1% (relative) of llama.cpp's exact ones whenever the
    two sorted values they interpolate between have magnitudes in ``[1e-15, 1e4)`` for KLD, ``[1e-15, 1]`` for Δp,
    and share a sign; within 1e-15 (absolute) below that; a KLD past the top bin (≈ 1e4) reads as the exact max; min
    and max are exact (:mod:`lit_ppl.metrics.histogram` states the bound in full); ``kld_histogram`` regroups the
    KLD counts in quarter decades. The state is a fixed 627 KB per rank whatever the number of tokens
    (:meth:`state_bytes`), synced by one all-reduce per state; the counts are integers, so they are the same at any
    world size and in any order.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, exact: bool = False, **kwargs: Any) -> None:
        super().__init__(exact=exact, **kwargs)
        for name in SUMS:
            self.add_sum_state(f"sum_{name}")
        for name in ("same_top", "count"):
            self.add_state(name, default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        buckets = len(TOP_P_EDGES) - 1
        for name in ("bucket_kld", "bucket_kld_rev"):
            self.add_sum_state(name, size=buckets)
        for name in ("bucket_tokens", "bucket_same_top"):
            self.add_count_state(name, size=buckets)
        self._edges: dict[torch.device, Tensor] = {}  # per device, made once: not a state a precision may cast
        for name, bins in HISTOGRAMS.items():
            self.add_count_state(f"{name}_counts", bins.size)
            self.add_state(f"{name}_lowest", default=torch.tensor(math.inf, dtype=torch.float64), dist_reduce_fx="min")
            self.add_state(
                f"{name}_highest", default=torch.tensor(-math.inf, dtype=torch.float64), dist_reduce_fx="max"
            )

    def state_bytes(self) -> int:
        """Bytes of every state of this rank: fixed at construction, whatever the number of tokens."""
        return sum(v.numel() * v.element_size() for v in self.metric_state.values())

    def update(
        self,
        nll: Tensor,
        nll_base: Tensor,
        kld: Tensor,
        kld_rev: Tensor,
        p_diff: Tensor,
        same_top: Tensor,
        top_p: Tensor,
    ) -> None:
        """Add the per-token values of one batch (from :func:`token_stats`)."""
        d = torch.float64
        nll, nll_base, kld, kld_rev, p_diff = (x.detach().to(d) for x in (nll, nll_base, kld, kld_rev, p_diff))
        for name, value in (
            ("nll", nll),
            ("nll2", nll * nll),
            ("nll_base", nll_base),
            ("nll_base2", nll_base * nll_base),
            ("nll_nll_base", nll * nll_base),
            ("kld", kld),
            ("kld2", kld * kld),
            ("kld_rev", kld_rev),
            ("kld_rev2", kld_rev * kld_rev),
            ("p_diff", p_diff),
            ("p_diff2", p_diff**2),
            ("p_diff4", p_diff**4),
        ):
            self.add_to(f"sum_{name}", value)
        self.same_top += same_top.sum()
        self.count += nll.numel()
        if top_p.device not in self._edges:
            self._edges[top_p.device] = torch.tensor(TOP_P_EDGES[1:-1], dtype=d, device=top_p.device)
        bucket = torch.bucketize(top_p.detach().to(d), self._edges[top_p.device], right=True)
        self.add_to("bucket_kld", kld, bucket)
        self.add_to("bucket_kld_rev", kld_rev, bucket)
        self.bucket_tokens.index_add_(0, bucket, torch.ones_like(bucket))
        self.bucket_same_top.index_add_(0, bucket, same_top.to(torch.int64))
        for name, values in (("kld", kld), ("kld_rev", kld_rev), ("p_diff", p_diff)):
            idx = HISTOGRAMS[name].index(values)
            getattr(self, f"{name}_counts").index_add_(0, idx, torch.ones_like(idx))  # no host sync, unlike bincount
            if values.numel():  # an empty padding batch has no min
                setattr(self, f"{name}_lowest", torch.minimum(getattr(self, f"{name}_lowest"), values.min()))
                setattr(self, f"{name}_highest", torch.maximum(getattr(self, f"{name}_highest"), values.max()))

    def compute(self) -> dict[str, float]:
        """The statistics, named after llama.cpp's report; probabilities as fractions (not %)."""
        n = float(self.count)
        if n == 0:
            raise LitPplError("no tokens were compared")
        self.check_range()
        s = {name: float(self.sum_of(f"sum_{name}")) for name in SUMS}
        ln_q, ln_q_unc = map(float, mean_stderr(s["nll"], s["nll2"], n))
        ln_b, ln_b_unc = map(float, mean_stderr(s["nll_base"], s["nll_base2"], n))
        cov = (s["nll_nll_base"] / n - ln_q * ln_b) / max(n - 1, 1.0)
        ppl, ppl_base = math.exp(ln_q), math.exp(ln_b)
        ln_ratio, ln_ratio_unc = ln_q - ln_b, math.sqrt(max(ln_q_unc**2 + ln_b_unc**2 - 2 * cov, 0.0))
        kld, kld_unc = map(float, mean_stderr(s["kld"], s["kld2"], n))
        kld_rev, kld_rev_unc = map(float, mean_stderr(s["kld_rev"], s["kld_rev2"], n))
        dp, dp_unc = map(float, mean_stderr(s["p_diff"], s["p_diff2"], n))
        mse, mse_unc = map(float, mean_stderr(s["p_diff2"], s["p_diff4"], n))  # the mean of Δp² and its error
        rms = math.sqrt(mse)
        top = float(self.same_top) / n
        pct = {}
        for name, wanted in PERCENTILES.items():
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
            "kld_rev_mean": kld_rev,
            "kld_rev_mean_unc": kld_rev_unc,
            **{f"kld_rev_{k}": v for k, v in pct["kld_rev"].items()},
            "p_diff_mean": dp,
            "p_diff_mean_unc": dp_unc,
            **{f"p_diff_{k}": v for k, v in pct["p_diff"].items()},
            "p_diff_rms": rms,
            "p_diff_rms_unc": 0.5 / rms * mse_unc if rms > 0 else 0.0,
            "same_top": top,
            "same_top_unc": math.sqrt(top * (1 - top) / max(n - 1, 1.0)),
            "kld_by_top_p": self.buckets(int(n)),
            "kld_histogram": coarse(HISTOGRAMS["kld"], self.kld_counts),
        }
        return out

    def buckets(self, n: int) -> list[dict[str, Any]]:
        """Per bucket of the reference's top-1 probability: its tokens, their share, mean KLD both ways and top-1
        agreement (``None`` for an empty bucket)."""
        tokens, same = self.bucket_tokens.tolist(), self.bucket_same_top.tolist()
        kld, rev = self.sum_of("bucket_kld").tolist(), self.sum_of("bucket_kld_rev").tolist()
        out = []
        for i, count in enumerate(tokens):
            out.append(
                {
                    "top_p": [TOP_P_EDGES[i], TOP_P_EDGES[i + 1]],
                    "tokens": count,
                    "share": count / n,
                    "kld_mean": kld[i] / count if count else None,
                    "kld_rev_mean": rev[i] / count if count else None,
                    "same_top": same[i] / count if count else None,
                }
            )
        return out
