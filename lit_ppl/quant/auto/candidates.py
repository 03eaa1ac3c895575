"""``quant=auto``'s candidates: what each layer would hold under each scheme, and the model with some swapped in.

:class:`Candidates` assigns every uniform scheme of ``quant.schemes`` (int4 by ``quant.method`` with the group
fallback, the others by round-to-nearest) and takes the calibrated methods' statistics once, on the float model,
reduced over the ranks (:meth:`lit_ppl.quant.methods.Method.observe`); a layer's quantized weight is built when
asked. With ``quant.auto_embeddings`` the output head and the input embeddings are candidates too, by
round-to-nearest (AWQ and GPTQ calibrate a linear layer's inputs; a lookup table has none): a tied pair is one
candidate, named by its first module (:meth:`Candidates.modules` names both). A mixture-of-experts layer's fused
3D expert weights (``experts.gate_up_proj``, every expert's projection in one parameter) are one candidate each: a
group of experts, measured and chosen together, int8 by round-to-nearest per expert and row (torchao's int4 configs
take no 3D weight); the float model and the candidates then run transformers' eager experts loop, as an applied
policy does. :func:`installed` swaps weights (and AWQ's input pre-scales) into the model, in every module sharing
the weight, and restores the float ones.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lit_ppl.config.quant import QuantConfig
from lit_ppl.parallel.float_rows import rows_group, whole_weight
from lit_ppl.parallel.quantized_rows import QuantizedRows, RowShard
from lit_ppl.quant.assign import Rule, assign, rules_from_cfg
from lit_ppl.quant.calibrated.stream import Where
from lit_ppl.quant.calibrated.text import Calibration
from lit_ppl.quant.methods import RTN, Choice, Method, Statistics
from lit_ppl.quant.schemes import NONE, PACKED_INT4, Scheme, split_problem

log = logging.getLogger(__name__)

TP_WHY = "under tensor parallelism: "  # a scheme a row-parallel slice cannot take (see kind_rules)


class Candidates:
    """Per layer and scheme of ``kinds``, what the layer would hold: built when asked (one layer at a time in
    memory) from the choices of the uniform scheme and the statistics of the float model."""

    def __init__(self, lm: nn.Module, cfg: QuantConfig, kinds: list[str], calibration: Calibration, at: Where) -> None:
        self.lm, self.cfg = lm, cfg
        self.choices: dict[str, dict[str, Choice]] = {}  # kind -> layer -> choice
        self.solved: dict[str, torch.Tensor] = {}  # the costly methods' tensors, built once
        self.twins: dict[str, list[str]] = {}  # a tied weight's first module -> the others holding it
        self.routed = False  # some candidates are groups of experts, behind a router
        for kind in kinds:
            todo, report, targets = assign(lm, kind_rules(lm, cfg, kind), cfg.backend, cfg.group_fallback)
            self.routed = self.routed or any(targets[n].kind == "experts" for n in todo)
            for name, entry in report.items():
                if "tied_to" in entry and name not in self.twins.setdefault(entry["tied_to"], []):
                    self.twins[entry["tied_to"]].append(name)
            self.choices[kind] = todo
            split = [n for n, e in report.items() if str(e.get("rule")).startswith(TP_WHY)]
            if split:
                why = report[split[0]]["rule"].removeprefix(TP_WHY).split(";")[0]
                log.warning(
                    "quant=auto: %d layers can take no %s under tensor parallelism (%s: %s)",
                    len(split),
                    kind,
                    split[0],
                    why,
                )
        if self.routed:  # torchao's tensors run in F.linear, not in the grouped-matmul kernels (as quant.apply does)
            lm.set_experts_implementation("eager")
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
        names = {n for todo in self.choices.values() for n in todo}
        return sorted(names, key=lambda n: (order.get(n, order.get(n.rpartition(".")[0])), n))  # experts: by module

    @property
    def weights(self) -> int:
        """The candidates' weights in all (a tied table once): what a size budget's bits are per."""
        return sum(self.tensor(n).numel() for n in self.layers)

    def tensor(self, name: str) -> torch.Tensor:
        """The float weight the candidate ``name`` replaces."""
        return getattr(*weight_slot(self.lm, name))

    def modules(self, name: str) -> list[str]:
        """The modules whose weight the candidate ``name`` replaces: itself, and the modules tied to it (a tied
        head/embedding table: both)."""
        return [name, *self.twins.get(name, [])]

    def scheme(self, name: str, kind: str) -> tuple[Scheme, str] | None:
        """The scheme (group size fitted) and method name ``kind`` gives ``name``, or ``None`` if it cannot."""
        chosen = self.choices[kind].get(name)
        return None if chosen is None else (chosen.scheme, chosen.method.name)

    def weight(self, name: str, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(quantized weight, input pre-scale or None)`` of ``name`` under ``kind``, whole."""
        weight, pre = self.held(name, kind)
        return whole_weight(weight), pre

    def held(self, name: str, kind: str) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor | None]:
        """:meth:`weight`, by rows where the float weight is held by rows (:mod:`lit_ppl.parallel.float_rows`): this
        rank's rows of the quantized weight, gathered when used; a layout torchao does not split by rows whole."""
        choice = self.choices[kind][name]
        key = f"{name}:{kind}"
        if key in self.solved:
            return self.solved[key], None
        weight = whole_weight(self.tensor(name)).detach()  # gathered where held by rows (every rank, in order)
        quantized, pre = choice.method.candidate(weight, choice, self.stats.get(name), self.cfg)
        group = rows_group(self.tensor(name))
        if group is not None and type(quantized) is not torch.Tensor and QuantizedRows.splits(quantized):
            quantized = QuantizedRows(quantized, group)
        if choice.method.costly:  # solved once, kept (a layer's quantized bytes, by rows where held so) every round
            self.solved[key] = quantized
        return quantized, pre


def kind_rules(lm: nn.Module, cfg: QuantConfig, kind: str) -> list[Rule]:
    """The rules of the uniform scheme ``kind`` (int4 by ``quant.method``, int8 by round-to-nearest); with
    ``quant.auto_embeddings`` the head and the embeddings take it too, by round-to-nearest."""
    method = cfg.method if kind == "int4" else RTN.name
    rules = rules_from_cfg(dataclasses.replace(cfg, name=kind, method=method))
    linear = rules[-1]  # the catch-all linear rule (the head rule of quant.head=false before it is dropped)
    # Under tensor parallelism a row-parallel slice that would quantize unlike its whole row cannot take the scheme.
    split = [
        Rule(NONE, match=f"^{re.escape(name)}$", why=f"{TP_WHY}{problem}")
        for name, module in lm.named_modules()
        if (problem := split_problem(linear.scheme, module, linear.method.calibrated))
    ]
    rules = [*split, *rules]
    if not cfg.auto_embeddings:
        return rules
    why = f"quant=auto {kind} (head and embeddings by {RTN.name})"
    roles = {"head": linear.scheme, "embeddings": linear.scheme}
    if kind == "int4" and cfg.backend in PACKED_INT4:  # the packed kernels run F.linear only: no int4 lookup table
        why = f"quant.backend={cfg.backend} has no int4 embedding lookup"
        tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
        roles = {"head": NONE if tied else linear.scheme, "embeddings": NONE}
    return [*split, *(Rule(scheme, role=role, why=why) for role, scheme in roles.items()), linear]


def weight_slot(lm: nn.Module, name: str) -> tuple[nn.Module, str]:
    """``(module, attribute)`` holding the candidate ``name``'s weight: a module's ``weight``, or a fused expert
    parameter by its own name."""
    parent, _, attr = name.rpartition(".")
    owner = lm.get_submodule(parent)
    child = getattr(owner, attr)
    return (child, "weight") if isinstance(child, nn.Module) else (owner, attr)


@contextmanager
def installed(
    lm: nn.Module, weights: dict[str, tuple[torch.Tensor | QuantizedRows, torch.Tensor | None]]
) -> Iterator[None]:
    """The model with these layers' weights (and AWQ input pre-scales) swapped in, restored on exit; a weight
    other modules share (a tied head and embedding table) is swapped in each of them, so the tie holds. A weight
    held by rows (:meth:`Candidates.held`) is gathered for each call of its layer and dropped after."""
    sharing: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in lm.modules() if weights else ():
        for attr, held in module.named_parameters(recurse=False):
            sharing.setdefault(id(held), []).append((module, attr))
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    handles = []
    try:
        for name, (weight, pre) in weights.items():
            module, attr = weight_slot(lm, name)
            rows = weight if isinstance(weight, QuantizedRows) else None
            new = nn.Parameter(weight.mine() if rows is not None else weight, requires_grad=False)
            for holder, held in sharing.get(id(getattr(module, attr)), [(module, attr)]):
                saved.append((holder, held, getattr(holder, held)))
                setattr(holder, held, new)
            if rows is not None:  # after the float rows' hooks, which leave a weight not held by them as it is
                handles += RowShard(module, rows).handles
            if pre is not None:
                handles.append(module.register_forward_pre_hook(lambda _, a, s=pre: (a[0] * s, *a[1:])))
        yield
    finally:
        for h in handles:
            h.remove()
        for holder, held, weight in reversed(saved):
            setattr(holder, held, weight)
