"""Weight quantization with torchao's ``quantize_``: apply a plan, report what it did, keep ranks consistent.

The plan (:mod:`lit_ppl.quant.plan`) decides, for every quantizable weight of the model (``nn.Linear``,
``nn.Embedding`` and fused expert weights: :mod:`lit_ppl.quant.targets`), which scheme it gets (``none``,
``int8``, ``int8dq``, ``int4`` with a group size) or why it gets none; :func:`quantize_model` applies it with
``quantize_`` (a ``filter_fn`` per scheme for modules, an ``FqnToConfig`` for expert parameters), and the
:class:`QuantReport` records all of it. Nothing is skipped silently: an int4 layer given a smaller group size
than requested is listed under ``adapted``, a layer a scheme cannot take under ``skipped`` with the reason, and
the log says each in one line with counts and the fix (:func:`summary_lines`). The ranks' quantized weights are
compared by hash (:mod:`lit_ppl.quant.consistency`).

Tied weights (``tie_word_embeddings``: the output head and the input embeddings are one tensor) are quantized
once, for both, so the tie holds; when the rules give the two different schemes the plan refuses.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lit_ppl.config.quant import quant_node
from lit_ppl.config.values import calibrated_method
from lit_ppl.errors import LitPplError
from lit_ppl.parallel.ranks import world
from lit_ppl.quant.awq import PRE_SCALE
from lit_ppl.quant.consistency import RankMismatchError, broadcast_from_rank0, check_consistency
from lit_ppl.quant.plan import GROUP_SIZES, gptq_base_config, gptq_config, plan, rules_from_cfg, torchao_config
from lit_ppl.quant.targets import to_plain_linear
from lit_ppl.runtime.memory import tensor_bytes

__all__ = ["QuantReport", "RankMismatchError", "build", "check_layout", "quantize_model"]

log = logging.getLogger(__name__)


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
    calibration: dict[str, Any] | None = (
        None  # calibrated methods: the text, its tokens, the time (lit_ppl.quant.calibration)
    )
    auto: dict[str, Any] | None = None  # quant=auto: budget, sensitivities, the choice (lit_ppl.quant.auto)

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

    @property
    def adapted(self) -> dict[str, dict[str, Any]]:
        """int4 layers that took a smaller group size than requested (``quant.group_fallback``), with both."""
        adapted = {n: m for n, m in self.modules.items() if "adapted" in m}
        return {n: {"requested": m["requested"], "config": m["config"]} for n, m in adapted.items()}

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
            "adapted": self.adapted,
            "converted": self.converted,
            "modules": self.modules,
            "consistency": self.consistency,
            "calibration": self.calibration,
            **({"auto": self.auto} if self.auto is not None else {}),
        }


def quantize_model(lm: nn.Module, cfg: dict[str, Any], calibration: Any = None, tp: int = 1) -> QuantReport:
    """Apply the ``quant`` config ``cfg`` to ``lm`` in place and return the report.

    ``calibration`` (a :class:`lit_ppl.quant.calibration.Calibration`) is the text of calibrated methods (``awq``,
    ``gptq``). ``tp``: the tensor-parallel degree, when ``lm`` holds this rank's slices of every split layer.
    """
    cfg = quant_node(cfg)
    report = QuantReport(name=cfg["name"], source=cfg["source"])
    report.weight_bytes_before = sum(tensor_bytes(p) for _, p in lm.named_parameters())
    report.converted = to_plain_linear(lm)
    if cfg["name"] == "auto":  # measured, then applied as the policy it chose
        from lit_ppl.quant.auto import choose_policy

        cfg, report.auto = choose_policy(lm, cfg, calibration, *world())
    todo, report.modules, targets = plan(lm, rules_from_cfg(cfg), cfg["backend"], cfg["group_fallback"])
    _check_planned(lm, report, todo, targets)
    before = {n: tensor_bytes(t.weight(lm)) for n, t in targets.items()}
    twins = {n: e["tied_to"] for n, e in report.modules.items() if "tied_to" in e}
    rank, size = world()
    broadcast = cfg["source"] == "rank0" and size > 1
    experts = {n for n in todo if targets[n].kind == "experts"}
    if experts:
        # torchao's tensors run in F.linear, not in the grouped-matmul kernels of transformers' default experts.
        lm.set_experts_implementation("eager")
        report.backend["experts"] = "transformers' eager experts loop (F.linear per expert)"
    _calibrate(lm, todo, calibration, report, (rank, size, broadcast), cfg["gptq"])
    _round_to_nearest(lm, todo, experts, report, skip=broadcast and rank != 0)
    if broadcast:
        broadcast_from_rank0(lm, [n if n in experts else f"{n}.weight" for n in sorted(todo)])
    modules = dict(lm.named_modules())
    for second, first in twins.items():  # re-tie: the twin shares its first's quantized weight
        modules[second].weight = modules[first].weight
    for name, entry in report.modules.items():
        entry["bytes_before"], entry["bytes_after"] = before[name], tensor_bytes(targets[name].weight(lm))
    _finish_report(lm, report, tp)
    return report


def _check_planned(lm: nn.Module, report: QuantReport, todo: dict[str, Any], targets: dict[str, Any]) -> None:
    """A plan that quantizes nothing is the user's mistake: one line saying why."""
    if todo:
        return
    if report.skipped:
        first = next(iter(report.skipped.values()))
        raise LitPplError(
            f"quant={report.name} would quantize none of the {len(report.skipped)} layers it names ({first}); "
            f"choose quant.group_size among {GROUP_SIZES} that divides the layers' in_features, or "
            "quant.group_fallback=true"
        )
    raise LitPplError(
        f"quant={report.name} quantizes none of {type(lm).__name__}'s {len(targets)} linear, embedding and "
        "expert weights: no rule gives any of them a config other than none"
    )


def _calibrate(
    lm: nn.Module,
    todo: dict[str, Any],
    calibration: Any,
    report: QuantReport,
    where: tuple[int, int, bool],
    options: dict[str, Any] | None,
) -> None:
    """The calibrated layers (AWQ, GPTQ), on the float model before any round-to-nearest layer changes their inputs
    (torchao's order: every observer sees float activations): GPTQ's Hessians, then AWQ, then GPTQ's quantization
    (``quant.gptq.sequential``: block by block after AWQ). ``where``: ``(rank, world size, broadcast)``; under
    ``source=rank0`` rank 0 alone calibrates on the whole set."""
    calibrated = {n: torchao_config(s, k)[0] for n, (s, k, m) in todo.items() if m == "awq"}
    gptq = {n: gptq_config(s, k) for n, (s, k, m) in todo.items() if m == "gptq"}
    if not (calibrated or gptq):
        return
    if calibration is None:
        method = "awq" if calibrated else "gptq"
        raise LitPplError(f"quant.method={method} needs calibration text: set quant.calibration.path=FILE")
    from lit_ppl.quant.awq import run_awq
    from lit_ppl.quant.gptq import gptq_hessians, run_gptq
    from lit_ppl.quant.gptq_solver import GptqOptions

    opts = GptqOptions.from_cfg(options)
    for s, k, m in {v for v in todo.values() if v[2] in ("awq", "gptq")}:
        label, (_, torchao) = (f"{s.label} ({k})" if k else s.label), gptq_config(s, k)
        if m == "awq":
            what = f"AWQ scales (lit_ppl.quant.awq) over {torchao_config(s, k)[1]}"
        elif torchao:
            what = f"{gptq_base_config(s)[1]}, Hessians reduced by lit_ppl.quant.gptq"
        else:
            what = f"GPTQ on torch ops (lit_ppl.quant.gptq_solver) to {torchao_config(s, k)[1]}"
        report.backend[f"{m} {label}"] = what
    rank, size, broadcast = where
    if broadcast and rank != 0:
        return
    at = (0, 1) if broadcast else (rank, size)
    t0 = time.perf_counter()
    hessians = gptq_hessians(lm, sorted(gptq), calibration, *at) if gptq and not opts.sequential else None
    choices: dict[str, dict[str, Any]] = {}
    if calibrated:
        choices, report.calibration = run_awq(lm, calibrated, calibration, *at)
    if gptq:
        choices.update(run_gptq(lm, gptq, calibration, *at, opts, hessians))
        info = report.calibration or {**calibration.describe(), "world_size": at[1]}
        methods = "awq+gptq" if calibrated else "gptq"
        gptq_info = {"gptq": {**dataclasses.asdict(opts)}}
        report.calibration = {**info, **gptq_info, "method": methods, "seconds": time.perf_counter() - t0}
    for name, choice in choices.items():
        report.modules[name].update(choice)


class _Chosen:
    """torchao's ``filter_fn`` for one scheme's modules; remembers the last one it chose, so an error can name it."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.seen = names, ""

    def __call__(self, module: nn.Module, name: str) -> bool:
        if name in self.names:
            self.seen = name
            return True
        return False


def _round_to_nearest(lm: nn.Module, todo: dict[str, Any], experts: set[str], report: QuantReport, skip: bool) -> None:
    """The calibration-free layers (round-to-nearest, HQQ), one torchao ``quantize_`` per scheme and method;
    ``skip``: they arrive by broadcast."""
    from torchao.quantization import FqnToConfig, quantize_

    free = {v for v in todo.values() if v[2] in ("rtn", "hqq")}
    for scheme, kernel, method in sorted(free, key=lambda skm: (skm[0].label, skm[1] or "", skm[2])):
        names = {n for n, skm in todo.items() if skm == (scheme, kernel, method)}
        config, backend = torchao_config(scheme, kernel, method)
        label = f"{scheme.label} ({kernel})" if kernel else scheme.label
        report.backend[label if method == "rtn" else f"{method} {label}"] = backend
        if skip:
            continue  # quantized once, on rank 0
        chosen = _Chosen(names - experts)
        try:
            if names - experts:
                quantize_(lm, config, filter_fn=chosen)
            if names & experts:  # 3D parameters, quantized by name
                chosen.seen = ", ".join(sorted(names & experts))
                quantize_(lm, FqnToConfig({n: config for n in sorted(names & experts)}), filter_fn=None)
        except Exception as err:
            # Not the user's input as far as lit-ppl's checks can tell: the traceback stays.
            raise RuntimeError(f"{backend} failed on {chosen.seen or lm.__class__.__name__}: {err}") from err


def _finish_report(lm: nn.Module, report: QuantReport, tp: int) -> None:
    """The quantized parameters, their bytes, the ranks' agreement, and one log line each for skips and totals."""
    report.weight_bytes_after = sum(tensor_bytes(p) for _, p in lm.named_parameters())
    quantized = {id(p) for p in lm.parameters() if hasattr(p, "__tensor_flatten__")}
    report.quantized_params = [n for n, p in lm.named_parameters(remove_duplicate=False) if id(p) in quantized]
    report.full_precision_bytes = sum(tensor_bytes(p) for p in lm.parameters() if id(p) not in quantized)
    hashed = [n for n, p in lm.named_parameters() if id(p) in quantized or n.endswith(f".{PRE_SCALE}")]
    report.consistency = check_consistency(lm, hashed, tp)  # AWQ's input pre-scales are part of the model
    for line in summary_lines(report):
        log.warning("%s", line)
    log.info(
        "quantized %d weights; %.1f%% of the weight bytes stay in full precision",
        report.quantized_modules,
        100 * report.full_precision_fraction,
    )


def summary_lines(report: QuantReport) -> list[str]:
    """One short line each for the adapted and the skipped layers: counts, the reasons, the fix; the full lists are
    in ``results.json`` (``quant.adapted``, ``quant.skipped``, per module ``quant.modules``)."""
    asked = sum(bool(m["config"] or m.get("requested")) for m in report.modules.values())
    lines = []
    for key, names in (("adapted", report.adapted), ("skipped", report.skipped)):
        if not names:
            continue
        entries = [report.modules[n] for n in names]
        reasons: dict[str, int] = {}
        for m in entries:
            why = m["adapted"] if key == "adapted" else m["reason"]
            reasons[why] = reasons.get(why, 0) + 1
        shown = "; ".join(f"{why} ({k})" if len(reasons) > 1 else why for why, k in list(reasons.items())[:3])
        shown += "; ..." if len(reasons) > 3 else ""
        widths = {m["in_features"] for m in entries if "in_features" in m}
        fits = [g for g in GROUP_SIZES if widths and all(w % g == 0 for w in widths)]
        if key == "adapted":
            used = sorted({m["config"] for m in entries})
            fix = f"they use {', '.join(used)}" + (f"; quant.group_size={max(fits)} divides all" if fits else "")
            what = f"{len(names)} of {asked} layers took a smaller int4 group"
        elif all(m["reason"].startswith("in_features") for m in entries):
            none = f"no int4 group size in {GROUP_SIZES} divides in_features {', '.join(map(str, sorted(widths)))}"
            fix = f"quant.group_size={max(fits)} divides all" if fits else f"{none}: a policy rule can give them int8"
        else:
            fix = "a quant=policy rule can give them another config (e.g. int8)"
        if key == "skipped":
            what = f"{len(names)} of {asked} layers stay in full precision"
        lines.append(f"quantization: {what}: {shown}; {fix} (list: results.json quant.{key})")
    return lines


def build(
    cfg: dict[str, Any], tokenizer: Any = None, evaluated: Any = None, timeout_s: float = 300.0
) -> Callable[[nn.Module], QuantReport] | None:
    """The ``quantize(lm) -> QuantReport`` callable for a ``quant`` config, or ``None`` for ``quant=none``.

    The rules are parsed now, so a bad config fails before any model is loaded. A calibrated method needs the
    model's ``tokenizer``; its calibration text is checked against ``evaluated`` (the evaluated
    :class:`~lit_ppl.data.sources.DataSpec`) and tokenized now, before any process group exists (as the evaluated
    text is), so that no rank waits inside a collective while another tokenizes.
    """
    cfg = quant_node(cfg)
    if cfg["name"] == "none":
        return None
    if cfg["name"] != "auto":
        rules_from_cfg(cfg)  # a bad rule fails now
    method = calibrated_method(cfg) or ("auto" if cfg["name"] == "auto" else None)
    if method is None:
        return lambda lm, tp=1: quantize_model(lm, cfg, tp=tp)
    from lit_ppl.quant.calibration import Calibration, CalibrationSpec, prepare_calibration

    spec = CalibrationSpec.from_cfg(cfg["calibration"], method)
    if tokenizer is None:
        raise LitPplError(f"quant.method={method} needs the model's tokenizer to read quant.calibration.path")
    store = prepare_calibration(spec, tokenizer, evaluated, timeout_s)
    return lambda lm, tp=1: quantize_model(lm, cfg, Calibration(spec, store), tp)


def check_layout(cfg: dict[str, Any], layout: Any) -> None:
    """What quantization cannot do when the layout splits the model (:mod:`lit_ppl.parallel.layout`), refused at
    once."""
    cfg = quant_node(cfg)
    if cfg["name"] == "none" or not layout.sharded:
        return
    method = calibrated_method(cfg)
    if method is not None or cfg["name"] == "auto":
        what = "quant=auto" if cfg["name"] == "auto" else f"quant.method={method}"
        raise LitPplError(
            f"{what} with strategy layout {layout.kind}: calibration runs whole layers on every rank; "
            "evaluate calibrated quantization with strategy=ddp (each rank holds the model)"
        )
    if cfg["source"] == "rank0":
        raise LitPplError(
            f"quant.source=rank0 with strategy layout {layout.kind}: ranks hold different slices, so rank 0's "
            "cannot be broadcast; use quant.source=local"
        )
