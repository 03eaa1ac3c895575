"""The quantization plan: which scheme each quantizable weight gets, or why it gets none, and torchao's configs.

A :class:`Rule` (from a ``quant`` config: :func:`rules_from_cfg`) gives the modules it matches a :class:`Scheme`
(``none``, ``int8``, ``int8dq``, ``int4`` with a group size) and a method (``rtn``, ``hqq``, ``awq``, ``gptq``).
:func:`plan` decides every target of :mod:`lit_ppl.quant.targets` (``nn.Linear``, ``nn.Embedding``, fused expert
weights): the first matching rule wins, an int4 layer whose ``in_features`` the group size does not divide takes
the largest group size below it that does (:func:`fit_group`), a layer a scheme cannot take at all is listed with
the reason, and what cannot run at all (a method torchao lacks here, a tensor-parallel slice that
would quantize differently, tied weights given two schemes) is refused. :func:`torchao_config` and
:func:`gptq_base_config` are the torchao configs that :func:`lit_ppl.quant.apply.quantize_model` applies.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_ppl.config.quant import quant_node
from lit_ppl.config.values import GROUP_SIZES, INT4_BACKENDS, QUANT_METHODS, QUANT_SCHEMES, QUANT_SOURCES, check_regex
from lit_ppl.errors import LitPplError
from lit_ppl.quant.targets import ROLES, Target, find_targets, foreign_forward

SCHEMES = QUANT_SCHEMES
SOURCES = QUANT_SOURCES
METHODS = (
    QUANT_METHODS  # round-to-nearest, HQQ (calibration-free), AWQ and GPTQ (calibrated: lit_ppl.quant.calibration)
)


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme: ``kind`` in :data:`SCHEMES`, and the group size of ``int4``."""

    kind: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCHEMES:
            raise LitPplError(f"quantization config {self.kind!r} is not one of {', '.join(SCHEMES)}")
        if self.kind == "int4" and self.group_size not in GROUP_SIZES:
            raise LitPplError(f"int4 needs group_size in {GROUP_SIZES}, got {self.group_size}")

    @property
    def label(self) -> str:
        return f"int4-g{self.group_size}" if self.kind == "int4" else self.kind


NONE = Scheme("none")


@dataclass(frozen=True)
class Rule:
    """Modules whose name matches ``match`` (``re.search``) or that play ``role`` get ``scheme`` by ``method``."""

    scheme: Scheme
    match: str | None = None
    role: str | None = None
    why: str = ""
    method: str = "rtn"
    given: str | None = None  # where a rule the user wrote sits (quant.rules[i]): it must match some layer

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LitPplError(f"quant.method={self.method!r} ({self.why or 'rule'}) is not one of {', '.join(METHODS)}")
        check_regex(f"{self.given or 'quant.rules'}.match", self.match)

    def matches(self, name: str, roles: set[str]) -> bool:
        return (self.match is not None and re.search(self.match, name) is not None) or self.role in roles

    def describe(self) -> str:
        return self.why or (f"role {self.role}" if self.role else f"match {self.match!r}")


def rules_from_cfg(cfg: dict[str, Any]) -> list[Rule]:
    """The ordered rules of a ``quant`` config: one catch-all rule for ``int8``/``int8dq``/``int4``, or ``rules``."""
    cfg = quant_node(cfg)  # every key, the schema's defaults filled in
    name, method = cfg["name"], cfg["method"]
    if name == "policy":
        rules = []
        for i, r in enumerate(cfg["rules"] or []):
            if ("match" in r) == ("role" in r):
                raise LitPplError(f"quant.rules[{i}] needs exactly one of 'match' (a regex) or 'role', got {r}")
            if r.get("role") is not None and r["role"] not in ROLES:
                raise LitPplError(f"quant.rules[{i}].role={r['role']!r} is not one of {', '.join(ROLES)}")
            scheme = Scheme(r.get("config", "none"), r.get("group_size", cfg["group_size"]))
            why = f"rule {i} ({r.get('role') or r.get('match')})"
            rules.append(Rule(scheme, r.get("match"), r.get("role"), why, r.get("method", method), f"quant.rules[{i}]"))
        if not rules:
            raise LitPplError("quant=policy needs quant.rules: a list of {role|match, config[, group_size]}")
        return rules
    scheme = Scheme(name, cfg["group_size"] if name == "int4" else None)
    keep_head = [] if cfg["head"] else [Rule(NONE, role="head", why="output head kept (quant.head=false)")]
    return [*keep_head, Rule(scheme, role="linear", why=f"quant={name}", method=method)]


def uses(rules: list[Rule], method: str) -> bool:
    return any(r.method == method and r.scheme.kind != "none" for r in rules)


def method_problem(rule: Rule, kernel: str | None, target: Target, tied: bool, device: torch.device) -> str | None:
    """Why ``rule.method`` cannot run on this target here (``None`` if it can): torchao's own limits."""
    if rule.method == "rtn":
        return None
    where = f"quant.method={rule.method} ({rule.describe()})"
    if rule.method == "hqq":  # calibration-free: any int4 target, on every backend (torchao's HQQ grids)
        return None if rule.scheme.kind == "int4" else f"{where} chooses int4 group scales: use config int4, or rtn"
    if target.kind != "linear" or tied:
        what = "a tied head/embedding table" if tied else f"an {target.kind} weight"  # embedding or experts
        return f"{where} calibrates on a linear layer's inputs; {what} has none: give it method=rtn"
    if rule.scheme.kind == "int8dq":
        return f"{where} is weight-only in torchao; int8dq also quantizes activations: use config int8, or method=rtn"
    if rule.method == "gptq" and rule.scheme.kind == "int4":
        if kernel == "prototype":
            return (
                f"{where} sets the codes of IntxWeightOnlyConfig's int4 tensor; the CPU bf16 prototype packing has "
                "none to set: use quant.backend=intx, or precision=32-true"
            )
        if kernel == "tinygemm" and importlib.util.find_spec("mslk") is None:
            return (
                f"{where} on tinygemm int4 is torchao's CUDA GPTQ, which needs the mslk package: install it, or use "
                "quant.backend=intx (lit-ppl's GPTQ on torch ops)"
            )
    return None  # AWQ: any backend (lit_ppl.quant.awq pre-scales the input where the tensor cannot)


def gptq_config(scheme: Scheme, kernel: str | None) -> tuple[Any, bool]:
    """The torchao config GPTQ builds a tensor of, and whether torchao's own CUDA GPTQ does it (tinygemm's int4
    layouts, whose codes lit-ppl's solver does not set) rather than :mod:`lit_ppl.quant.gptq_solver`."""
    if kernel == "tinygemm":
        return gptq_base_config(scheme)[0], True
    return torchao_config(scheme, kernel)[0], False


def plan(
    lm: nn.Module, rules: list[Rule], backend: str = "auto", fallback: bool = True
) -> tuple[dict[str, tuple[Scheme, str | None, str]], dict[str, dict[str, Any]], dict[str, Target]]:
    """Decide each target's scheme: ``({name: (scheme, int4 backend, method)}, {name: report entry}, targets)``.

    ``fallback``: an int4 layer whose input features the group size does not divide takes the largest group size
    below it that does (:func:`fit_group`), recorded in its entry; otherwise it stays in full precision, listed."""
    targets = find_targets(lm)
    for rule in rules:
        if rule.given and not any(rule.matches(name, set(t.roles)) for name, t in targets.items()):
            what = f"role={rule.role!r}" if rule.role else f"match={rule.match!r}"
            raise LitPplError(
                f"{rule.given} ({what}) matches no layer of {type(lm).__name__} (its layers are named like "
                f"{', '.join(list(targets)[:2]) or 'none'}): fix the rule or remove it"
            )
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
    apply_: dict[str, tuple[Scheme, str | None, str]] = {}
    report: dict[str, dict[str, Any]] = {}
    for name, (scheme, rule) in decided.items():
        target = targets[name]
        weight = target.weight(lm)
        entry: dict[str, Any] = {"config": None, "rule": rule.describe() if rule else None}
        if target.kind == "experts":
            entry["kind"] = "experts"
        if name in tied:
            entry["tied_to"] = tied[name]
        if rule is None or scheme.kind == "none":
            entry["reason"] = "no rule matches" if rule is None else f"{rule.describe()} says none"
            report[name] = entry
            continue
        module = lm.get_submodule(name) if target.kind != "experts" else None
        if module is not None and foreign_forward(module):
            raise LitPplError(
                f"{name} is a {type(module).__name__}, whose forward is not nn.Linear's, so a quantized weight may "
                f"not run in it; keep it in full precision with a quant=policy rule {{match: '{name}', config: none}}"
            )
        refused = split_problem(scheme, module)
        if refused:
            raise LitPplError(f"{name}: {refused}")
        embedding = target.kind == "embedding"
        kernel = int4_backend(backend, weight.device, weight.dtype, embedding) if scheme.kind == "int4" else None
        refused = method_problem(rule, kernel, target, name in tied or name in tied.values(), weight.device)
        if refused:
            raise LitPplError(f"{name}: {refused}")
        fitted = fit_group(scheme, weight, module) if fallback else scheme
        if fitted != scheme:
            entry["requested"], entry["in_features"] = scheme.label, weight.shape[-1]
            entry["adapted"] = f"in_features {weight.shape[-1]} is not a multiple of group_size {scheme.group_size}"
        scheme = fitted
        problem = shape_problem(scheme, kernel, weight)
        if problem:
            entry["requested"], entry["reason"] = entry.get("requested", scheme.label), problem
            entry["in_features"] = weight.shape[-1]
        else:
            entry["config"], entry["method"] = scheme.label, rule.method
            if name not in tied:  # the tied twin is quantized through its first name
                apply_[name] = (scheme, kernel, rule.method)
        report[name] = entry
    return apply_, report, targets


def split_problem(scheme: Scheme, module: nn.Module | None) -> str | None:
    """Why a tensor-parallel slice of input features would quantize differently from the whole row, if it would.

    A row-parallel layer (:mod:`lit_ppl.parallel.tensor_parallel`) holds ``in_features / tp`` of every row: int8's
    one scale
    per row would be the slice's maximum, not the row's, and an int4 group must not straddle two slices. Either
    would evaluate another model than the same quantization at ``tp=1``.
    """
    full = getattr(module, "full_in_features", None)
    if full is None:
        return None
    if scheme.kind != "int4":
        return (
            f"{scheme.label} scales each output row by its maximum, and under tensor parallelism this layer holds "
            f"{module.in_features} of the row's {full} input features, so its scales would differ from tp=1's; use "
            "quant=int4 (group-wise scales stay within a slice), or keep it in full precision with a quant=policy "
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


def torchao_config(scheme: Scheme, backend: str | None, method: str = "rtn") -> tuple[Any, str]:
    """The torchao config for ``scheme`` (``backend`` resolved by :func:`int4_backend`) and its description;
    ``method="hqq"``: int4 with torchao's HQQ choice of the group scales instead of round-to-nearest's."""
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
    g, hqq = scheme.group_size, method == "hqq"
    algo = {"int4_choose_qparams_algorithm": "hqq"} if hqq else {}  # torchao's default otherwise
    named = ", HQQ qparams" if hqq else ""
    if backend == "tinygemm":
        cfg = Int4WeightOnlyConfig(group_size=g, int4_packing_format="tile_packed_to_4d", **algo)
        return cfg, f"Int4WeightOnlyConfig(group_size={g}, tile_packed_to_4d{named}) (tinygemm, CUDA)"
    if backend == "prototype":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(
            group_size=g, **algo
        ), f"PrototypeInt4WeightOnlyConfig(group_size={g}{named}) (CPU)"
    if hqq:
        from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
            IntxChooseQParamsAlgorithm,
        )

        cfg = IntxWeightOnlyConfig(
            weight_dtype=torch.int4,
            granularity=PerGroup(g),
            intx_choose_qparams_algorithm=IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY,
        )
        return cfg, f"IntxWeightOnlyConfig(int4, PerGroup({g}), HQQ scale-only) (int4 values one per int8, any device)"
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
