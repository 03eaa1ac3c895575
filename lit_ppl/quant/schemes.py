"""Quantization schemes (``none``, ``int8``, ``int8dq``, ``int4`` with a group size) and what each needs of a layer:
torchao's configs for them, the int4 kernel that runs here, and why a layer cannot take a scheme.

What a scheme is holds for every method; what a method adds (calibration, another choice of the int4 scales) is
in :mod:`lit_ppl.quant.methods`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_ppl.config.values import GROUP_SIZES, INT4_BACKENDS, QUANT_SCHEMES
from lit_ppl.errors import LitPplError


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme: ``kind`` in :data:`QUANT_SCHEMES`, and the group size of ``int4``."""

    kind: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in QUANT_SCHEMES:
            raise LitPplError(f"quantization config {self.kind!r} is not one of {', '.join(QUANT_SCHEMES)}")
        if self.kind == "int4" and self.group_size not in GROUP_SIZES:
            raise LitPplError(f"int4 needs group_size in {GROUP_SIZES}, got {self.group_size}")

    @property
    def label(self) -> str:
        return f"int4-g{self.group_size}" if self.kind == "int4" else self.kind


NONE = Scheme("none")
PACKED_INT4 = ("tinygemm", "prototype")  # int4 kernels of F.linear only (an embedding lookup takes intx)


def int4_backend(requested: str, device: torch.device, dtype: torch.dtype, embedding: bool) -> str:
    """Which int4 implementation runs here; a clear error for a combination that cannot run."""
    if requested not in INT4_BACKENDS:
        raise LitPplError(f"quant.backend={requested!r} is not one of {', '.join(INT4_BACKENDS)}")
    if requested == "auto":
        # Embedding lookups need aten.embedding, which only the unpacked intx tensor implements.
        if embedding:
            return "intx"
        if device.type == "cuda" and dtype == torch.bfloat16:
            return "tinygemm"
        return "prototype" if device.type == "cpu" and dtype == torch.bfloat16 else "intx"
    needs = {"tinygemm": ("cuda", "Int4WeightOnlyConfig", "on a GPU"), "prototype": ("cpu", "Prototype", "on CPU")}
    if requested in needs and (device.type != needs[requested][0] or dtype != torch.bfloat16 or embedding):
        want, cls, where = needs[requested]
        raise LitPplError(
            f"quant.backend={requested} ({cls}...) needs {want.upper()}, bfloat16 weights and linear layers; this is "
            f"{device.type}/{str(dtype).removeprefix('torch.')}: use precision=bf16-true {where}, or quant.backend=intx"
        )
    return requested


def shape_problem(scheme: Scheme, backend: str | None, weight: torch.Tensor) -> str | None:
    """Why ``scheme`` cannot take this weight (``None`` if it can)."""
    if scheme.kind != "int4":
        return None
    if weight.ndim == 3:
        return "torchao's int4 configs take no 3D expert weights (IntxWeightOnlyConfig: 2-D only; pytorch/ao#3252)"
    out_features, in_features = weight.shape[0], weight.shape[-1]
    if in_features % scheme.group_size:
        return f"in_features {in_features} is not divisible by group_size {scheme.group_size}"
    multiple = {"prototype": 16, "tinygemm": 8}.get(backend or "", 1)  # the packed kernels' tile widths
    if out_features % multiple:
        return f"out_features {out_features} is not a multiple of {multiple}, which the {backend} int4 packing needs"
    return None


def split_problem(scheme: Scheme, module: nn.Module | None, calibrated: bool = False) -> str | None:
    """Why a tensor-parallel slice of input features would quantize differently from the whole row, if it would.

    A row-parallel layer (:mod:`lit_ppl.parallel.tensor_parallel`) holds ``in_features / tp`` of every row.
    Round-to-nearest int8 quantizes the whole rows and keeps the slice
    (:func:`lit_ppl.quant.calibrated.split.quantized_whole`); a ``calibrated`` method's int8 would scale the slice by
    its own maximum, not the row's, int8dq each token's slice of the input, and an int4 group must not straddle two
    slices: each would evaluate another model than the same quantization at ``tp=1``.
    """
    full = getattr(module, "full_in_features", None)
    if full is None or (scheme.kind == "int8" and not calibrated):
        return None
    if scheme.kind != "int4":
        what = "quantizes each token's input" if scheme.kind == "int8dq" else "by a calibrated method scales each row"
        return (
            f"{scheme.label} {what} by its maximum, and under tensor parallelism this layer holds "
            f"{module.in_features} of the row's {full} input features, so its scales would differ from tp=1's; use "
            "quant=int8 (round to nearest: whole rows), quant=int4, or keep it in full precision with a quant=policy "
            "rule (config: none)"
        )
    if module.in_features % scheme.group_size and full % scheme.group_size == 0:
        return (
            f"int4 groups of {scheme.group_size} would straddle the tensor-parallel slices of {module.in_features} "
            f"input features (of {full}); use a quant.group_size that divides {module.in_features}, or a smaller "
            "parallel.tp"
        )
    return None


def fit_group(scheme: Scheme, weight: torch.Tensor, module: nn.Module | None) -> Scheme:
    """``scheme`` with the largest group size ≤ the requested one that divides the layer's input features (the whole
    row's under tensor parallelism, so that tp=1 chooses the same), or ``scheme`` itself if it fits or none does."""
    if scheme.kind != "int4" or weight.ndim != 2:
        return scheme
    width = getattr(module, "full_in_features", None) or weight.shape[-1]
    if width % scheme.group_size == 0:
        return scheme
    fits = [g for g in GROUP_SIZES if g < scheme.group_size and width % g == 0 and weight.shape[-1] % g == 0]
    return Scheme("int4", max(fits)) if fits else scheme


def torchao_config(scheme: Scheme, backend: str | None, int4_qparams: str | None = None) -> tuple[Any, str]:
    """The torchao config for ``scheme`` (``backend`` resolved by :func:`int4_backend`) and its description;
    ``int4_qparams``: torchao's name of an int4 algorithm choosing the group scales other than round-to-nearest's
    (a method's, :mod:`lit_ppl.quant.methods`)."""
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        PerGroup,
    )

    if scheme.kind == "int8":
        return Int8WeightOnlyConfig(), "Int8WeightOnlyConfig (Int8Tensor, per-row)"
    if scheme.kind == "int8dq":
        return Int8DynamicActivationInt8WeightConfig(), "Int8DynamicActivationInt8WeightConfig (Int8Tensor, per-row)"
    g, chosen = scheme.group_size, int4_qparams is not None
    algo = {"int4_choose_qparams_algorithm": int4_qparams} if chosen else {}  # torchao's default otherwise
    named = f", {int4_qparams.upper()} qparams" if chosen else ""
    if backend == "tinygemm":
        cfg = Int4WeightOnlyConfig(group_size=g, int4_packing_format="tile_packed_to_4d", **algo)
        return cfg, f"Int4WeightOnlyConfig(group_size={g}, tile_packed_to_4d{named}) (tinygemm, CUDA)"
    if backend == "prototype":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(
            group_size=g, **algo
        ), f"PrototypeInt4WeightOnlyConfig(group_size={g}{named}) (CPU)"
    if chosen:
        from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
            IntxChooseQParamsAlgorithm,
        )

        algorithm = IntxChooseQParamsAlgorithm[f"{int4_qparams.upper()}_SCALE_ONLY"]
        cfg = IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(g), intx_choose_qparams_algorithm=algorithm
        )
        label = f"{int4_qparams.upper()} scale-only"
        return cfg, f"IntxWeightOnlyConfig(int4, PerGroup({g}), {label}) (int4 values one per int8, any device)"
    cfg = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(g))
    return cfg, f"IntxWeightOnlyConfig(int4, PerGroup({g})) (int4 values stored one per int8, any device)"


def gptq_base_config(scheme: Scheme) -> tuple[Any, str]:
    """The torchao base config GPTQ quantizes to (``GPTQConfig.base_config``): int8 per row, or int4's plain
    ``Int4Tensor`` (the one ``gptq_quantize`` builds), and its description."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme.kind == "int8":
        return Int8WeightOnlyConfig(), "GPTQ (torchao gptq_quantize) to Int8WeightOnlyConfig (Int8Tensor, per-row)"
    g = scheme.group_size
    return Int4WeightOnlyConfig(group_size=g), f"GPTQ (torchao gptq_quantize) to Int4Tensor(group_size={g}) (CUDA)"
