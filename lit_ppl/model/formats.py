"""A checkpoint's own quantization, as shipped: what ``results.json["quant"]`` says when no quantization was applied.

A GGUF file is read with the ``gguf`` package's ``GGUFReader`` (a memory map of the header: no tensor is
dequantized to describe it); a Hugging Face checkpoint's ``quantization_config`` with transformers' own config.
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path
from typing import Any

from lit_ppl.errors import LitPplError, first_line

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # GGML types that are not quantized


def gguf_description(path: Path) -> dict[str, Any]:
    """The GGML types a GGUF file holds (tensors and bytes of each), its quantized tensors' mean bits per weight
    and block size, in the ``results.json["quant"]`` shape (``source: checkpoint``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as err:  # what its parser meets
        raise LitPplError(
            f"{path} is not a readable GGUF file ({path.stat().st_size} bytes; gguf: {first_line(err)}): its header "
            "is damaged or the file is cut short; download it again"
        ) from None
    types: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    modules: dict[str, str] = {}
    values = 0
    for t in reader.tensors:
        name = t.tensor_type.name
        types[name] += 1
        nbytes[name] += int(t.n_bytes)
        modules[t.name] = name
        if name not in FLOAT_TYPES:
            values += int(t.n_elements)
    quantized = {k: v for k, v in types.items() if k not in FLOAT_TYPES}
    main = max(quantized, key=lambda k: nbytes[k]) if quantized else max(types, key=lambda k: nbytes[k])
    qbytes = sum(nbytes[k] for k in quantized)
    total = sum(nbytes.values())
    return {
        "name": f"gguf:{main}",
        "source": "checkpoint",
        "format": "gguf",
        "ggml_types": dict(sorted(types.items())),
        "ggml_type_bytes": dict(sorted(nbytes.items())),
        "bits": 8 * qbytes / values if values else None,  # mean over the quantized tensors, scales included
        "group_size": GGML_QUANT_SIZES[GGMLQuantizationType[main]][0] if quantized else None,
        "quantized_modules": sum(quantized.values()),
        "weight_bytes": total,
        "full_precision_bytes": total - qbytes,
        "full_precision_fraction": (total - qbytes) / total if total else 0.0,
        "modules": modules,
    }


# torchao configs whose checkpoints transformers reloads as ``Int8Tensor`` weights, which lit-ppl can split and shard.
TORCHAO_READABLE = ("Int8WeightOnlyConfig",)


def _needs() -> dict[str, tuple[str | None, str]]:
    """quant_method (transformers' names) -> what it needs that this installation or device lacks (None: nothing)."""
    from transformers.utils.quantization_config import QuantizationMethod as Q

    return {
        Q.COMPRESSED_TENSORS.value: (
            "compressed_tensors",
            "the compressed-tensors package (pip install compressed-tensors)",
        ),
        Q.GPTQ.value: (None, "a GPTQ kernel (gptqmodel) on a CUDA device"),
        Q.AWQ.value: (None, "an AWQ kernel (autoawq) on a CUDA device"),
        Q.BITS_AND_BYTES.value: (None, "bitsandbytes on a CUDA device"),
    }


def hf_description(path: str, root: Path, quantization_config: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face checkpoint's ``quantization_config`` as ``results.json["quant"]`` (``source: checkpoint``), or
    one line saying why lit-ppl cannot evaluate it here."""
    import importlib.util

    import torch

    method = str(quantization_config.get("quant_method", "unknown"))
    if method in _needs():
        module, need = _needs()[method]
        if module is None and not torch.cuda.is_available():
            raise LitPplError(f"model.path={path!r} is a {method} checkpoint: evaluating it needs {need}; none here")
        if module is not None and importlib.util.find_spec(module) is None:
            raise LitPplError(f"model.path={path!r} is a {method} checkpoint: evaluating it needs {need}")
        return {"name": method, "source": "checkpoint", "format": method, "quantization_config": quantization_config}
    if method != "torchao":
        return {"name": method, "source": "checkpoint", "format": method, "quantization_config": quantization_config}
    kind = quantization_config.get("quant_type", {}).get("default", {})
    name, data = kind.get("_type", "unknown"), kind.get("_data", {})
    if name not in TORCHAO_READABLE:
        raise LitPplError(
            f"model.path={path!r} is a torchao {name} checkpoint, which transformers cannot reload into tensors "
            f"lit-ppl can run (it reads {', '.join(TORCHAO_READABLE)} checkpoints); evaluate the float checkpoint "
            "with on-the-fly quantization instead (quant=int4, quant=int8, ...)"
        )
    granularity = data.get("granularity", {}).get("_type") or ("PerGroup" if data.get("group_size") else "PerRow")
    modules, total, quantized = _safetensors_layout(root)
    return {
        "name": "torchao:int8",
        "source": "checkpoint",
        "format": "torchao",
        "config": name,
        "bits": 8,
        "group_size": data.get("group_size") if granularity != "PerRow" else "per row",
        "quantized_modules": len(modules),
        "modules": modules,
        "weight_bytes": total,
        "full_precision_bytes": total - quantized,
        "full_precision_fraction": (total - quantized) / total if total else 0.0,
    }


def _safetensors_layout(root: Path) -> tuple[list[str], int, int]:
    """From the safetensors headers alone: the modules stored as torchao tensors (``<module>._weight_qdata``), all
    tensors' bytes, and the bytes of those modules' tensors (codes, scales, zero points)."""
    from safetensors import safe_open

    modules: set[str] = set()
    sizes: dict[str, int] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118  (safe_open is no dict)
                piece = st.get_slice(key)
                n = 1
                for d in piece.get_shape():
                    n *= d
                sizes[key] = n * _DTYPE_BYTES.get(piece.get_dtype(), 4)
                if key.endswith("._weight_qdata"):
                    modules.add(key.removesuffix("._weight_qdata"))
    quantized = sum(v for k, v in sizes.items() if k.rpartition("._weight_")[0] in modules)
    return sorted(modules), sum(sizes.values()), quantized


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
