"""A GGUF file's weights read into the model a block of rows at a time, each rank keeping its part.

Each tensor is dequantized by gguf-py (llama.cpp's definitions, in numpy) and renamed, un-permuted or reshaped by
transformers' own GGUF tensor processors and name map — what ``from_pretrained(gguf_file=...)`` does. Written here
because transformers' loader dequantizes every tensor into one state dict before the model takes any (a whole float
copy of the model beside it: peak 2.76 GB for a 1.05 GB model, 1.78 GB this way; benchmarks/README.md). A tensor the
processor passes through unchanged (nearly all) is dequantized only in the rows being copied.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.model.checkpoint import aliases, key_problem

DEQUANTIZE_BYTES = 4 * 2**20  # the float32 rows dequantized at once


class GgufParts:
    """The tensors of ``lm`` (as built, on the meta device: taken before any split) in a GGUF file, by the model's
    names; iterate to read them one at a time: (model name, a handle that dequantizes the rows it is indexed with, or
    the whole float32 tensor where the processor rearranged it). A missing or misshapen tensor: one line."""

    def __init__(self, model_path: str, file: Path, lm: nn.Module) -> None:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        self.model_path, self.reader = model_path, GGUFReader(str(file))  # a memory map: no tensor read yet
        field = self.reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
        # The processors read the config's head counts under transformers' names: the model's own config has them.
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=lm.config.to_dict())
        self.names = get_gguf_hf_weights_map(lm, self.processor)  # GGUF name → model name
        meta = lm.state_dict()
        self.shapes = {name: tuple(t.shape) for name, t in meta.items()}
        self.groups = [g for g in aliases(lm, meta) if g[0] in dict(lm.named_parameters(remove_duplicate=False))]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        parsed: dict[str, Any] = {"tensors": {}}  # where a processor assembles tensors it fuses (experts)
        read: set[str] = set()
        for tensor in self.reader.tensors:
            lazy = _Rows(tensor.data, tensor.tensor_type)
            if lazy.passes(self.processor, tensor.name, self.names):
                name, whole = tensor.name, lazy
            else:
                done = self.processor.process(
                    weights=_dequantized(tensor.data, tensor.tensor_type),
                    name=tensor.name,
                    tensor_key_mapping=self.names,
                    parsed_parameters=parsed,
                )
                name, whole = done.name, _tensor(done.weights)
            if name in self.names:  # transformers drops the rest too (llama.cpp's rope_freqs, ...)
                read.add(self.names[name])
                yield self.names[name], self._checked(self.names[name], whole)
        for name, weight in parsed["tensors"].items():
            read.add(name)
            yield name, self._checked(name, weight)
        missing = [g[0] for g in self.groups if not read & set(g)]
        problem = key_problem(self.model_path, missing, [])
        if problem:
            raise LitPplError(problem)

    def _checked(self, name: str, weight: Any) -> Any:
        shape = self.shapes.get(name)
        if shape is not None and tuple(weight.shape) != shape:
            raise LitPplError(
                key_problem(self.model_path, [], [], [f"{name} (checkpoint {list(weight.shape)}, model {list(shape)})"])
            )
        return weight


def _dequantized(data: np.ndarray, qtype: Any) -> np.ndarray:
    """gguf-py's ``dequantize`` a block of rows at a time into one float32 array: its numpy temporaries, several
    times its output, stay a block's size, not the tensor's."""
    from gguf import dequantize

    if data.ndim < 2:
        return dequantize(data, qtype)
    flat = data.reshape(-1, data.shape[-1])
    first = dequantize(flat[:1], qtype)
    out = np.empty((len(flat), first.shape[1]), dtype=first.dtype)
    step = max(1, DEQUANTIZE_BYTES // first.nbytes)
    for r in range(0, len(flat), step):
        out[r : r + step] = dequantize(flat[r : r + step], qtype)
    return out.reshape(*data.shape[:-1], first.shape[1])


class _Rows:
    """A 2-D GGUF tensor that the architecture's processor passes through unchanged (all but a few: Llama's query and
    key rows are un-permuted), dequantized only where it is indexed: a rank's rows, a block of them at a time."""

    def __init__(self, data: np.ndarray, qtype: Any) -> None:
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_from_byte_shape

        self.data, self.qtype = data, qtype
        floats = qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
        self.shape = tuple(data.shape) if floats else tuple(quant_shape_from_byte_shape(data.shape, qtype))

    def passes(self, processor: Any, name: str, names: dict[str, str]) -> bool:
        """Whether ``processor`` gives this tensor back as it is, under its own name (asked of a stand-in of its
        shape that holds no memory)."""
        if len(self.shape) != 2 or name not in names:
            return False
        probe = np.broadcast_to(np.zeros((), dtype=np.float32), self.shape)
        done = processor.process(weights=probe, name=name, tensor_key_mapping=names, parsed_parameters={"tensors": {}})
        return done.name == name and done.weights is probe

    def __getitem__(self, region: tuple[slice, ...]) -> torch.Tensor:
        from gguf import dequantize

        rows, columns = region
        return _tensor(dequantize(self.data[rows], self.qtype)[:, columns])


def _tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor; copied where it is the file's read-only map (an F32 tensor: gguf-py returns a view)."""
    return torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable else array.copy())
