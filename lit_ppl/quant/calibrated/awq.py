"""AWQ, calibrated across ranks: one scale search, the same on every rank.

AWQ (activation-aware weight quantization) quantizes ``W·diag(s)`` instead of ``W`` and divides the layer's
input by ``s`` at run time: torchao's ``act_pre_scale`` where the quantized tensor has one (``Int8Tensor``), else
one elementwise multiply at the layer's input (:func:`attach_pre_scale`), so that AWQ runs on every int4 backend.
For each linear layer, with ``x̄`` the mean absolute
input per channel over the calibration tokens, torchao's search tries ``s = x̄^(i/n)`` (normalised by
``sqrt(max·min)``) for ``i = 0 .. n-1`` and keeps the one whose quantized output is closest to the float output.

torchao's ``AWQObserver`` keeps every calibration input of every layer and knows nothing of ranks. Here the
same search runs from two statistics accumulated while the calibration windows stream through the float model,
so memory does not grow with the calibration set, and each is summed over the ranks in float64:

1. per layer: ``Σ|x|`` per input channel and the token count (``x̄ = Σ|x| / count``);
2. per layer and candidate scale: ``Σ (x·Wᵀ − (x·s⁻¹)·Q(W·s)ᵀ)²``, the squared output error of the quantized
   layer, computed with the real quantized kernel; candidates are quantized one at a time, as the batch passes.

After each step the ranks' partial sums are added in global batch order (:class:`lit_ppl.quant.calibrated.stream.Sums`):
every rank, at every world size, holds the same float64 numbers, hence the same ``argmin`` and the same quantized
weights (which :func:`lit_ppl.quant.consistency.check_ranks_agree` then proves by hash). Under tensor parallelism a
split layer is observed and searched whole (:mod:`lit_ppl.quant.calibrated.split`) and each rank keeps its slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lit_ppl.quant.calibrated.split import TpView
from lit_ppl.quant.calibrated.stream import Where, layer_statistics, stream
from lit_ppl.quant.calibrated.text import Calibration


def quantize_weight(weight: torch.Tensor, config: Any) -> torch.Tensor:
    """``weight`` quantized by the torchao handler of ``config`` (the building block of ``quantize_``)."""
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
    from torchao.utils import DummyModule

    return _QUANTIZE_CONFIG_HANDLER[type(config)](DummyModule(weight), config).weight


PRE_SCALE = "awq_pre_scale"  # a layer's input multiplier where its quantized tensor has no act_pre_scale


def _pre_scale(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * getattr(module, PRE_SCALE), *args[1:])


def attach_pre_scale(module: nn.Module, inv_s: torch.Tensor) -> None:
    """Multiply the layer's input by ``inv_s`` (one elementwise multiply before its ``F.linear``): AWQ's
    ``x · s⁻¹`` for quantized tensors without torchao's ``act_pre_scale``. A parameter, so it moves with the
    module, counts in its bytes, and is hashed with the quantized weights (:mod:`lit_ppl.quant.consistency`);
    not folded into the preceding norm, which feeds several layers with different scales."""
    setattr(module, PRE_SCALE, nn.Parameter(inv_s.detach().clone(), requires_grad=False))
    module.register_forward_pre_hook(_pre_scale)


# x̄'s significant bits: under tensor parallelism the activations differ from one process's in float32's last bits;
# an s one ulp off would move every code of a column and flip some at their rounding ties (measured: 0.2% in PPL on
# stories260K), while AWQ's grid of exponents is far coarser than 2^-8.
MEAN_BITS = 8


def coarse(x: torch.Tensor, bits: int = MEAN_BITS) -> torch.Tensor:
    """``x`` rounded to ``bits`` significant bits (exactly: a power-of-two rescaling of an integer)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**bits) / 2**bits, exponent)


def candidate_scales(x_mean: torch.Tensor, grid: int, dtype: torch.dtype) -> torch.Tensor:
    """``(grid, in)`` candidate scales from the mean absolute input (rounded to :data:`MEAN_BITS` significant bits),
    as torchao's ``AWQObserver`` forms them."""
    x_mean = coarse(x_mean)
    out = []
    for i in range(grid):
        s = x_mean.pow(i / grid).to(dtype).clamp(min=1e-4)
        out.append(s / (s.max() * s.min()).sqrt())
    return torch.stack(out)


def awq_statistics(
    lm: nn.Module,
    configs: dict[str, Any],
    calibration: Calibration,
    rank: int,
    world_size: int,
    tp: TpView | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Both passes: per layer ``abs_sum`` (float64, per input channel of the whole layer), ``count`` and ``errors``
    (float64, per candidate), each summed over the data-parallel ranks (``rank`` of ``world_size``) in global batch
    order, and the ``scales`` they were computed for. ``tp``: layers split by tensor parallelism are observed whole."""
    where = Where(rank, world_size, tp)
    modules, batches, real_box, stats = layer_statistics(
        lm,
        list(configs),
        calibration,
        where,
        lambda w: {"abs_sum": torch.zeros(w.shape[1], dtype=torch.float64, device=w.device)},
    )

    def observe(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = _input(tp, name, args[0][real_box[0]])  # (tokens, in): padding positions left out
            stats.add(name, "abs_sum", x.abs().to(torch.float64).sum(0))
            stats.add(name, "count", torch.tensor(x.shape[0], device=x.device))

        return hook

    def measure(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = _input(tp, name, args[0][real_box[0]])
            w = module.weight if tp is None else tp.whole(f"{name}.weight", module.weight)
            s = stats[name]["scales"]
            ref = F.linear(x, w)
            for k in range(s.shape[0]):  # one quantized candidate at a time: memory of one layer, not grid layers
                q = quantize_weight(w * s[k], configs[name])
                err = (ref - F.linear(x * (1.0 / s[k]), q)).to(torch.float64)
                stats.add(name, "errors", err.pow(2).sum(), k)

        return hook

    stream(lm, modules, observe, calibration, batches, real_box, stats)
    grid = calibration.spec.config.grid
    fresh = {}
    for name, st in stats.total.items():
        x_mean = st["abs_sum"] / max(int(st["count"]), 1)
        st["scales"] = candidate_scales(x_mean, grid, modules[name].weight.dtype)
        fresh[name] = {"errors": torch.zeros(grid, dtype=torch.float64, device=x_mean.device)}
    stats.add_keys(fresh)
    stream(lm, modules, measure, calibration, batches, real_box, stats)
    return stats.total


def _input(tp: TpView | None, name: str, x: torch.Tensor) -> torch.Tensor:
    return x if tp is None else tp.whole_input(name, x)


def best_scale(st: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """The candidate with the smallest summed error, and its scale: the first minimum, like torchao's strict "<"."""
    best = int(torch.argmin(st["errors"]))
    return best, st["scales"][best]


def apply_awq(
    lm: nn.Module,
    configs: dict[str, Any],
    stats: dict[str, dict[str, torch.Tensor]],
    grid: int,
    tp: TpView | None = None,
) -> dict[str, dict[str, Any]]:
    """Replace every layer of ``configs`` (name → torchao base config) by ``Q(W·s)`` with ``act_pre_scale = 1/s``,
    ``s`` the best of its candidates in ``stats`` (:func:`awq_statistics`); returns, per layer, the chosen ratio and
    its error relative to ``s = 1``. ``tp``: a row-parallel layer scales its slice of the input channels (its int4
    groups lie whole within it, so its codes are those of the whole layer's)."""
    from torchao.quantization.quantize_.common import SupportsActivationPreScaling

    chosen: dict[str, dict[str, Any]] = {}
    for name, st in stats.items():
        mod = lm.get_submodule(name)
        best, s = best_scale(st)
        if tp is not None and tp.rowwise(name):
            s = s[tp.columns(name, s.shape[0])]
        qw = quantize_weight(mod.weight.detach() * s, configs[name])
        if isinstance(qw, SupportsActivationPreScaling):
            qw.act_pre_scale = 1.0 / s  # torchao's own: inside the tensor's linear
        else:
            attach_pre_scale(mod, 1.0 / s)  # IntxUnpackedToInt8Tensor and the int4 CPU/CUDA packings have none
        mod.weight = nn.Parameter(qw, requires_grad=False)
        base = float(st["errors"][0])
        chosen[name] = {
            "awq_ratio": best / grid,
            "awq_error_vs_rtn": float(st["errors"][best]) / base if base > 0 else 1.0,
        }
    return chosen
