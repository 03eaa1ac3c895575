"""A checkpoint's own quantization, as shipped: what ``results.json["quant"]`` says when no quantization was applied.

A GGUF file is read with the ``gguf`` package's ``GGUFReader`` (a memory map of the header: no tensor is
dequantized to describe it); a Hugging Face checkpoint's ``quantization_config`` with transformers' own config.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # GGML types that are not quantized


def gguf_description(path: Path) -> dict[str, Any]:
    """The GGML types a GGUF file holds (tensors and bytes of each), its quantized tensors' mean bits per weight
    and block size, in the ``results.json["quant"]`` shape (``source: checkpoint``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
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
