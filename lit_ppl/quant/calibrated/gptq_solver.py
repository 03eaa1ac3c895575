"""GPTQ on plain torch ops: the codes and scales of torchao's own tensors, on any device.

torchao 0.18's ``gptq_quantize`` asserts a CUDA weight before any arithmetic, so without a GPU GPTQ would never
run; this is the same algorithm (Frantar et al. 2022, Algorithm 1) written against torchao's tensors instead:

1. ``H = XᵀX`` (the float64 sum :func:`lit_ppl.quant.calibrated.gptq.gptq_hessians` reduces over the ranks; GPTQ
   does not depend on its scale), dead inputs (``H_jj = 0``) zeroed, damped by ``damp · mean(diag H)``;
2. the upper Cholesky factor ``U`` of ``H⁻¹``;
3. columns quantized in order (``act_order``: by decreasing ``H_jj``), each one's rounding error
   ``(w − q) / U_jj`` fed forward into the columns not yet quantized (within a block of ``block_size`` columns at
   once, then to the rest with one matmul).

The rounding grid of a column is the one torchao's config would choose: the scales and zero points come from
the config's own handler applied to the group's current columns (``act_order``: to the original weight, "static
groups", since columns of a group are then not quantized together; the authors' code reads a group that starts
inside a lazy block before the block's own feedback: tried on SmolLM2, held-out KLD was 10% worse, see
benchmarks/README.md), and a column's codes are
``clamp(round(w · (1/scale)) + zero)`` exactly as ``quantize_affine`` computes them. The result is torchao's own
tensor (``IntxUnpackedToInt8Tensor``, ``Int8Tensor``) holding these codes: its kernels, its bytes, its hash.
Built from the codes, not by re-rounding ``dequantize(GPTQ)``: torchao's round-to-nearest would re-derive a
group's scale from its largest dequantized value and, where that code is −8 (or an error-fed column moved the
maximum), choose a different scale, so only the codes themselves reproduce GPTQ exactly.
The arithmetic is float64 (the weight rounded to its dtype only where torchao's grid reads it): deterministic,
so every rank given the same ``H`` computes the same bits.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_ppl.config.quant import GptqConfig
from lit_ppl.errors import LitPplError
from lit_ppl.quant.calibrated.split import TpView


def grid_of(config: Any, weight: torch.Tensor) -> tuple[int, int, int]:
    """``(group size, qmin, qmax)`` of the torchao weight configs this solver builds tensors for."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup, PerRow
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    if isinstance(config, IntxWeightOnlyConfig) and isinstance(config.granularity, PerGroup):
        qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[config.weight_dtype]
        return config.granularity.group_size, qmin, qmax
    if isinstance(config, Int8WeightOnlyConfig) and isinstance(config.granularity, PerRow):
        return weight.shape[1], -128, 127
    raise LitPplError(f"GPTQ on torch ops builds IntxWeightOnlyConfig(PerGroup) or int8 per-row tensors, not {config}")


def codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """torchao's ``quantize_affine`` for one column: ``clamp(round(w · (1/scale)) + zero, qmin, qmax)``."""
    return torch.clamp(torch.round(w * (1.0 / scale)) + zero, qmin, qmax)


def gptq_tensor(
    xtx: torch.Tensor, weight: torch.Tensor, config: Any, opts: GptqConfig, tp: TpView | None = None, name: str = ""
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GPTQ of ``weight`` (``(out, in)``) for torchao ``config`` from ``xtx = Σ xᵀx`` (float64); returns torchao's
    tensor holding the GPTQ codes, and facts for the report. ``tp``: ``weight`` is this rank's slice of layer
    ``name``: the whole layer is solved (every rank alike: each column's error feeds its whole row) and the slice's
    codes kept."""
    from lit_ppl.quant.calibrated.awq import quantize_weight

    param = f"{name}.weight"
    if tp is None or tp.split_of(param) is None:
        ref, Q, scale, zero, facts = solve(xtx, weight, config, opts)
        return with_codes(ref, Q, scale, zero), facts
    _, Q, scale, zero, facts = solve(xtx, tp.whole(param, weight), config, opts)
    if tp.rowwise(name):
        cols = tp.columns(name, Q.shape[1])
        g = Q.shape[1] // scale.shape[1]
        groups = slice(cols.start // g, cols.stop // g) if scale.shape[1] > 1 else slice(0, 1)  # per row: whole row's
        Q, scale, zero = Q[:, cols], scale[:, groups], zero[:, groups]
    else:
        Q, scale, zero = (tp.local(param, t) for t in (Q, scale, zero))
    return with_codes(quantize_weight(weight.detach(), config), Q, scale, zero), facts


def with_codes(ref: torch.Tensor, Q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """torchao's tensor ``ref`` holding the codes ``Q`` with their ``scale`` and ``zero`` point (per row, group)."""
    ref.qdata = Q.contiguous().reshape(ref.qdata.shape)
    ref.scale = scale.contiguous().reshape(ref.scale.shape)
    ref.zero_point = zero.contiguous().reshape(ref.zero_point.shape)
    return ref


def solve_facts(xtx: torch.Tensor, opts: GptqConfig) -> dict[str, Any]:
    """What the report says of one layer's solve: its dead inputs (``H_jj = 0``) and whether columns were reordered."""
    return {"gptq_dead_inputs": int((xtx.diagonal() == 0).sum()), "gptq_act_order": opts.act_order}


def solve(
    xtx: torch.Tensor, weight: torch.Tensor, config: Any, opts: GptqConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """GPTQ's codes ``(out, in)`` of ``weight``, its scales and zero points ``(out, groups)``, torchao's
    round-to-nearest tensor they replace, and the facts."""
    from lit_ppl.quant.calibrated.awq import quantize_weight

    out_f, in_f = weight.shape
    dtype, device = weight.dtype, weight.device
    g, qmin, qmax = grid_of(config, weight)
    ref = quantize_weight(weight.detach(), config)  # torchao's round-to-nearest: the tensor whose codes we replace
    scale = torch.empty_like(ref.scale.reshape(out_f, -1))
    zero = torch.empty_like(ref.zero_point.reshape(out_f, -1))
    W = weight.detach().to(torch.float64).clone()
    H = xtx.to(device=device, dtype=torch.float64).clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    static = opts.act_order or g == in_f  # per row: one group, its grid from the whole row before any update

    def grid(j: int, cols: torch.Tensor) -> None:
        q = quantize_weight(cols.to(dtype).contiguous(), config)
        scale[:, j], zero[:, j] = q.scale.reshape(out_f), q.zero_point.reshape(out_f)

    if static:
        for j in range(in_f // g):
            grid(j, W[:, j * g : (j + 1) * g])
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if opts.act_order else torch.arange(in_f)
    perm = perm.to(device)
    W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(opts.damp * H.diagonal().mean())
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError as err:
        raise LitPplError(f"GPTQ: XᵀX is not positive definite after damping ({err}); raise quant.gptq.damp") from None
    Q = torch.empty(out_f, in_f, dtype=torch.int8, device=device)
    block = -(-max(opts.block_size, g) // g) * g if not static else opts.block_size  # groups never straddle blocks
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1, E1 = W[:, i1:i2].clone(), torch.zeros(out_f, i2 - i1, dtype=torch.float64, device=device)
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            j = col // g
            if not static and col % g == 0:  # a group starts: its grid from its columns as the errors left them
                grid(j, W1[:, i : i + g])
            s, z = scale[:, j], zero[:, j]
            q = codes(W1[:, i].to(dtype), s, z, qmin, qmax)
            Q[:, i1 + i] = q.to(torch.int8)
            err = (W1[:, i] - (q.double() - z.double()) * s.double()) / U[i1 + i, i1 + i]
            W1[:, i:] -= err[:, None] * U[i1 + i, i1 + i : i2][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return ref, Q[:, torch.argsort(perm)], scale, zero, solve_facts(xtx, opts)
