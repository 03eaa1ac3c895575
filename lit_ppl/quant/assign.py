"""Which scheme, kernel and method each quantizable weight gets, or why it gets none: rules → choices.

A :class:`Rule` (from a ``quant`` config: :func:`rules_from_cfg`) gives the modules it matches a
:class:`~lit_ppl.quant.schemes.Scheme` and a method (an entry of :data:`lit_ppl.quant.methods.METHODS`).
:func:`assign` decides every target of :mod:`lit_ppl.quant.targets` (``nn.Linear``, ``nn.Embedding``, fused expert
weights): the first matching rule wins, an int4 layer whose ``in_features`` the group size does not divide takes
the largest group size below it that does (:func:`~lit_ppl.quant.schemes.fit_group`), a layer a scheme cannot take
at all is listed with the reason, and what cannot run at all (a method torchao lacks here, a tensor-parallel slice
that would quantize differently, tied weights given two schemes) is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_ppl.config.quant import QuantConfig
from lit_ppl.config.values import check_regex
from lit_ppl.errors import LitPplError
from lit_ppl.quant.methods import RTN, Choice, Method, method
from lit_ppl.quant.schemes import NONE, Scheme, fit_group, int4_backend, shape_problem, split_problem
from lit_ppl.quant.targets import ROLES, Target, find_targets, foreign_forward


@dataclass(frozen=True)
class Rule:
    """Modules whose name matches ``match`` (``re.search``) or that play ``role`` get ``scheme`` by ``method``."""

    scheme: Scheme
    match: str | None = None
    role: str | None = None
    why: str = ""
    method: Method = RTN
    given: str | None = None  # where a rule the user wrote sits (quant.rules[i]): it must match some layer

    def __post_init__(self) -> None:
        check_regex(f"{self.given or 'quant.rules'}.match", self.match)

    def matches(self, name: str, roles: set[str]) -> bool:
        return (self.match is not None and re.search(self.match, name) is not None) or self.role in roles

    def describe(self) -> str:
        return self.why or (f"role {self.role}" if self.role else f"match {self.match!r}")


def rules_from_cfg(cfg: QuantConfig) -> list[Rule]:
    """The ordered rules of a ``quant`` config: one catch-all rule for ``int8``/``int8dq``/``int4``, or ``rules``."""
    if cfg.name == "policy":
        rules = []
        for i, r in enumerate(cfg.rules or []):
            if ("match" in r) == ("role" in r):
                raise LitPplError(f"quant.rules[{i}] needs exactly one of 'match' (a regex) or 'role', got {r}")
            if r.get("role") is not None and r["role"] not in ROLES:
                raise LitPplError(f"quant.rules[{i}].role={r['role']!r} is not one of {', '.join(ROLES)}")
            scheme = Scheme(r.get("config", "none"), r.get("group_size", cfg.group_size))
            why = f"rule {i} ({r.get('role') or r.get('match')})"
            chosen = method(r.get("method", cfg.method), why)
            rules.append(Rule(scheme, r.get("match"), r.get("role"), why, chosen, f"quant.rules[{i}]"))
        if not rules:
            raise LitPplError("quant=policy needs quant.rules: a list of {role|match, config[, group_size]}")
        return rules
    scheme = Scheme(cfg.name, cfg.group_size if cfg.name == "int4" else None)
    keep_head = [] if cfg.head else [Rule(NONE, role="head", why="output head kept (quant.head=false)")]
    return [
        *keep_head,
        Rule(scheme, role="linear", why=f"quant={cfg.name}", method=method(cfg.method, f"quant={cfg.name}")),
    ]


def _check_matched(lm: nn.Module, rules: list[Rule], targets: dict[str, Target]) -> None:
    """A rule the user wrote that matches no layer is a mistake (a typo, another model's names): one line."""
    for rule in rules:
        if rule.given and not any(rule.matches(name, set(t.roles)) for name, t in targets.items()):
            what = f"role={rule.role!r}" if rule.role else f"match={rule.match!r}"
            raise LitPplError(
                f"{rule.given} ({what}) matches no layer of {type(lm).__name__} (its layers are named like "
                f"{', '.join(list(targets)[:2]) or 'none'}): fix the rule or remove it"
            )


def _decide(lm: nn.Module, rules: list[Rule], targets: dict[str, Target]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each target's first matching ``(scheme, rule)`` and the tied twins (second name → first), which must agree."""
    decided: dict[str, tuple[Scheme, Rule | None]] = {}
    for name, target in targets.items():
        rule = next((r for r in rules if r.matches(name, set(target.roles))), None)
        decided[name] = (rule.scheme if rule else NONE, rule)
    owner: dict[int, str] = {}
    tied: dict[str, str] = {}  # second name -> first name holding the same weight
    for name, target in targets.items():
        key = id(target.weight(lm))
        if key in owner:
            tied[name] = owner[key]
        else:
            owner[key] = name
    for second, first in tied.items():
        (s1, r1), (s2, r2) = decided[first], decided[second]
        if r1 and r2 and (s1, r1.method) != (s2, r2.method):
            raise LitPplError(
                f"{first} and {second} share one weight (tied embeddings) but the rules give {s1.label} "
                f"({r1.describe()}) and {s2.label} ({r2.describe()}); give both the same config"
            )
        decided[first] = decided[second] = (s1, r1) if r1 else (s2, r2)
    return decided, tied


def _choose(
    lm: nn.Module,
    name: str,
    target: Target,
    scheme: Scheme,
    rule: Rule,
    where: tuple[str, torch.device | None],
    fallback: bool,
    tied: bool,
) -> tuple[Choice | None, dict[str, Any]]:
    """One target's choice under ``rule`` (``None`` if its shape refuses the scheme) and its report entry's facts;
    ``where``: the int4 backend asked for, and the device of a weight not read yet."""
    weight = target.weight(lm)
    backend, device = where
    device = device if weight.is_meta and device is not None else weight.device
    module = lm.get_submodule(name) if target.kind != "experts" else None
    if module is not None and foreign_forward(module):
        raise LitPplError(
            f"{name} is a {type(module).__name__}, whose forward is not nn.Linear's, so a quantized weight may "
            f"not run in it; keep it in full precision with a quant=policy rule {{match: '{name}', config: none}}"
        )
    refused = split_problem(scheme, module, rule.method.calibrated)
    if refused:
        raise LitPplError(f"{name}: {refused}")
    embedding = target.kind == "embedding"
    kernel = int4_backend(backend, device, weight.dtype, embedding) if scheme.kind == "int4" else None
    refused = rule.method.problem(scheme, kernel, target, tied, rule.describe())
    if refused:
        raise LitPplError(f"{name}: {refused}")
    entry: dict[str, Any] = {}
    fitted = fit_group(scheme, weight, module) if fallback else scheme
    if fitted != scheme:
        entry["requested"], entry["in_features"] = scheme.label, weight.shape[-1]
        entry["adapted"] = f"in_features {weight.shape[-1]} is not a multiple of group_size {scheme.group_size}"
    problem = shape_problem(fitted, kernel, weight)
    if problem:
        entry["requested"], entry["reason"] = entry.get("requested", fitted.label), problem
        entry["in_features"] = weight.shape[-1]
        return None, entry
    return Choice(fitted, kernel, rule.method), {**entry, "config": fitted.label, "method": rule.method.name}


def assign(
    lm: nn.Module,
    rules: list[Rule],
    backend: str = "auto",
    fallback: bool = True,
    device: torch.device | None = None,
) -> tuple[dict[str, Choice], dict[str, dict[str, Any]], dict[str, Target]]:
    """Decide each target: ``({name: choice}, {name: report entry}, targets)`` (a tied twin is quantized through
    its first name, so it has an entry and no choice).

    ``fallback``: an int4 layer whose input features the group size does not divide takes the largest group size
    below it that does, recorded in its entry; otherwise it stays in full precision, listed. ``device``: where a
    weight still on the meta device (read later) will be, for the int4 kernel's choice."""
    targets = find_targets(lm)
    _check_matched(lm, rules, targets)
    decided, tied = _decide(lm, rules, targets)
    choices: dict[str, Choice] = {}
    report: dict[str, dict[str, Any]] = {}
    for name, (scheme, rule) in decided.items():
        target = targets[name]
        entry: dict[str, Any] = {"config": None, "rule": rule.describe() if rule else None}
        if target.kind == "experts":
            entry["kind"] = "experts"
        if name in tied:
            entry["tied_to"] = tied[name]
        if rule is None or scheme.kind == "none":
            entry["reason"] = "no rule matches" if rule is None else f"{rule.describe()} says none"
        else:
            twin = name in tied or name in tied.values()
            choice, facts = _choose(lm, name, target, scheme, rule, (backend, device), fallback, twin)
            entry.update(facts)
            if choice is not None and name not in tied:
                choices[name] = choice
        report[name] = entry
    return choices, report, targets
