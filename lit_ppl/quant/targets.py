"""What in a causal LM can be quantized: its linear layers, embeddings and fused expert weights, by role.

Architectures store their projections in several ways, and torchao's weight-only configs replace a module's
``weight`` with a tensor subclass that only ``F.linear`` (and ``F.embedding``) know how to run:

* ``nn.Linear`` — quantized as is.
* transformers' ``Conv1D`` (GPT-2 and its derivatives) computes ``x @ W + b`` with ``W`` stored ``(in, out)``;
  it becomes an ``nn.Linear`` holding ``Wᵀ``, the same function.
* Falcon's ``FalconLinear`` computes ``x @ W.T + b``, the same function as ``nn.Linear``, but with a matrix
  transpose that torchao's tensors do not implement; it becomes a plain ``nn.Linear`` sharing its parameters.
* Any other ``nn.Linear`` subclass with its own ``forward`` cannot be known to be equivalent: quantizing it is
  refused, naming its class.
* Mixture-of-experts layers in transformers ≥ 5 keep every expert's projection in one 3D parameter
  (``experts.gate_up_proj``, ``[experts, out, in]``); torchao's INT8 configs quantize such a parameter by name,
  and the experts then run transformers' ``eager`` loop (``F.linear`` per expert), since its grouped-matmul
  kernels take no quantized tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lit_ppl.config.values import QUANT_ROLES

ROLES = QUANT_ROLES


@dataclass(frozen=True)
class Target:
    """One quantizable weight: a module's ``weight`` (``kind`` linear/embedding) or a 3D expert parameter."""

    name: str  # module name, or the parameter's name for experts
    kind: str  # "linear" | "embedding" | "experts"
    roles: frozenset[str]

    def weight(self, lm: nn.Module) -> torch.Tensor:
        return lm.get_parameter(self.name) if self.kind == "experts" else lm.get_submodule(self.name).weight


def foreign_forward(module: nn.Module) -> bool:
    """An ``nn.Linear`` (sub)class whose ``forward`` is not ``nn.Linear``'s: it may not call ``F.linear``.

    lit-ppl's own subclasses that do (the tensor-parallel row layer) say so with ``calls_f_linear = True``.
    """
    own = getattr(type(module), "calls_f_linear", False)
    return isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward and not own


def to_plain_linear(lm: nn.Module) -> dict[str, str]:
    """Replace ``Conv1D`` and ``FalconLinear`` modules by equivalent ``nn.Linear``; ``{name: former class}``."""
    from transformers.pytorch_utils import Conv1D

    converted: dict[str, str] = {}
    for name, module in list(lm.named_modules()):
        cls = type(module).__name__
        if isinstance(module, Conv1D):
            weight = module.weight.detach()  # (in, out)
            linear = nn.Linear(weight.shape[0], weight.shape[1], bias=module.bias is not None)
            linear = linear.to(device=weight.device, dtype=weight.dtype)
            linear.weight = nn.Parameter(weight.t().contiguous(), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
        elif cls == "FalconLinear":
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear = linear.to(device=module.weight.device, dtype=module.weight.dtype)
            linear.weight, linear.bias = module.weight, module.bias
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(lm.get_submodule(parent), child, linear)
        converted[name] = cls
    return converted


def expert_parameters(module: nn.Module) -> list[str]:
    """The fused 3D expert weights of a transformers ``*Experts`` module (names relative to it)."""
    if not type(module).__name__.endswith("Experts"):
        return []
    return [n for n, p in module.named_parameters(recurse=False) if p.ndim == 3]


def find_targets(lm: nn.Module) -> dict[str, Target]:
    """Every quantizable weight of ``lm`` by name, with its roles (a weight may have several)."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    inner: dict[str, set[str]] = {}
    for name, mod in lm.named_modules():
        kind = type(mod).__name__.lower()
        role = "attention" if "attention" in kind else "mlp" if ("mlp" in kind or "feedforward" in kind) else None
        if role is None and ("moe" in kind or "sparse" in kind) and any(expert_parameters(m) for m in mod.modules()):
            role = "mlp"  # Qwen2MoeSparseMoeBlock, MixtralSparseMoeBlock, ...
        if role:  # everything below an attention/MLP block plays that block's role
            for sub, _ in mod.named_modules():
                inner.setdefault(f"{name}.{sub}".strip("."), set()).add(role)
    out: dict[str, Target] = {}
    for name, mod in lm.named_modules():
        roles = set(inner.get(name, ()))
        if isinstance(mod, nn.Linear | nn.Embedding):
            kind = "embedding" if isinstance(mod, nn.Embedding) else "linear"
            roles.add("embeddings" if kind == "embedding" else "linear")
            if mod is head:
                roles.add("head")
            out[name] = Target(name, kind, frozenset(roles))
        for param in expert_parameters(mod):
            full = f"{name}.{param}"
            out[full] = Target(full, "experts", frozenset(roles | {"experts", "linear", "mlp"}))
    return out
