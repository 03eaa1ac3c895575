"""The NLL path of a causal LM, and the check that proves it equals the model's own forward.

lit-ppl never materialises full logits: it runs the decoder to hidden states and applies the output head
itself, chunk by chunk (:mod:`lit_ppl.model.nll`). That head function must turn hidden states into exactly the
logits the model's ``forward`` returns, and architectures differ after the head matmul (Cohere scales,
Gemma 2 soft-caps, Granite divides, Falcon-H1 multiplies). :func:`check_scorer` compares the two paths on one
short window before any evaluation, so an architecture whose head does something lit-ppl does not know
stops the run instead of giving a wrong number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import UserError
from lit_ppl.model.nll import Head, chunked_nll
from lit_ppl.parallel.tensor_parallel import Group, gather_vocab, vocab_parallel_cross_entropy_
from lit_ppl.parallel.vocab_rows import RowsHead

# What each architecture's ``ForCausalLM.forward`` multiplies the head's output by. Keyed by model_type, not by
# config attribute: one name means different things (Granite divides by ``logits_scaling``, HyperCLOVA X
# multiplies by it). MiniCPM3 divides the hidden states before a bias-free head: the same as dividing the logits.
LOGIT_SCALES: dict[str, Callable[[object], float]] = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), lambda c: c.logit_scale),
    **dict.fromkeys(
        ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa", "granitemoe_swa"),
        lambda c: 1.0 / c.logits_scaling,
    ),
    "minicpm3": lambda c: 1.0 / c.logits_scaling,
    "hyperclovax": lambda c: c.logits_scaling,
    "falcon_h1": lambda c: c.lm_head_multiplier,
}

# What a scorer's forward hands its scored hidden states and itself to (see TokenScorer.forward).
Then = Callable[[torch.Tensor, "TokenScorer"], Any]

CHECK_TOKENS = 16  # length of the self-check window
# Largest |Δ log p| the self-check accepts: the two paths run the same ops, so in float32 or wider they agree to
# rounding; in 16-bit the head's output is rounded to 8 (bf16) or 11 (fp16) bits, a few hundredths of a nat.
CHECK_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
CHECK_TOLERANCE_16BIT = 0.1


class ScorerMismatchError(UserError, RuntimeError):
    """lit-ppl's NLL path does not reproduce the model's own log-probabilities."""


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Split a Hugging Face causal LM into the decoder (ids → hidden states) and the output head."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
    return decoder, model.get_output_embeddings()


def logit_transform(config: object) -> tuple[float | None, float | None]:
    """``(scale, soft-cap)`` the architecture applies to the head's output (``None``: none)."""
    scale_of = LOGIT_SCALES.get(config.model_type)
    scale = None if scale_of is None else scale_of(config)
    return (None if scale == 1.0 else scale), getattr(config, "final_logit_softcapping", None)  # cap: Gemma 2/3


def transform(logits: torch.Tensor, scale: float | None, cap: float | None) -> torch.Tensor:
    """The head's output as the model's ``forward`` returns it: scaled, then soft-capped."""
    if scale is not None:
        logits = logits * scale
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def head_fn(model: nn.Module, head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The head as a function, with the logit scaling / soft-capping the architecture applies after it."""
    scale, cap = logit_transform(model.config)
    return lambda hidden: transform(head(hidden), scale, cap)


def head_blocks(model: nn.Module, head: nn.Module) -> list[tuple[int, Head]] | None:
    """A head held by blocks of vocabulary rows as ``(first row, that block's head)``, each with the architecture's
    scaling and soft-cap (element-wise: the same per block); ``None`` for any other head."""
    if not isinstance(head, RowsHead):
        return None
    return blocks_of(head, *logit_transform(model.config))


def blocks_of(head: RowsHead, scale: float | None, cap: float | None) -> list[tuple[int, Head]]:
    """``head``'s blocks as ``(first row, that block's logits with the scaling and soft-cap)``."""
    return [(b.start, lambda h, i=i: transform(head(h, i), scale, cap)) for i, b in enumerate(head.rows.blocks)]


class TokenScorer(nn.Module):
    """Per-token NLL of a causal LM's scored positions, with the logits chunked.

    A module of its own (rather than calls on the LM's parts) so that FSDP's root hooks fire around it: the final
    norm (and tied embeddings and head) live at the root of the sharded tree. Under tensor parallelism
    (``tp``) the head gives this rank's slice of the vocabulary and the loss reduces over the group. With the
    vocabulary held by FSDP-sharded blocks of rows (:mod:`lit_ppl.parallel.vocab_rows`), ``lockstep`` is the group
    whose ranks call the head in step.
    """

    def __init__(self, lm: nn.Module, chunk_size: int, tp: Group | None = None, lockstep: Any = None) -> None:
        super().__init__()
        self.lm = lm
        routed = any(type(m).__name__.endswith("Experts") for m in lm.modules())
        if routed and getattr(lm, "dtype", None) == torch.float64:
            lm.set_experts_implementation("eager")  # transformers' grouped-matmul experts take no float64
        self.decoder, head = decoder_and_head(lm)
        self.head = head_fn(lm, head)
        self.head_module = head
        self.head_blocks = head_blocks(lm, head)  # held by rows: the loss streams over them (one block's logits)
        self.chunk_size = chunk_size
        self.tp = tp
        self.lockstep = lockstep  # the group whose ranks call the head equally often (its vocabulary held by rows)
        self.loss = None if tp is None else partial(vocab_parallel_cross_entropy_, start=head.vocab_start, tp=tp)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from this rank's ``logits`` (themselves without tensor parallelism)."""
        return logits if self.tp is None else gather_vocab(logits, self.tp)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states, ``(b, t, d)``."""
        return self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,
        score_index: torch.Tensor,
        targets: torch.Tensor,
        then: Then | None = None,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> Any:
        """The per-token NLL ``(n,)``, or with ``then``: ``then(hidden states of the scored positions (n, d), self)``.

        ``then`` runs inside this module's forward, so that under FSDP2 the root's parameters (final norm, head) are
        gathered for it by FSDP's own hooks: a comparison nests the reference's forward in the candidate's.
        ``context`` wraps the decoder only (e.g. autocast off for a reference of another dtype).
        """
        with context():
            hidden = self.hidden(input_ids)  # (b, t, d)
            scored = hidden.reshape(-1, hidden.shape[-1]).index_select(0, score_index)  # (n, d)
        out = self.nll(scored, targets) if then is None else then(scored, self)
        if scored.shape[0] == 0 and hasattr(self.head_module, "unshard"):
            # An FSDP unit of its own is gathered by its first call: a rank with nothing to score (a padding step)
            # still joins the gather its peers make, or they wait on it forever.
            self.head_module.unshard()
        self.release_head()
        return out

    def nll(self, scored: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token NLL of hidden states ``scored`` ``(n, d)`` through this model's head, chunk by chunk."""
        return chunked_nll(scored, targets, self.head, self.chunk_size, self.loss, self.lockstep, self.head_blocks)

    def release_head(self) -> None:
        """Free the gathered output head once every chunk is scored (an FSDP2 unit kept gathered across chunks)."""
        if hasattr(self.head_module, "reshard"):
            self.head_module.reshard()


def check_scorer(scorer: TokenScorer, device: torch.device, length: int = CHECK_TOKENS) -> dict[str, float]:
    """Refuse a model whose logits lit-ppl's path does not reproduce; return the largest |Δ log p| and the tolerance.

    One window of ``length`` seeded random token ids (the same on every rank, so that sharded forwards line up)
    goes through the model's own ``forward(...).logits``, through the scorer's forward (decoder, head, chunked
    NLL: the path every batch takes) and through its decoder + head alone; the log-softmaxes must agree at every
    position and vocabulary entry, and the NLLs at every position.
    """
    lm = scorer.lm
    vocab = lm.get_input_embeddings().weight.shape[0]
    if scorer.tp is not None:  # each rank holds a slice of the vocabulary: the seeded ids must span all of it
        sizes = torch.tensor(vocab, device=device)
        torch.distributed.all_reduce(sizes, group=scorer.tp.group)
        vocab = int(sizes)
    ids = torch.randint(0, vocab, (1, length + 1), generator=torch.Generator().manual_seed(0)).to(device)
    inputs, targets = ids[:, :-1], ids[0, 1:]
    with torch.no_grad():
        # Through the scorer's own call first: under FSDP2 that also initialises the root, which unshard() needs.
        nll = scorer(inputs, torch.arange(length, device=device), targets)  # (t,)
        sharded = hasattr(scorer, "unshard")  # FSDP2 root: embeddings and head are gathered by hand below
        if sharded:
            scorer.unshard()
        try:
            logits = scorer.full_logits(lm(input_ids=inputs, use_cache=False).logits[0])  # (t, vocab)
            ours = scorer.full_logits(scorer.head(scorer.hidden(inputs)[0]))  # (t, vocab)
        finally:
            if sharded:
                scorer.reshard()
                scorer.release_head()
    theirs = logits.to(torch.float64).log_softmax(-1)
    theirs_nll = -theirs.gather(1, targets[:, None]).squeeze(1)
    # Where the model itself gives NaN/inf (broken weights, masked vocabulary entries) there is nothing to compare:
    # the evaluation's own non-finite check reports broken weights.
    known, known_nll = torch.isfinite(theirs), torch.isfinite(theirs_nll)
    gaps = torch.cat(
        [
            (ours.to(torch.float64).log_softmax(-1) - theirs)[known],
            (nll.to(torch.float64) - theirs_nll)[known_nll],
        ]
    ).abs()
    diff = gaps.max().item() if gaps.numel() else 0.0
    tolerance = max(CHECK_TOLERANCE.get(t.dtype, CHECK_TOLERANCE_16BIT) for t in (logits, ours))
    if not diff <= tolerance:  # NaN fails too
        raise ScorerMismatchError(
            f"{type(lm).__name__} (model_type {lm.config.model_type!r}): lit-ppl's scoring path differs from the "
            f"model's own forward by up to {diff:.3g} in log-probability (tolerance {tolerance:g}) on a "
            f"{length}-token check window, so its perplexity would be wrong; its head applies a transform "
            "lit-ppl does not know (see lit_ppl.model.scorer.LOGIT_SCALES)"
        )
    return {"tokens": length, "max_abs_logprob_diff": diff, "tolerance": tolerance}
