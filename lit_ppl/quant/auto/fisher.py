"""``quant=auto``'s sensitivity estimate (``quant.sensitivity_method=fisher``, the default): every candidate's KL
divergence predicted from one forward and one backward pass per calibration window, instead of one forward per
candidate (:mod:`lit_ppl.quant.auto.sensitivity`, ``quant.sensitivity_method=exact``).

Second order about the float model: a change ``Δy`` of a layer's output moves the next-token distributions by ``KL ≈ ½
Δyᵀ F Δy``, with ``F`` the Fisher information of the model's own predictions. ``F = E[g gᵀ]`` for ``g`` the gradient of
``log p(t)`` at a token ``t`` *sampled from the model* (:data:`SAMPLES` per position, each a row of the window's batch;
sampling makes the estimate unbiased, the text's own tokens would not), so ``½ E[(g · Δy)²]`` is the quadratic form
itself. The product is taken whole over channels and over each run of :data:`BLOCK` positions, then squared: ``KLD ≈ ½
Σ_runs (Σ_run g · Δy)²``. Tokens sampled independently at each position make the terms between the outputs vanish in
expectation; those between one weight's changes at different positions (later attention mixes them) are kept within a
run and dropped between runs. Squares per position dropped them all (on SmolLM2-135M: value and output projections at
0.72–0.74 of their measured KLD, the MLP's at 0.84–0.90); the whole window keeps them all but leaves a few squared terms
per candidate, whose noise ranks the candidates worse than the bias did. NVIDIA Model-Optimizer's AutoQuantize keeps
``F`` diagonal, ``½ Σ g² Δy²``, which drops the terms between channels too: on SmolLM2-135M it put query and key
projections at two thirds of their measured KLD, the MLP's at nine tenths, and the knapsack traded the one for the
other. ``Δy = x ΔWᵀ`` is the candidate's change of the layer's output on the float model's inputs ``x`` (an embedding:
the rows it looks up; a group of experts: the experts module run again on its inputs and routing with the candidate's
weights, less its float output). A layer inside an attention module is seen at the attention's output, the attention run
again with the candidate's weight: a value projection's error is alike at every position and attention adds it up over
the positions it mixes, which a sum position by position at the projection's own output does not see (it put value
projections at a third of their measured KLD). The change of the text's NLL adds the first-order term of the text's own
tokens (the batch's last row): ``ΔNLL ≈ −Σ g_text · Δy + KLD``. The rows are one window repeated, so that one backward
pass brings every row's gradient to a candidate at once and its ``ΔW`` and ``Δy`` are made once per window, not once per
gradient (on SmolLM2-135M the table in two thirds of the time, at a lower peak; under FSDP one gather per layer in the
backward pass, not three). Written here because none of the dependencies estimates a quantization's effect
(Model-Optimizer is not one).

Sums per window are float64 and added over the ranks in global batch order
(:func:`lit_ppl.quant.calibrated.stream.ordered_sum`): the same table at any world size. Tokens are sampled from a
generator seeded by the window's global index. Memory: every candidate is held quantized for the pass (its codes and
scales: about a quarter of float32's bytes, an eighth for packed int4), its ``ΔW`` made when its layer's gradient
arrives and dropped after; the decoder blocks run under activation checkpointing (a window holds the blocks' inputs for
its :data:`ROWS` rows, each block's activations recomputed in the backward pass). Under FSDP the float layers and the
candidates are held by rows (:mod:`lit_ppl.parallel.float_rows`): every rank runs every window, idle past its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from lit_ppl.model.scorer import decoder_and_head, head_fn
from lit_ppl.parallel.float_rows import FloatRows, gathered, whole_weight
from lit_ppl.quant.auto.candidates import Candidates, weight_slot
from lit_ppl.quant.auto.sensitivity import StandIn
from lit_ppl.quant.calibrated.stream import Where
from lit_ppl.quant.calibrated.text import Calibration

SEED = 20_240_601  # the sampled tokens' generator: seeded by this and the window's global index
SAMPLES = 2  # sampled tokens per position, a row of the window's batch each
BLOCK = 16  # positions whose products g·Δy are summed before squaring: the terms between them kept
ROWS = SAMPLES + 1  # a window's rows: the sampled tokens', then the text's


class _Probe:
    """Hooks on every candidate's modules that add, per candidate and scheme, ``½ Σ_runs (Σ_run g·Δy)²`` over the
    sampled tokens' rows and ``Σ g · Δy`` over the text's row to ``sums`` (``[..., 0]`` and ``[..., 1]``) as
    gradients arrive: one ``ΔW`` and one ``Δy`` per candidate and window serve every row."""

    def __init__(self, lm: nn.Module, candidates: Candidates, kinds: list[str]) -> None:
        self.lm = lm
        self.layers = candidates.layers
        self.sums = torch.zeros(len(self.layers), len(kinds), 2, dtype=torch.float64)
        self.candidates = candidates
        # Each candidate kept as built (codes and scales: a quarter of float32's bytes or less), by rows where the
        # float weights are; its ΔW is made when a gradient needs it, so the pass holds one layer's ΔW, not every
        # layer's in every scheme.
        self.built: dict[str, list[tuple[Any, torch.Tensor | None] | None]] = {
            name: [None if candidates.scheme(name, kind) is None else candidates.held(name, kind) for kind in kinds]
            for name in self.layers
        }

    @contextlib.contextmanager
    def hooked(self, candidates: Candidates) -> Iterator[None]:
        """The hooks in place, the weights frozen (no weight gradient is computed) and the input embeddings' output
        a leaf that needs a gradient (the backward pass reaches every layer)."""
        params = [p for p in self.lm.parameters() if p.requires_grad]
        embed = self.lm.get_input_embeddings()
        handles = [embed.register_forward_hook(lambda _, __, out: out.requires_grad_(True), prepend=True)]
        for u, name in enumerate(self.layers):
            for module_name in candidates.modules(name):
                module, attr = weight_slot(self.lm, module_name)
                attention = attention_of(self.lm, module_name) if isinstance(module, nn.Linear) else None
                if attention is not None:  # mixed over positions: seen where attention has mixed it, run again
                    hook = self._rerun(u, name, module, attr)
                    handles.append(attention.register_forward_hook(hook, with_kwargs=True))
                elif isinstance(module, nn.Linear | nn.Embedding):
                    handles.append(module.register_forward_hook(self._watch(u, name, module)))
                else:  # a group of experts: its output with the candidate's weights needs the routing, run again
                    handles.append(module.register_forward_hook(self._rerun(u, name, module, attr), with_kwargs=True))
        try:
            for p in params:
                p.requires_grad_(False)
            with torch.enable_grad():
                yield
        finally:
            for h in handles:
                h.remove()
            for p in params:
                p.requires_grad_(True)

    def _watch(self, u: int, name: str, layer: nn.Module) -> Callable[..., None]:
        lookup = isinstance(layer, nn.Embedding)

        def forward_hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if out.requires_grad:
                x = _one_row(args[0])
                change = (lambda d, _: F.embedding(x, d)) if lookup else (lambda d, _: F.linear(x, d))
                out.register_hook(lambda g: self._add(u, name, g, change, module))

        return forward_hook

    def _rerun(self, u: int, name: str, owner: nn.Module, attr: str) -> Callable[..., None]:
        """A hook on the module whose output the candidate's change is measured at (the candidate's own group of
        experts, or the attention holding it): that module run again, on one row, with ``owner``'s ``attr``
        changed."""

        def forward_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            first = _first(out)
            if first.requires_grad:
                inputs = tree_map_only(torch.Tensor, lambda t: _one_row(t.detach()), (args, kwargs))
                base = _one_row(first.detach())
                changed = lambda d, w: _first(_with(module, owner, attr, w + d, inputs)) - base  # noqa: E731
                first.register_hook(lambda g: self._add(u, name, g, changed, module))

        return forward_hook

    def _add(
        self,
        u: int,
        name: str,
        g: torch.Tensor,
        change: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scope: nn.Module,
    ) -> None:
        """Per scheme, ``½ Σ_runs (Σ_run g·Δy)²`` over the sampled rows of ``g`` and ``Σ g·Δy`` over its text row,
        with ``Δy = change(ΔW, float weight)`` (one row, or every row where the module's output is not batch-first);
        ``scope``: the module ``change`` runs (its weights held by rows gathered once for every scheme)."""
        with torch.no_grad(), gathered(scope):
            g = g.float().reshape(ROWS, -1, g.shape[-1])  # rows first: batch-first or flattened batch-first
            float_weight = self.candidates.tensor(name).detach()  # whole: its scope is gathered
            for j, built in enumerate(self.built[name]):
                if built is None:
                    continue
                weight, pre = built
                dy = change(_delta(whole_weight(weight), pre, float_weight), float_weight).float()
                term = (g * dy.reshape(-1, *g.shape[1:])).sum(-1, dtype=torch.float64)  # (rows, positions)
                runs = F.pad(term[:SAMPLES], (0, -term.shape[1] % BLOCK)).view(SAMPLES, -1, BLOCK).sum(-1)
                self.sums[u, j, 0] += 0.5 * runs.square().sum().cpu()  # the whole product per run, squared
                self.sums[u, j, 1] += term[SAMPLES].sum().cpu()


def _one_row(t: torch.Tensor) -> torch.Tensor:
    """A copy of the first of a window's :data:`ROWS` identical rows of a batch-first tensor, so that a hook does
    not keep every row until the backward pass (a flattened tensor, whose first dimension counts positions of every
    row, or a 1-D one: itself, whole)."""
    return t[:1].clone() if t.dim() > 1 and t.shape[0] == ROWS else t


def _with(module: nn.Module, owner: nn.Module, attr: str, weight: torch.Tensor, inputs: tuple[tuple, dict]) -> Any:
    """``module``'s output on ``inputs`` (args, kwargs) with ``owner``'s weight ``attr`` replaced by ``weight``
    (``owner``: ``module`` or one of its submodules), restored after."""
    float_weight = getattr(owner, attr)
    setattr(owner, attr, nn.Parameter(weight, requires_grad=False))
    try:
        return module(*inputs[0], **inputs[1])
    finally:
        setattr(owner, attr, float_weight)


class _Recomputed(StandIn):
    """Stands in for a decoder block during a window: its forward under activation checkpointing (its inner
    activations recomputed in the backward pass instead of held)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def recomputed(lm: nn.Module, blocks: str | None) -> Iterator[None]:
    """The decoder blocks of the list ``blocks`` (``model.layers``; ``None``: none) run under activation
    checkpointing: a window holds the blocks' inputs, not every block's activations (the whole recomputation, not
    stopped early: a layer's weight gathered by rows is released by its forward hook)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    layers = lm.get_submodule(blocks) if blocks is not None else []
    saved = list(layers)
    for i, block in enumerate(saved):
        layers[i] = _Recomputed(block)
    try:
        with set_checkpoint_early_stop(False):
            yield
    finally:
        for i, block in enumerate(saved):
            layers[i] = block


def _first(out: Any) -> torch.Tensor:
    """A module's output tensor (an attention module returns ``(output, weights)``)."""
    return out[0] if isinstance(out, tuple) else out


def attention_of(lm: nn.Module, name: str) -> nn.Module | None:
    """The attention module holding the linear layer ``name`` (the nearest enclosing module whose class names
    itself ``…Attention``), or ``None``."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = lm.get_submodule(".".join(parts[:end]))
        if type(module).__name__.endswith("Attention"):
            return module
    return None


def _delta(weight: torch.Tensor, pre: torch.Tensor | None, float_weight: torch.Tensor) -> torch.Tensor:
    """A candidate's ``weight`` minus the float one, with AWQ's input pre-scale folded in (``(x·s) Wᵀ = x (W·s)ᵀ``)."""
    if type(weight) is not torch.Tensor:  # a torchao tensor subclass: its float values
        weight = weight.dequantize()
    if pre is not None:
        weight = weight * pre.to(weight.dtype)
    return (weight - float_weight).to(float_weight.dtype)


def _window(
    decoder: nn.Module,
    head: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    generator: torch.Generator,
) -> None:
    """One window as a batch of :data:`ROWS` identical rows, one forward and one backward pass: row ``i`` carries
    the gradient of ``log p`` of sampled token ``i``, the last row the text's own; the head runs on a detached copy
    of the hidden states a few positions of every row at a time (about ``chunk`` rows of logits in all, whole runs
    of :data:`BLOCK` positions), so that no whole window of logits is held."""
    out = decoder(input_ids=input_ids.expand(ROWS, -1), use_cache=False)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    grads = torch.zeros_like(hidden)
    step = max(BLOCK, chunk // ROWS // BLOCK * BLOCK)  # positions per head call
    for start in range(0, hidden.shape[1], step):
        part = hidden.detach()[:, start : start + step].requires_grad_(True)
        logp = torch.log_softmax(head(part).float(), dim=-1)
        with torch.no_grad():
            sampled = torch.multinomial(logp[0].exp(), SAMPLES, replacement=True, generator=generator)
        picked = torch.cat([sampled.T, targets[None, start : start + step]])  # (rows, positions)
        (grads[:, start : start + step],) = torch.autograd.grad(logp.gather(2, picked[..., None]).sum(), part)
    hidden.backward(grads)


def estimate_layers(
    lm: nn.Module,
    candidates: Candidates,
    calibration: Calibration,
    kinds: list[str],
    at: Where,
    chunk: int,
    blocks: str | None = None,
    lockstep: bool = False,
) -> tuple[torch.Tensor, int]:
    """Per step of this rank's calibration batches, candidate and scheme ``(Σ KLD, Σ ΔNLL, 0, tokens)`` estimated
    (float64, the layout :func:`lit_ppl.quant.auto.table.table_from_sums` reads), and the windows it took.
    ``blocks``: the decoder's block list, run under activation checkpointing (:func:`recomputed`).
    ``lockstep``: layers are held by rows (:mod:`lit_ppl.parallel.float_rows`), so every rank runs as many windows
    per step as the rank with the most (its extra ones idle: a window run again, its sums dropped) and autograd
    keeps references to the gathered weights, gathered again in the backward pass."""
    decoder, head = decoder_and_head(lm)
    head_call = head_fn(lm, head)
    device = next(lm.parameters()).device
    probe = _Probe(lm, candidates, kinds)
    local = torch.zeros(calibration.steps(at.size), len(probe.layers), len(kinds), 4, dtype=torch.float64)
    windows, mine = 0, calibration.batches(at.rank, at.size)
    every = [calibration.batches(r, at.size) for r in range(at.size)] if lockstep else [mine]
    idle = calibration.batches(0, 1)[0][:1]
    regathered = FloatRows.regathered() if lockstep else contextlib.nullcontext()
    with probe.hooked(candidates), recomputed(lm, blocks), regathered:
        for k in range(len(local)):
            ids = mine[k] if k < len(mine) else []
            rows = max((len(b[k]) for b in every if k < len(b)), default=0)
            if not rows:
                continue
            input_ids, real = calibration.batch(ids or idle, device)
            targets = calibration.targets(ids or idle, device)
            for row in range(rows):
                real_row = row < len(ids)
                r = row if real_row else 0
                n = int(real[r].sum())
                generator = torch.Generator(device=device).manual_seed(SEED + (ids or idle)[r])
                probe.sums.zero_()
                _window(decoder, head_call, input_ids[r : r + 1, :n], targets[r, :n], chunk, generator)
                if not real_row:  # an idle window: its gathers had every rank, its sums are not this rank's
                    continue
                kld, first = probe.sums.unbind(-1)
                kld = kld / SAMPLES
                local[k, :, :, 0] += kld
                local[k, :, :, 1] += kld - first  # ΔNLL = −Σ g_text·Δy + KLD (g: of log p)
                local[k, :, :, 3] += n
                windows += 1
    return local, windows
