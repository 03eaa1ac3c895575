"""``quant=auto``'s candidates: what each layer would hold under each scheme, and the model with some swapped in.

:class:`Candidates` assigns every uniform scheme of ``quant.schemes`` (int4 by ``quant.method`` with the group
fallback, the others by round-to-nearest) and takes the calibrated methods' statistics once, on the float model,
reduced over the ranks (:meth:`lit_ppl.quant.methods.Method.observe`); a layer's quantized weight is built when
asked. :func:`installed` swaps weights (and AWQ's input pre-scales) into the model and restores the float ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lit_ppl.config.quant import QuantConfig
from lit_ppl.errors import LitPplError
from lit_ppl.quant.assign import assign, rules_from_cfg
from lit_ppl.quant.calibrated.stream import Where
from lit_ppl.quant.calibrated.text import Calibration
from lit_ppl.quant.methods import RTN, Choice, Method, Statistics
from lit_ppl.quant.schemes import Scheme


class Candidates:
    """Per layer and scheme of ``kinds``, what the layer would hold: built when asked (one layer at a time in
    memory) from the choices of the uniform scheme and the statistics of the float model."""

    def __init__(self, lm: nn.Module, cfg: QuantConfig, kinds: list[str], calibration: Calibration, at: Where) -> None:
        self.lm, self.cfg = lm, cfg
        self.choices: dict[str, dict[str, Choice]] = {}  # kind -> layer -> choice
        self.solved: dict[str, torch.Tensor] = {}  # the costly methods' tensors, built once
        for kind in kinds:
            method = cfg.method if kind == "int4" else RTN.name
            todo, _, targets = assign(
                lm, rules_from_cfg(dataclasses.replace(cfg, name=kind, method=method)), cfg.backend, cfg.group_fallback
            )
            experts = sorted(n for n in todo if targets[n].kind != "linear")
            if experts:
                raise LitPplError(
                    f"quant=auto measures linear layers; {experts[0]} is {targets[experts[0]].kind} weights: "
                    "quantize them with a quant=policy rule"
                )
            self.choices[kind] = todo
        calibrated: dict[Method, dict[str, Choice]] = {}
        for name, choice in self.choices.get("int4", {}).items():
            if choice.method.calibrated:
                calibrated.setdefault(choice.method, {})[name] = choice
        self.stats: Statistics = {}
        for method, layers in calibrated.items():
            self.stats.update(method.observe(lm, layers, calibration, at, cfg) or {})

    @property
    def layers(self) -> list[str]:
        """Every layer some scheme can take, in forward order."""
        order = {n: i for i, (n, _) in enumerate(self.lm.named_modules())}
        return sorted({n for todo in self.choices.values() for n in todo}, key=order.__getitem__)

    def scheme(self, name: str, kind: str) -> tuple[Scheme, str] | None:
        """The scheme (group size fitted) and method name ``kind`` gives ``name``, or ``None`` if it cannot."""
        chosen = self.choices[kind].get(name)
        return None if chosen is None else (chosen.scheme, chosen.method.name)

    def weight(self, name: str, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(quantized weight, input pre-scale or None)`` of ``name`` under ``kind``."""
        choice = self.choices[kind][name]
        key = f"{name}:{kind}"
        if key in self.solved:
            return self.solved[key], None
        weight = self.lm.get_submodule(name).weight.detach()
        quantized, pre = choice.method.candidate(weight, choice, self.stats.get(name), self.cfg)
        if choice.method.costly:  # solved once, kept (a layer's quantized bytes) for every round
            self.solved[key] = quantized
        return quantized, pre


@contextmanager
def installed(lm: nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> Iterator[None]:
    """The model with these layers' weights (and AWQ input pre-scales) swapped in, restored on exit."""
    saved, handles = {}, []
    try:
        for name, (weight, pre) in weights.items():
            module = lm.get_submodule(name)
            saved[name] = module.weight
            module.weight = nn.Parameter(weight, requires_grad=False)
            if pre is not None:
                handles.append(module.register_forward_pre_hook(lambda _, a, s=pre: (a[0] * s, *a[1:])))
        yield
    finally:
        for h in handles:
            h.remove()
        for name, weight in saved.items():
            lm.get_submodule(name).weight = weight
