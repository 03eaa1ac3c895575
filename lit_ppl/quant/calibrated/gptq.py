"""GPTQ across ranks: the Hessians summed over them, then each layer's quantization, optionally block by block.

GPTQ needs one statistic per layer, the Hessian ``H ∝ XᵀX`` of its inputs: accumulated as a float64 ``in × in``
sum and a token count, summed over the ranks in global batch order (:class:`lit_ppl.quant.calibrated.stream.Sums`;
torchao's observer would keep a float32 ``H`` per layer and know nothing of ranks); under tensor parallelism the
whole layer's (:mod:`lit_ppl.quant.calibrated.split`).
The quantization itself is :mod:`lit_ppl.quant.calibrated.gptq_solver` (plain torch ops, any
device: the codes of torchao's ``IntxUnpackedToInt8Tensor``/``Int8Tensor``), or torchao's ``gptq_quantize`` for the CUDA
``Int4Tensor`` of the tinygemm backend (CUDA only: torchao 0.18 asserts a CUDA weight). By default, like torchao's,
every layer's ``H`` comes from the float model in one pass; ``quant.gptq.sequential`` calibrates each decoder block
on the outputs of the blocks before it, already quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lit_ppl.config.quant import GptqConfig
from lit_ppl.errors import LitPplError
from lit_ppl.quant.calibrated.gptq_solver import gptq_tensor, solve, solve_facts, with_codes
from lit_ppl.quant.calibrated.split import TpView
from lit_ppl.quant.calibrated.stream import Where, block_of, layer_statistics, stream
from lit_ppl.quant.calibrated.text import Calibration


def gptq_problem(device: torch.device) -> str | None:
    """Why torchao's GPTQ core cannot run on ``device`` (``None`` if it can)."""
    if device.type != "cuda":
        # torchao 0.18's gptq_quantize asserts a CUDA weight (and calls torch.cuda.synchronize()).
        return f"GPTQ needs a CUDA GPU (torchao: 'GPTQ only supports CUDA currently'); the weights are on {device.type}"
    return None


def gptq_hessians(
    lm: nn.Module,
    names: list[str],
    calibration: Calibration,
    rank: int,
    world_size: int,
    tp: TpView | None = None,
    stop: nn.Module | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Per layer ``xtx = Σ xᵀx`` (float64, ``(in, in)`` of the whole layer: ``tp`` gathers a row-parallel layer's
    input) and ``count`` (int64 tokens) over the data-parallel ranks' calibration batches (``rank`` of
    ``world_size``), summed in global batch order: every rank holds the whole set's numbers, at any world size.

    One pass through the float model (torchao's default, non-sequential GPTQ: every layer observes float inputs).
    Memory is one ``in × in`` float64 matrix per layer, whatever the number of calibration tokens.
    """
    modules, batches, real_box, stats = layer_statistics(
        lm,
        names,
        calibration,
        Where(rank, world_size, tp),
        lambda w: {"xtx": torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64, device=w.device)},
    )

    def observe(name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0][real_box[0]]  # (tokens, in): padding positions left out
            x = (x if tp is None else tp.whole_input(name, x)).to(torch.float64)
            # float32 × float32 products are exact in float64; only the sums round (one batch's alone, then in order).
            stats.add(name, "xtx", x.T @ x)
            stats.add(name, "count", torch.tensor(x.shape[0], device=x.device))

        return hook

    stream(lm, modules, observe, calibration, batches, real_box, stats, stop)
    return stats.total


def gptq_weight(xtx: torch.Tensor, count: int, weight: torch.Tensor, base_config: Any) -> torch.Tensor:
    """torchao's GPTQ (``gptq_quantize``: damping, Cholesky inverse, column-wise error feedback) from a summed
    ``xtx``; returns torchao's ``Int4Tensor`` (CUDA, tinygemm's layouts: the codes lit-ppl's solver cannot set).

    torchao's observer holds ``H = (2/n) Σ xᵀx`` in float32 with ``n`` the batches it saw; here ``n`` is the token
    count (each token weighs the same, padding excluded). GPTQ is invariant to the scale of ``H`` (its damping is
    relative to ``mean(diag H)``), so only the rounding of this float32 copy differs.
    """
    from torchao.prototype.gptq import GPTQConfig, gptq_quantize

    problem = gptq_problem(weight.device)
    if problem:
        raise LitPplError(problem)
    h = (xtx * (2.0 / max(count, 1))).to(torch.float32)
    config = GPTQConfig(step="convert", base_config=base_config)
    # gptq_quantize edits both H and the weight in place: give it copies.
    return gptq_quantize(h, weight.detach().clone(), config)


def quantize_layers(
    lm: nn.Module,
    configs: dict[str, tuple[Any, bool]],
    hessians: dict[str, dict[str, torch.Tensor]],
    opts: GptqConfig,
    tp: TpView | None = None,
    solvers: int = 1,
) -> dict[str, dict[str, Any]]:
    """Replace each layer of ``configs`` (name → (torchao config, whether torchao's own CUDA GPTQ runs it)) by its
    GPTQ quantization from the reduced ``hessians`` (:func:`gptq_hessians`); returns per-layer facts. ``solvers``:
    the ranks of the default group, each holding every layer whole, that share the solves (:func:`_shared_solves`)."""
    if solvers > 1 and tp is None:
        return _shared_solves(lm, configs, hessians, opts, solvers)
    chosen: dict[str, dict[str, Any]] = {}
    for name, (config, torchao) in configs.items():
        mod = lm.get_submodule(name)
        weight, chosen[name] = layer_gptq(hessians[name], mod.weight, config, torchao, opts, tp, name)
        mod.weight = nn.Parameter(weight, requires_grad=False)
    return chosen


def _shared_solves(
    lm: nn.Module,
    configs: dict[str, tuple[Any, bool]],
    hessians: dict[str, dict[str, torch.Tensor]],
    opts: GptqConfig,
    solvers: int,
) -> dict[str, dict[str, Any]]:
    """:func:`quantize_layers` with the ``i``-th layer solved by rank ``i mod solvers`` alone (all solve theirs
    first, then each layer's codes, scales and zero points are broadcast from its solver): the solve is
    deterministic, so the weights are those of a rank solving all. torchao's CUDA GPTQ still runs on every rank."""
    import torch.distributed as dist

    from lit_ppl.quant.calibrated.awq import quantize_weight

    me, order = dist.get_rank(), list(configs.items())
    mine = {
        name: solve(hessians[name]["xtx"], lm.get_submodule(name).weight, config, opts)[1:4]
        for i, (name, (config, torchao)) in enumerate(order)
        if not torchao and i % solvers == me
    }
    chosen: dict[str, dict[str, Any]] = {}
    for i, (name, (config, torchao)) in enumerate(order):
        mod, st = lm.get_submodule(name), hessians[name]
        if torchao:
            weight, chosen[name] = layer_gptq(st, mod.weight, config, True, opts)
        else:
            ref = quantize_weight(mod.weight.detach(), config)  # torchao's tensor whose codes are replaced
            rows = mod.weight.shape[0]
            empty = (torch.empty(mod.weight.shape, dtype=torch.int8, device=mod.weight.device),)
            empty += (torch.empty_like(ref.scale.reshape(rows, -1)), torch.empty_like(ref.zero_point.reshape(rows, -1)))
            parts = mine.pop(name, empty)
            for t in parts:  # as bytes: gloo has no collective for every dtype
                dist.broadcast(t.view(-1).view(torch.uint8), src=i % solvers)
            weight = with_codes(ref, *parts)
            facts = {"gptq_tokens": int(st["count"]), **solve_facts(st["xtx"], opts)}
            chosen[name] = {**facts, "gptq_solved_by": i % solvers}
        mod.weight = nn.Parameter(weight, requires_grad=False)
    return chosen


def layer_gptq(
    st: dict[str, torch.Tensor],
    weight: torch.Tensor,
    config: Any,
    torchao: bool,
    opts: GptqConfig,
    tp: TpView | None = None,
    name: str = "",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One layer's GPTQ tensor from its reduced statistics ``st`` (``xtx``, ``count``), by torchao's CUDA GPTQ or
    lit-ppl's solver, and the facts for the report; ``tp``: ``weight`` is this rank's slice of layer ``name``."""
    facts: dict[str, Any] = {"gptq_tokens": int(st["count"])}
    if torchao:
        if tp is not None and tp.split_of(f"{name}.weight") is not None:
            raise LitPplError(
                f"{name}: torchao's CUDA GPTQ (tinygemm int4) solves one whole weight; under tensor parallelism "
                "use quant.backend=intx (lit-ppl's GPTQ solves the whole layer and keeps each rank's slice)"
            )
        return gptq_weight(st["xtx"], int(st["count"]), weight, config), facts
    tensor, more = gptq_tensor(st["xtx"], weight, config, opts, tp, name)
    return tensor, {**facts, **more}


def blocks(lm: nn.Module, names: list[str]) -> list[tuple[nn.Module | None, list[str]]]:
    """``names`` grouped by decoder block (the first ``.N.`` of a name: ``model.layers.3``), in forward order,
    each with the block module (``None`` for a layer in no numbered block, e.g. the head: observed last)."""
    order = {n: i for i, (n, _) in enumerate(lm.named_modules())}
    groups: dict[str, list[str]] = {}
    for name in sorted(names, key=order.__getitem__):
        where = block_of(name)
        groups.setdefault(f"{where[0]}.{where[1]}" if where else "", []).append(name)
    tail = groups.pop("", [])
    out: list[tuple[nn.Module | None, list[str]]] = [(lm.get_submodule(p), ns) for p, ns in groups.items()]
    return out + ([(None, tail)] if tail else [])


def run_gptq(
    lm: nn.Module,
    configs: dict[str, tuple[Any, bool]],
    calibration: Calibration,
    rank: int,
    world_size: int,
    opts: GptqConfig,
    hessians: dict[str, dict[str, torch.Tensor]] | None = None,
    tp: TpView | None = None,
) -> dict[str, dict[str, Any]]:
    """GPTQ of every layer of ``configs``: from ``hessians`` of the float model (one pass, computed here if not
    given), or ``opts.sequential``: block by block, each block's Hessians from a pass through the blocks before it
    already quantized (the pass stops after the block). Every rank reduces the same sums, so holds the same weights."""
    if not opts.sequential:
        hessians = (
            hessians if hessians is not None else gptq_hessians(lm, sorted(configs), calibration, rank, world_size, tp)
        )
        return quantize_layers(lm, configs, hessians, opts, tp, world_size)
    chosen: dict[str, dict[str, Any]] = {}
    for block, names in blocks(lm, list(configs)):
        h = gptq_hessians(lm, names, calibration, rank, world_size, tp, stop=block)
        chosen.update(quantize_layers(lm, {n: configs[n] for n in names}, h, opts, tp, world_size))
    return chosen
