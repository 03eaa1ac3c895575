"""Weight quantization with torchao's ``quantize_``: configs, per-module policies, a report, rank consistency.

A *plan* decides, for every quantizable weight of the model (``nn.Linear``, ``nn.Embedding`` and fused expert
weights: :mod:`lit_ppl.quant_targets`), which scheme it gets (``none``, ``int8``, ``int8dq``, ``int4`` with a group
size) or why it gets none; the plan is applied with ``quantize_`` (a ``filter_fn`` per scheme for modules, an
``FqnToConfig`` for expert parameters), and the :class:`QuantReport` records all of it. Nothing is skipped silently:
a layer a scheme cannot take (``in_features`` not divisible by the group size) is listed with the reason.

Tied weights (``tie_word_embeddings``: the output head and the input embeddings are one tensor) are quantized
once, for both, so the tie holds; when the rules give the two different schemes the plan refuses.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lit_ppl.quant_targets import ROLES, Target, find_targets, foreign_forward, to_plain_linear

log = logging.getLogger(__name__)

SCHEMES = ("none", "int8", "int8dq", "int4")
GROUP_SIZES = (32, 64, 128, 256)
INT4_BACKENDS = ("auto", "tinygemm", "prototype", "intx")
SOURCES = ("local", "rank0")
METHODS = ("rtn", "awq", "gptq")  # round-to-nearest, activation-aware (calibrated: lit_ppl.calibrate), GPTQ


class RankMismatchError(RuntimeError):
    """Ranks hold different quantized weights: their results would not be one model's."""


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme: ``kind`` in :data:`SCHEMES`, and the group size of ``int4``."""

    kind: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCHEMES:
            raise ValueError(f"quantization config {self.kind!r} is not one of {', '.join(SCHEMES)}")
        if self.kind == "int4" and self.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 needs group_size in {GROUP_SIZES}, got {self.group_size}")

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

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quant.method={self.method!r} ({self.why or 'rule'}) is not one of {', '.join(METHODS)}")

    def matches(self, name: str, roles: set[str]) -> bool:
        return (self.match is not None and re.search(self.match, name) is not None) or self.role in roles

    def describe(self) -> str:
        return self.why or (f"role {self.role}" if self.role else f"match {self.match!r}")


@dataclass
class QuantReport:
    """What quantization did; ``to_dict()`` goes into ``results.json`` under ``quant``."""

    name: str
    source: str
    backend: dict[str, str] = field(default_factory=dict)  # scheme label -> torchao config and tensor type
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    quantized_params: list[str] = field(default_factory=list)  # names in lm.named_parameters()
    full_precision_bytes: int = 0  # parameters left unquantized (norms, biases, skipped and excluded layers)
    converted: dict[str, str] = field(default_factory=dict)  # modules made nn.Linear first: name -> former class
    consistency: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None  # calibrated methods: the text, its tokens, the time (lit_ppl.calibrate)

    @property
    def quantized_modules(self) -> int:
        return sum(m["config"] is not None for m in self.modules.values())

    @property
    def full_precision_fraction(self) -> float:
        """Share of the original parameter bytes that stayed in full precision."""
        return self.full_precision_bytes / self.weight_bytes_before if self.weight_bytes_before else 0.0

    @property
    def skipped(self) -> dict[str, str]:
        """Modules a rule asked to quantize that could not be, with the reason."""
        return {n: m["reason"] for n, m in self.modules.items() if m.get("requested") and m["config"] is None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "backend": self.backend,
            "weight_bytes_before": self.weight_bytes_before,
            "weight_bytes_after": self.weight_bytes_after,
            "quantized_modules": self.quantized_modules,
            "full_precision_bytes": self.full_precision_bytes,
            "full_precision_fraction": self.full_precision_fraction,
            "skipped": self.skipped,
            "converted": self.converted,
            "modules": self.modules,
            "consistency": self.consistency,
            "calibration": self.calibration,
        }


def rules_from_cfg(cfg: dict[str, Any]) -> list[Rule]:
    """The ordered rules of a ``quant`` config: one catch-all rule for ``int8``/``int8dq``/``int4``, or ``rules``."""
    name = cfg.get("name", "none")
    method = cfg.get("method", "rtn")
    if name == "policy":
        rules = []
        for i, r in enumerate(cfg.get("rules") or []):
            if ("match" in r) == ("role" in r):
                raise ValueError(f"quant.rules[{i}] needs exactly one of 'match' (a regex) or 'role', got {r}")
            if r.get("role") is not None and r["role"] not in ROLES:
                raise ValueError(f"quant.rules[{i}].role={r['role']!r} is not one of {', '.join(ROLES)}")
            scheme = Scheme(r.get("config", "none"), r.get("group_size", cfg.get("group_size")))
            why = f"rule {i} ({r.get('role') or r.get('match')})"
            rules.append(Rule(scheme, r.get("match"), r.get("role"), why, r.get("method", method)))
        if not rules:
            raise ValueError("quant=policy needs quant.rules: a list of {role|match, config[, group_size]}")
        return rules
    scheme = Scheme(name, cfg.get("group_size") if name == "int4" else None)
    keep_head = [] if cfg.get("head", False) else [Rule(NONE, role="head", why="output head kept (quant.head=false)")]
    return [*keep_head, Rule(scheme, role="linear", why=f"quant={name}", method=method)]


def uses(rules: list[Rule], method: str) -> bool:
    return any(r.method == method and r.scheme.kind != "none" for r in rules)


def method_problem(rule: Rule, kernel: str | None, target: Target, tied: bool, device: torch.device) -> str | None:
    """Why ``rule.method`` cannot run on this target here (``None`` if it can): torchao's own limits."""
    if rule.method == "rtn":
        return None
    where = f"quant.method={rule.method} ({rule.describe()})"
    if rule.method == "gptq" and device.type != "cuda":
        return f"{where} needs CUDA (torchao: 'GPTQ only supports CUDA currently'); use method=awq or rtn on CPU"
    if target.kind != "linear" or tied:
        what = "a tied head/embedding table" if tied else f"an {target.kind} weight"  # embedding or experts
        return f"{where} calibrates on a linear layer's inputs; {what} has none: give it method=rtn"
    if rule.scheme.kind == "int8dq":
        return f"{where} is weight-only in torchao; int8dq also quantizes activations: use config int8, or method=rtn"
    if rule.method == "gptq":
        if rule.scheme.kind == "int4" and kernel != "tinygemm":
            return f"{where} on int4 builds torchao's CUDA Int4Tensor: run with precision=bf16-true, or use config int8"
        if rule.scheme.kind == "int4" and importlib.util.find_spec("mslk") is None:
            return f"{where} on int4 needs the mslk package (torchao's int4 GPTQ kernels): install it, or use int8"
        return None
    if rule.scheme.kind == "int4" and kernel != "tinygemm":
        return (
            f"{where} on int4 needs torchao's CUDA int4 tensor (activation pre-scaling; IntxWeightOnlyConfig and the "
            f"CPU prototype lack it): run on a GPU with precision=bf16-true, or use config int8 on {device.type}"
        )
    return None


def plan(
    lm: nn.Module, rules: list[Rule], backend: str = "auto"
) -> tuple[dict[str, tuple[Scheme, str | None, str]], dict[str, dict[str, Any]], dict[str, Target]]:
    """Decide each target's scheme: ``({name: (scheme, int4 backend, method)}, {name: report entry}, targets)``."""
    targets = find_targets(lm)
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
            raise ValueError(
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
            raise ValueError(
                f"{name} is a {type(module).__name__}, whose forward is not nn.Linear's, so a quantized weight may "
                f"not run in it; keep it in full precision with a quant=policy rule {{match: '{name}', config: none}}"
            )
        embedding = target.kind == "embedding"
        kernel = int4_backend(backend, weight.device, weight.dtype, embedding) if scheme.kind == "int4" else None
        refused = method_problem(rule, kernel, target, name in tied or name in tied.values(), weight.device)
        if refused:
            raise ValueError(f"{name}: {refused}")
        problem = shape_problem(scheme, kernel, weight)
        if problem:
            entry["requested"], entry["reason"] = scheme.label, problem
        else:
            entry["config"], entry["method"] = scheme.label, rule.method
            if name not in tied:  # the tied twin is quantized through its first name
                apply_[name] = (scheme, kernel, rule.method)
        report[name] = entry
    return apply_, report, targets


def int4_backend(requested: str, device: torch.device, dtype: torch.dtype, embedding: bool) -> str:
    """Which int4 implementation runs here; a clear error for a combination that cannot run."""
    if requested not in INT4_BACKENDS:
        raise ValueError(f"quant.backend={requested!r} is not one of {', '.join(INT4_BACKENDS)}")
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
        raise ValueError(
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


def torchao_config(scheme: Scheme, backend: str | None) -> tuple[Any, str]:
    """The torchao config for ``scheme`` (``backend`` resolved by :func:`int4_backend`) and its description."""
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
    g = scheme.group_size
    if backend == "tinygemm":
        cfg = Int4WeightOnlyConfig(group_size=g, int4_packing_format="tile_packed_to_4d")
        return cfg, f"Int4WeightOnlyConfig(group_size={g}, tile_packed_to_4d) (tinygemm, CUDA)"
    if backend == "prototype":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=g), f"PrototypeInt4WeightOnlyConfig(group_size={g}) (CPU)"
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


def inner_tensors(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The plain tensors a (possibly torchao) tensor is made of: data, scales, zero points."""
    if not hasattr(t, "__tensor_flatten__"):
        return [("", t)]
    names, _ = t.__tensor_flatten__()
    return [(f"{n}{'.' + s if s else ''}", x) for n in names for s, x in inner_tensors(getattr(t, n))]


def tensor_bytes(t: torch.Tensor) -> int:
    return sum(x.numel() * x.element_size() for _, x in inner_tensors(t))


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's inner tensors (bytes, dtypes and shapes)."""
    h = hashlib.sha256()
    for name, x in inner_tensors(t):
        x = x.detach().contiguous().cpu()
        h.update(f"{name}|{x.dtype}|{tuple(x.shape)}|".encode())
        h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, or ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_consistency(lm: nn.Module, names: list[str]) -> dict[str, Any]:
    """Hash every quantized parameter on every rank and compare; raise naming the modules that differ."""
    import torch.distributed as dist

    params = dict(lm.named_parameters())
    local = {n: digest(params[n]) for n in names if n in params}
    _, size = world()
    total = hashlib.sha256("".join(f"{n}={d};" for n, d in sorted(local.items())).encode()).hexdigest()
    if size == 1:
        return {"world_size": 1, "checked": False, "digest": total}
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, local)
    differing = sorted(
        {
            n
            for r in range(1, size)
            for n in set(gathered[0]) | set(gathered[r])
            if gathered[0].get(n) != gathered[r].get(n)
        }
    )
    if differing:
        bad_ranks = [r for r in range(1, size) if gathered[r] != gathered[0]]
        shown = ", ".join(m.removesuffix(".weight") for m in differing[:20])
        raise RankMismatchError(
            f"quantized weights differ across ranks (ranks {bad_ranks} vs rank 0) in {len(differing)} modules: "
            f"{shown}{' ...' if len(differing) > 20 else ''}. Ranks loaded different weights or their kernels "
            "quantize differently; use quant.source=rank0 to quantize on rank 0 and broadcast"
        )
    return {"world_size": size, "checked": True, "digest": total}


def broadcast_from_rank0(lm: nn.Module, names: list[str]) -> None:
    """Replace every rank's quantized parameters with rank 0's (pickled, one module at a time)."""
    import torch.distributed as dist

    rank, _ = world()
    modules = dict(lm.named_modules())
    for name in names:
        mod_name, _, attr = name.rpartition(".")
        mod = modules[mod_name]
        device = getattr(mod, attr).device
        # Pickled through the CPU: other ranks' tensors may not even have rank 0's types or shapes.
        box = [getattr(mod, attr).detach().cpu() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        setattr(mod, attr, nn.Parameter(box[0].to(device), requires_grad=False))


def quantize_model(lm: nn.Module, cfg: dict[str, Any], calibration: Any = None) -> QuantReport:
    """Apply the ``quant`` config ``cfg`` to ``lm`` in place and return the report.

    ``calibration`` (a :class:`lit_ppl.calibrate.Calibration`) is the text of calibrated methods (``awq``,
    ``gptq``).
    """
    from torchao.quantization import FqnToConfig, quantize_

    source = cfg.get("source", "local")
    report = QuantReport(name=cfg.get("name", "none"), source=source)
    report.weight_bytes_before = sum(tensor_bytes(p) for _, p in lm.named_parameters())
    report.converted = to_plain_linear(lm)
    todo, report.modules, targets = plan(lm, rules_from_cfg(cfg), cfg.get("backend", "auto"))
    if not todo:
        if report.skipped:
            first = next(iter(report.skipped.values()))
            raise ValueError(
                f"quant={report.name} would quantize none of the {len(report.skipped)} layers it names ({first}); "
                f"choose quant.group_size among {GROUP_SIZES} that divides the layers' in_features"
            )
        raise ValueError(
            f"quant={report.name} quantizes none of {type(lm).__name__}'s {len(targets)} linear, embedding and "
            "expert weights: no rule gives any of them a config other than none"
        )
    before = {n: tensor_bytes(t.weight(lm)) for n, t in targets.items()}
    twins = {n: e["tied_to"] for n, e in report.modules.items() if "tied_to" in e}
    rank, size = world()
    broadcast = source == "rank0" and size > 1
    experts = {n for n in todo if targets[n].kind == "experts"}
    if experts:
        # torchao's tensors run in F.linear, not in the grouped-matmul kernels of transformers' default experts.
        lm.set_experts_implementation("eager")
        report.backend["experts"] = "transformers' eager experts loop (F.linear per expert)"
    calibrated = {n: torchao_config(s, k)[0] for n, (s, k, m) in todo.items() if m == "awq"}
    gptq = {n: gptq_base_config(s)[0] for n, (s, k, m) in todo.items() if m == "gptq"}
    if calibrated or gptq:
        if calibration is None:
            method = "awq" if calibrated else "gptq"
            raise ValueError(f"quant.method={method} needs calibration text: set quant.calibration.path=FILE")
        from lit_ppl.awq import run_awq
        from lit_ppl.gptq import apply_gptq, gptq_hessians

        for s, k, m in {v for v in todo.values() if v[2] != "rtn"}:
            label = f"{s.label} ({k})" if k and m == "awq" else s.label  # GPTQ's int4 is its own Int4Tensor
            what = f"AWQ scales (lit_ppl.awq) over {torchao_config(s, k)[1]}" if m == "awq" else None
            report.backend[f"{m} {label}"] = what or f"{gptq_base_config(s)[1]}, Hessians reduced by lit_ppl.gptq"
        # Calibrated on the float model before any round-to-nearest layer changes its inputs (torchao's order:
        # every observer sees float activations): GPTQ's Hessians first, then AWQ, then GPTQ's quantization.
        # Under source=rank0, rank 0 alone calibrates on the whole set.
        if not (broadcast and rank != 0):
            where = (0, 1) if broadcast else (rank, size)
            t0 = time.perf_counter()
            hessians = gptq_hessians(lm, sorted(gptq), calibration, *where) if gptq else {}
            choices: dict[str, dict[str, Any]] = {}
            if calibrated:
                choices, report.calibration = run_awq(lm, calibrated, calibration, *where)
            if gptq:
                choices.update(apply_gptq(lm, gptq, hessians))
                info = report.calibration or {**calibration.describe(), "world_size": where[1]}
                methods = "awq+gptq" if calibrated else "gptq"
                report.calibration = {**info, "method": methods, "seconds": time.perf_counter() - t0}
            for name, choice in choices.items():
                report.modules[name].update(choice)
    for scheme, kernel in sorted(
        {(s, k) for s, k, m in todo.values() if m == "rtn"}, key=lambda sk: (sk[0].label, sk[1] or "")
    ):
        names = {n for n, skm in todo.items() if skm == (scheme, kernel, "rtn")}
        config, backend = torchao_config(scheme, kernel)
        report.backend[f"{scheme.label} ({kernel})" if kernel else scheme.label] = backend
        if broadcast and rank != 0:
            continue  # quantized once, on rank 0, and received below
        seen: list[str] = []

        def chosen(module: nn.Module, name: str, names: set[str] = names - experts, seen: list[str] = seen) -> bool:
            if name in names:
                seen.append(name)  # remembered so an error can name the module
                return True
            return False

        try:
            if names - experts:
                quantize_(lm, config, filter_fn=chosen)
            if names & experts:  # 3D parameters, quantized by name
                seen.append(", ".join(sorted(names & experts)))
                quantize_(lm, FqnToConfig({n: config for n in sorted(names & experts)}), filter_fn=None)
        except Exception as err:
            raise ValueError(f"{backend} failed on {seen[-1] if seen else lm.__class__.__name__}: {err}") from err
    if broadcast:
        broadcast_from_rank0(lm, [n if n in experts else f"{n}.weight" for n in sorted(todo)])
    modules = dict(lm.named_modules())
    for second, first in twins.items():  # re-tie: the twin shares its first's quantized weight
        modules[second].weight = modules[first].weight
    for name, entry in report.modules.items():
        entry["bytes_before"], entry["bytes_after"] = before[name], tensor_bytes(targets[name].weight(lm))
    report.weight_bytes_after = sum(tensor_bytes(p) for _, p in lm.named_parameters())
    quantized = {id(p) for p in lm.parameters() if hasattr(p, "__tensor_flatten__")}
    report.quantized_params = [n for n, p in lm.named_parameters(remove_duplicate=False) if id(p) in quantized]
    report.full_precision_bytes = sum(tensor_bytes(p) for p in lm.parameters() if id(p) not in quantized)
    report.consistency = check_consistency(lm, [n for n, p in lm.named_parameters() if id(p) in quantized])
    skipped = report.skipped
    if skipped:
        log.warning(
            "quantization skipped %d modules: %s", len(skipped), "; ".join(f"{n}: {r}" for n, r in skipped.items())
        )
    log.info(
        "quantized %d weights; %.1f%% of the weight bytes stay in full precision",
        report.quantized_modules,
        100 * report.full_precision_fraction,
    )
    return report


def build(
    cfg: dict[str, Any], tokenizer: Any = None, evaluated: Any = None, timeout_s: float = 300.0
) -> Callable[[nn.Module], QuantReport] | None:
    """The ``quantize(lm) -> QuantReport`` callable for a ``quant`` config, or ``None`` for ``quant=none``.

    The rules are parsed now, so a bad config fails before any model is loaded. A calibrated method needs the
    model's ``tokenizer``; its calibration text is checked against ``evaluated`` (the evaluated
    :class:`~lit_ppl.sources.DataSpec`) and tokenized now, before any process group exists (as the evaluated
    text is), so that no rank waits inside a collective while another tokenizes.
    """
    cfg = dict(cfg)
    if cfg.get("name", "none") == "none":
        return None
    rules = rules_from_cfg(cfg)
    if cfg.get("source", "local") not in SOURCES:
        raise ValueError(f"quant.source={cfg['source']!r} is not one of {', '.join(SOURCES)}")
    method = next((m for m in ("awq", "gptq") if uses(rules, m)), None)
    if method is None:
        return lambda lm: quantize_model(lm, cfg)
    from lit_ppl.calibrate import Calibration, CalibrationSpec, prepare_calibration

    spec = CalibrationSpec.from_cfg(cfg.get("calibration"), method)
    if tokenizer is None:
        raise ValueError(f"quant.method={method} needs the model's tokenizer to read quant.calibration.path")
    store = prepare_calibration(spec, tokenizer, evaluated, timeout_s)
    return lambda lm: quantize_model(lm, cfg, Calibration(spec, store))
