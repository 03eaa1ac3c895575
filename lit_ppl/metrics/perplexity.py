"""Token-weighted perplexity as a torchmetrics ``Metric`` with float64 states, and its functional twin.

The metric is fed per-batch *sums* (never logits), accumulates locally on every rank and synchronises once
at ``compute()``. Perplexity is ``exp(Σ nll / Σ tokens)`` over all tokens of all ranks — never a mean of
per-batch means — and the word / byte normalisations follow lm-evaluation-harness.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lit_ppl.errors import LitPplError
from lit_ppl.metrics.exact import SumStates

# Two-sided 95% quantile of the standard normal: the interval is PPL ± 1.96 standard errors.
Z95 = 1.959963984540054

SUM_STATES = ("nll_sum", "nll_sq_sum")
COUNT_STATES = ("tokens", "words", "bytes", "documents", "nonfinite")


def _finite(nll: Tensor, finite: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(nll with non-finite values zeroed, #finite, #non-finite)``, flat and in float64.

    Non-finite values are excluded from the sums and counted instead, so that the caller can name the batch
    rather than report a silent ``nan``. ``finite``: ``torch.isfinite(nll)`` if the caller has it already (the
    cast to float64 turns no finite value into an infinite one, so the mask is the same before and after it).
    """
    nll = nll.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(nll) if finite is None else finite.reshape(-1)
    count = finite.sum()
    return torch.where(finite, nll, torch.zeros_like(nll)), count, nll.numel() - count


def _perplexity_update(nll: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reduce per-token NLL to ``(Σ nll, Σ nll², #tokens, #non-finite)``; sums in float64."""
    clean, tokens, nonfinite = _finite(nll)
    return clean.sum(), (clean * clean).sum(), tokens, nonfinite


def mean_stderr(total: Tensor | float, total_sq: Tensor | float, count: Tensor | float) -> tuple[Tensor, Tensor]:
    """The mean of values and its standard error, from their sum ``Σx``, sum of squares ``Σx²`` and count ``N``.

    The standard error is llama.cpp's, ``sqrt((E[x²] - E[x]²) / (N - 1))`` (the sample standard deviation over
    ``sqrt(N)``), so that only the three sums need to cross ranks. Works elementwise on tensors of any shape; all
    arithmetic is float64.

    Args:
        total: ``Σx``.
        total_sq: ``Σx²``.
        count: ``N``.

    Returns:
        ``(mean, stderr)`` as float64 tensors. ``N = 0`` gives a NaN mean; ``N = 1`` a standard error of 0.

    >>> mean, stderr = mean_stderr(6.0, 14.0, 3)  # the values 1, 2, 3
    >>> mean.item(), round(stderr.item(), 6)
    (2.0, 0.57735)
    """
    n = torch.as_tensor(count, dtype=torch.float64)
    mean = torch.as_tensor(total, dtype=torch.float64) / n
    # E[x²] - E[x]² cancels catastrophically when the spread is tiny next to the mean, and can come out
    # slightly negative; a variance is never negative.
    var = (torch.as_tensor(total_sq, dtype=torch.float64) / n - mean * mean).clamp_min(0.0)
    return mean, torch.sqrt(var / (n - 1).clamp_min(1.0))


def _perplexity_compute(
    nll_sum: Tensor, nll_sq_sum: Tensor, tokens: Tensor, words: Tensor, bytes_: Tensor, documents: Tensor
) -> dict[str, Tensor]:
    """Turn the summed states into the reported statistics (all float64)."""
    nll_sum = nll_sum.to(torch.float64)
    nll_mean, nll_stderr = mean_stderr(nll_sum, nll_sq_sum, tokens)
    ppl = torch.exp(nll_mean)
    ppl_stderr = ppl * nll_stderr
    words_f, bytes_f = words.to(torch.float64), bytes_.to(torch.float64)
    return {
        "ppl": ppl,
        "nll_mean": nll_mean,
        "nll_stderr": nll_stderr,
        "ppl_stderr": ppl_stderr,
        "ppl_ci95_low": ppl - Z95 * ppl_stderr,
        "ppl_ci95_high": ppl + Z95 * ppl_stderr,
        "word_ppl": torch.exp(nll_sum / words_f),
        "byte_ppl": torch.exp(nll_sum / bytes_f),
        "bits_per_byte": nll_sum / bytes_f / math.log(2.0),
        "nll_sum": nll_sum,
        "tokens": tokens,
        "words": words,
        "bytes": bytes_,
        "documents": documents,
    }


def perplexity(nll: Tensor, words: int = 0, bytes_: int = 0, documents: int = 0) -> dict[str, Tensor]:
    """Functional twin of :class:`Perplexity`: statistics of a flat tensor of per-token NLL values.

    Args:
        nll: per-token negative log-likelihoods in nats, any shape.
        words: whitespace-separated words of the scored documents (for word perplexity).
        bytes_: UTF-8 bytes of the scored documents (for byte perplexity and bits per byte).
        documents: number of documents.

    Examples:
        >>> import torch
        >>> out = perplexity(torch.tensor([1.0, 2.0, 3.0]), words=2, bytes_=6)
        >>> round(out["ppl"].item(), 4), round(out["word_ppl"].item(), 4)
        (7.3891, 20.0855)
    """
    nll_sum, nll_sq_sum, tokens, nonfinite = _perplexity_update(nll)
    if nonfinite:
        raise LitPplError(f"nll has {int(nonfinite)} non-finite values; perplexity would be meaningless")
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return _perplexity_compute(nll_sum, nll_sq_sum, tokens, as_t(words), as_t(bytes_), as_t(documents))


class Perplexity(SumStates):
    """Exact, token-weighted perplexity accumulated in float64 across batches and ranks.

    ``update`` takes the per-token NLL of the scored tokens of one batch and the word / byte / document
    counts of the documents that the batch *starts* (so each document is counted once, whatever the world
    size). ``compute`` returns token, word and byte perplexity, bits per byte, the mean NLL with
    llama.cpp's standard error and a 95% interval on perplexity.

    Lightning's ``*-true`` precision plugins call ``module.to(dtype)``, which casts torchmetrics states;
    call ``set_dtype(torch.float64)`` after the precision conversion (the LightningModule does) —
    ``compute`` refuses anything else. With ``exact=True`` (deterministic mode) the sums are exact fixed-point
    integers (:mod:`lit_ppl.metrics.exact`): the same in any order, on any number of ranks.

    Examples:
        >>> import torch
        >>> metric = Perplexity()
        >>> metric.update(torch.tensor([1.0, 2.0]), words=1, bytes_=4, documents=1)
        >>> metric.update(torch.tensor([3.0]))
        >>> round(metric.compute()["ppl"].item(), 4)
        7.3891
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    tokens: Tensor
    words: Tensor
    bytes: Tensor
    documents: Tensor
    nonfinite: Tensor

    def __init__(self, exact: bool = False, **kwargs) -> None:
        kwargs.setdefault("dist_sync_on_step", False)
        if kwargs["dist_sync_on_step"]:
            raise LitPplError("Perplexity syncs once at compute(); dist_sync_on_step=True is not supported")
        super().__init__(exact=exact, **kwargs)
        for name in SUM_STATES:
            self.add_sum_state(name)
        for name in COUNT_STATES:
            self.add_state(name, default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(
        self,
        nll: Tensor,
        words: Tensor | int = 0,
        bytes_: Tensor | int = 0,
        documents: Tensor | int = 0,
        finite: Tensor | None = None,
    ) -> None:
        """Add one batch: per-token NLL of its scored tokens and counts of the documents it starts.

        ``finite``: ``torch.isfinite(nll)``, when the caller computed it for its own use (one pass per step).
        """
        clean, tokens, nonfinite = _finite(nll, finite)
        self.add_to("nll_sum", clean)
        self.add_to("nll_sq_sum", clean * clean)
        # add_, not +=: `self.x += y` also re-assigns the attribute through nn.Module.__setattr__, a few µs each step.
        self.tokens.add_(tokens)
        self.nonfinite.add_(nonfinite)
        self.words.add_(words)
        self.bytes.add_(bytes_)
        self.documents.add_(documents)

    def compute(self) -> dict[str, Tensor]:
        """Return the statistics over everything seen on every rank (float64)."""
        if not self.exact and self.nll_sum.dtype != torch.float64:
            raise RuntimeError(
                f"Perplexity states are {self.nll_sum.dtype}, expected torch.float64: something cast the "
                "metric after set_dtype(torch.float64) (a precision plugin calling module.to(dtype)?)"
            )
        self.check_range()
        sums = [self.sum_of(name) for name in SUM_STATES]
        out = _perplexity_compute(*sums, self.tokens, self.words, self.bytes, self.documents)
        # Synced like the rest, so every rank sees the same count and can stop together.
        out["nonfinite"] = self.nonfinite.clone()
        return out


class NLLBreakdown(SumStates):
    """Where the loss goes: NLL sums per document and per position in the window (float64, summed over ranks).

    Per position it keeps Σ nll, Σ nll² and the count, so a plot can show the mean NLL by context length with
    its standard error; per document Σ nll and the token count, for the per-document table.

    Examples:
        >>> import torch
        >>> b = NLLBreakdown(num_documents=2, num_positions=4)
        >>> b.update(torch.tensor([1.0, 2.0, 3.0]), doc_ids=torch.tensor([0, 0, 1]), positions=torch.tensor([0, 1, 1]))
        >>> b.compute()["doc_nll_sum"].tolist(), b.compute()["pos_count"].tolist()
        ([3.0, 3.0], [1.0, 2.0, 0.0, 0.0])
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, num_documents: int, num_positions: int, exact: bool = False, **kwargs) -> None:
        super().__init__(exact=exact, **kwargs)
        self.parts = ("doc_nll_sum", "doc_tokens", "pos_sum", "pos_sum_sq", "pos_count")
        for name in self.parts:
            self.add_sum_state(name, num_documents if name.startswith("doc") else num_positions)

    def update(self, nll: Tensor, doc_ids: Tensor, positions: Tensor) -> None:
        """Add the per-token ``nll`` of tokens in documents ``doc_ids`` at window ``positions``."""
        nll = torch.nan_to_num(nll.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
        ones = torch.ones_like(nll)
        self.add_to("doc_nll_sum", nll, doc_ids)
        self.add_to("doc_tokens", ones, doc_ids)
        self.add_to("pos_sum", nll, positions)
        self.add_to("pos_sum_sq", nll * nll, positions)
        self.add_to("pos_count", ones, positions)

    def compute(self) -> dict[str, Tensor]:
        self.check_range()
        return {name: self.sum_of(name).clone() for name in self.parts}
