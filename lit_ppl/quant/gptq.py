"""GPTQ's Hessians, summed across ranks.

GPTQ (CUDA only: torchao 0.18's ``gptq_quantize`` asserts a CUDA weight) needs one statistic per layer, the
Hessian ``H ∝ XᵀX`` of its inputs: accumulated as a float64 ``in × in`` sum and a token count, one ``all_reduce``
each, then handed to torchao's ``gptq_quantize`` (its ``GPTQConfig`` "convert" core, whose observer would keep a
float32 ``H`` per layer and know nothing of ranks). Like torchao's default it is not sequential: every layer's
``H`` comes from the float model in one pass, before any layer is quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.quant.calibration import Calibration, all_reduce, layer_statistics, stream


def gptq_problem(device: torch.device) -> str | None:
    """Why torchao's GPTQ core cannot run on ``device`` (``None`` if it can)."""
    if device.type != "cuda":
        # torchao 0.18's gptq_quantize asserts a CUDA weight (and calls torch.cuda.synchronize()).
        return f"GPTQ needs a CUDA GPU (torchao: 'GPTQ only supports CUDA currently'); the weights are on {device.type}"
    return None


def gptq_hessians(
    lm: nn.Module, names: list[str], calibration: Calibration, rank: int, world_size: int
) -> dict[str, dict[str, torch.Tensor]]:
    """Per layer ``xtx = Σ xᵀx`` (float64, ``(in, in)``) and ``count`` (int64 tokens) over this rank's calibration
    batches, then summed over the ranks: every rank holds the whole calibration set's numbers, bit for bit.

    One pass through the float model (torchao's default, non-sequential GPTQ: every layer observes float inputs).
    Memory is one ``in × in`` float64 matrix per layer, whatever the number of calibration tokens.
    """
    modules, batches, real_box, stats = layer_statistics(
        lm,
        names,
        calibration,
        rank,
        world_size,
        lambda w: {"xtx": torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64, device=w.device)},
    )

    def observe(name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0][real_box[0]].to(torch.float64)  # (tokens, in): padding positions left out
            # float32 × float32 products are exact in float64; only the sums round.
            stats[name]["xtx"].addmm_(x.T, x)
            stats[name]["count"] += x.shape[0]

        return hook

    stream(lm, modules, observe, calibration, batches, real_box)
    # One all_reduce per layer (in the same order on every rank): every rank receives the same reduced bits.
    # Not one flat tensor: that would hold a second copy of every layer's Hessian at once.
    for st in stats.values():
        all_reduce(st["xtx"], world_size)
    counts = all_reduce(torch.stack([st["count"] for st in stats.values()]), world_size)
    for st, count in zip(stats.values(), counts, strict=True):
        st["count"] = count
    return stats


def gptq_weight(xtx: torch.Tensor, count: int, weight: torch.Tensor, base_config: Any) -> torch.Tensor:
    """torchao's GPTQ (``gptq_quantize``: damping, Cholesky inverse, column-wise error feedback) from a summed
    ``xtx``; returns torchao's ``Int8Tensor``/``Int4Tensor``.

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


def apply_gptq(
    lm: nn.Module, configs: dict[str, Any], hessians: dict[str, dict[str, torch.Tensor]]
) -> dict[str, dict[str, Any]]:
    """Replace each layer of ``configs`` (name → torchao ``Int8WeightOnlyConfig``/``Int4WeightOnlyConfig``) by its
    GPTQ quantization from the reduced ``hessians`` (:func:`gptq_hessians`); returns per-layer facts."""
    chosen: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        mod = lm.get_submodule(name)
        st = hessians[name]
        mod.weight = nn.Parameter(gptq_weight(st["xtx"], int(st["count"]), mod.weight, config), requires_grad=False)
        chosen[name] = {"gptq_tokens": int(st["count"])}
    return chosen
