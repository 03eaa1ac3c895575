"""``quant=auto``'s candidates: what each layer would hold under each scheme, and the model with some swapped in.

:class:`Candidates` plans every uniform scheme of ``quant.schemes`` (int4 by ``quant.method`` with the group
fallback, int8 by round-to-nearest) and takes AWQ's and GPTQ's statistics once, on the float model, reduced over the
ranks (:mod:`lit_ppl.quant.awq`, :mod:`lit_ppl.quant.gptq`); a layer's quantized weight is built when asked.
:func:`installed` swaps weights (and AWQ's input pre-scales) into the model and restores the float ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.quant.calibration import Calibration
from lit_ppl.quant.plan import Scheme, gptq_config, plan, rules_from_cfg, torchao_config


class Candidates:
    """Per layer and scheme of ``kinds``, what the layer would hold: built when asked (one layer at a time in
    memory) from the plan of the uniform scheme and, for AWQ and GPTQ, statistics of the float model."""

    def __init__(
        self, lm: nn.Module, cfg: dict[str, Any], kinds: list[str], calibration: Calibration, at: tuple[int, int]
    ) -> None:
        from lit_ppl.quant.gptq_solver import GptqOptions

        self.lm, self.opts = lm, GptqOptions.from_cfg(cfg["gptq"])
        self.choices: dict[str, dict[str, tuple[Scheme, str | None, str]]] = {}  # kind -> layer -> plan
        self.solved: dict[str, torch.Tensor] = {}  # GPTQ's tensors
        for kind in kinds:
            method = cfg["method"] if kind == "int4" else "rtn"
            todo, _, targets = plan(
                lm, rules_from_cfg({**cfg, "name": kind, "method": method}), cfg["backend"], cfg["group_fallback"]
            )
            experts = sorted(n for n in todo if targets[n].kind != "linear")
            if experts:
                raise LitPplError(
                    f"quant=auto measures linear layers; {experts[0]} is {targets[experts[0]].kind} weights: "
                    "quantize them with a quant=policy rule"
                )
            self.choices[kind] = todo
        awq = {n: torchao_config(s, k)[0] for n, (s, k, m) in self.choices.get("int4", {}).items() if m == "awq"}
        gptq = {n: gptq_config(s, k) for n, (s, k, m) in self.choices.get("int4", {}).items() if m == "gptq"}
        self.awq: dict[str, dict[str, torch.Tensor]] = {}
        self.gptq: dict[str, dict[str, torch.Tensor]] = {}
        self.gptq_configs = gptq
        if awq:
            from lit_ppl.quant.awq import awq_statistics

            self.awq = awq_statistics(lm, awq, calibration, *at)
        if gptq:
            from lit_ppl.quant.gptq import gptq_hessians

            self.gptq = gptq_hessians(lm, sorted(gptq), calibration, *at)

    @property
    def layers(self) -> list[str]:
        """Every layer some scheme can take, in forward order."""
        order = {n: i for i, (n, _) in enumerate(self.lm.named_modules())}
        return sorted({n for todo in self.choices.values() for n in todo}, key=order.__getitem__)

    def scheme(self, name: str, kind: str) -> tuple[Scheme, str] | None:
        """The scheme (group size fitted) and method ``kind`` gives ``name``, or ``None`` if it cannot take it."""
        chosen = self.choices[kind].get(name)
        return None if chosen is None else (chosen[0], chosen[2])

    def weight(self, name: str, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(quantized weight, input pre-scale or None)`` of ``name`` under ``kind``."""
        from lit_ppl.quant.awq import quantize_weight

        scheme, kernel, method = self.choices[kind][name]
        weight = self.lm.get_submodule(name).weight.detach()
        if method == "awq":
            from lit_ppl.quant.awq import best_scale

            s = best_scale(self.awq[name])[1]
            return quantize_weight(weight * s, torchao_config(scheme, kernel)[0]), 1.0 / s
        if method == "gptq":  # seconds per layer: solved once, kept (an int4 layer's bytes) for every round
            from lit_ppl.quant.gptq import layer_gptq

            if name not in self.solved:
                config, torchao = self.gptq_configs[name]
                self.solved[name] = layer_gptq(self.gptq[name], weight, config, torchao, self.opts)[0]
            return self.solved[name], None
        return quantize_weight(weight, torchao_config(scheme, kernel, method)[0]), None


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
