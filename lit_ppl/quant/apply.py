"""Weight quantization with torchao's ``quantize_``: apply the choices, report what they did, keep ranks consistent.

The choices (:mod:`lit_ppl.quant.assign`) give every quantizable weight of the model (``nn.Linear``,
``nn.Embedding`` and fused expert weights: :mod:`lit_ppl.quant.targets`) a scheme and a method, or say why it gets
none; :func:`quantize_model` applies them: the calibrated methods first (:meth:`lit_ppl.quant.methods.Method.observe`
on the float model, then :meth:`~lit_ppl.quant.methods.Method.quantize`), then ``quantize_`` for the others (a
``filter_fn`` per scheme and method for modules, an ``FqnToConfig`` for expert parameters). The
:class:`~lit_ppl.quant.report.QuantReport` records all of it. Nothing is skipped silently: an int4 layer given a
smaller group size than requested is listed under ``adapted``, a layer a scheme cannot take under ``skipped`` with
the reason, and the log says each in one line with counts and the fix. The ranks' quantized weights are compared
by hash (:mod:`lit_ppl.quant.consistency`).

Tied weights (``tie_word_embeddings``: the output head and the input embeddings are one tensor) are quantized
once, for both, so the tie holds; when the rules give the two different schemes the choice refuses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from lit_ppl.config.quant import QuantConfig
from lit_ppl.config.values import GROUP_SIZES
from lit_ppl.errors import LitPplError
from lit_ppl.parallel.ranks import world
from lit_ppl.quant.assign import assign, rules_from_cfg
from lit_ppl.quant.auto.budget import packed_bytes
from lit_ppl.quant.calibrated.awq import PRE_SCALE
from lit_ppl.quant.calibrated.split import TpView, as_one_process, quantized_whole
from lit_ppl.quant.calibrated.stream import Where
from lit_ppl.quant.consistency import Known, broadcast_from_rank0, check_ranks_agree, record, whole_digest
from lit_ppl.quant.methods import METHODS, Choice, Method
from lit_ppl.quant.report import QuantReport, summary_lines
from lit_ppl.quant.targets import to_plain_linear
from lit_ppl.runtime.memory import is_quantized, tensor_bytes

log = logging.getLogger(__name__)

Stream = Callable[[Callable[[str], None]], None]  # loads the weights, calling its argument with each name in place


def quantize_model(
    lm: nn.Module,
    cfg: QuantConfig,
    calibration: Any = None,
    tp: TpView | None = None,
    stream: Stream | None = None,
    release: Callable[[str], None] | None = None,
    device: Any = None,
    rows: Any = None,
) -> QuantReport:
    """Apply the typed ``quant`` config ``cfg`` to ``lm`` in place and return the report.

    ``calibration`` (a :class:`lit_ppl.quant.calibrated.text.Calibration`) is the text of calibrated methods.
    ``tp``: this rank's tensor-parallel group and splits, when ``lm`` holds this rank's slices of every split layer.
    ``stream``: the weights are not loaded yet (round to nearest only): ``stream(arrived)`` loads them one at a time,
    calling ``arrived(parameter name)`` as each is in place; each is quantized then, hashed whole, and its layer's
    name handed to ``release`` (which may keep only this rank's rows of it): no rank holds two of them in float;
    ``device``: where they will be (the int4 kernel is chosen for it). ``rows``: a
    :class:`lit_ppl.parallel.float_rows.FloatRows` holding calibrated layers' float weights by rows: each decoder
    block's are made whole, quantized, hashed and handed to ``release`` before the next block's.
    """
    report = QuantReport(name=cfg.name, source=cfg.source)
    report.weight_bytes_before = sum(tensor_bytes(p) for _, p in lm.named_parameters())
    report.converted = to_plain_linear(lm)
    by_rows = rows is not None and bool(rows.handles)  # layers held by rows: every rank runs every pass
    if cfg.name == "auto":  # measured, then applied as the policy it chose
        from lit_ppl.quant.auto.search import choose_policy

        with as_one_process(lm, tp) as whole:  # a tensor-parallel group measures as one process, layers by slices
            cfg, report.auto = choose_policy(lm, cfg, calibration, _where(*world(), whole), by_rows or tp is not None)
    todo, report.modules, targets = assign(lm, rules_from_cfg(cfg), cfg.backend, cfg.group_fallback, device)
    _check_assigned(lm, report, todo, targets)
    before = {n: tensor_bytes(t.weight(lm)) for n, t in targets.items()}
    twins = {n: e["tied_to"] for n, e in report.modules.items() if "tied_to" in e}
    packed = {n: packed_bytes(c.scheme, targets[n].weight(lm)) for n, c in todo.items()}
    saved = sum(before[n] - packed[n] for n in todo if n not in twins)  # a tied twin is the same tensor, counted once
    report.weight_bytes_packed = report.weight_bytes_before - saved
    rank, size = world()
    broadcast = cfg.source == "rank0" and size > 1
    experts = {n for n in todo if targets[n].kind == "experts"}
    if experts:
        # torchao's tensors run in F.linear, not in the grouped-matmul kernels of transformers' default experts.
        lm.set_experts_implementation("eager")
        report.backend["experts"] = "transformers' eager experts loop (F.linear per expert)"
    known = Known()
    _calibrate(lm, todo, calibration, report, (rank, size, broadcast), cfg, tp, (rows, release, known))
    free = todo
    if by_rows and rows.handles:  # quant=auto's policy: the layers it did not calibrate, still by rows
        done = _held_by_blocks(lm, todo, experts, report, (rows, release, known))
        free = {n: c for n, c in todo.items() if n not in done}
    if stream is None:
        _round_to_nearest(lm, free, experts, report, broadcast and rank != 0, tp)
    else:
        layer_of = {**{s: f for s, f in twins.items() if f in todo}, **{n: n for n in todo}}
        _as_read(lm, todo, experts, report, (stream, release, known), layer_of)
    if broadcast:
        broadcast_from_rank0(lm, [n if n in experts else f"{n}.weight" for n in sorted(todo)])
    modules = dict(lm.named_modules())
    for second, first in twins.items():  # re-tie: the twin shares its first's quantized weight
        modules[second].weight = modules[first].weight
    for name, entry in report.modules.items():
        after = known.bytes.get(twins.get(name, name)) or tensor_bytes(targets[name].weight(lm))
        entry["bytes_before"], entry["bytes_after"] = before[name], after
        entry["bytes_packed"] = packed.get(name, before[name])
    _finish_report(lm, report, tp, known)
    return report


def _where(rank: int, size: int, tp: TpView | None) -> Where:
    """This rank's data-parallel place (ranks ``rank // tp`` of ``size // tp``: the mesh's tp is the fastest dim)."""
    t = tp.tp.size if tp is not None else 1
    return Where(rank // t, size // t, tp)


def _check_assigned(lm: nn.Module, report: QuantReport, todo: dict[str, Choice], targets: dict[str, Any]) -> None:
    """Choices that quantize nothing are the user's mistake: one line saying why."""
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


def _by_method(todo: dict[str, Choice], calibrated: bool) -> dict[Method, dict[str, Choice]]:
    """The choices grouped by method, calibrated or not, in the table's order."""
    return {
        method: layers
        for method in METHODS.values()
        if method.calibrated == calibrated and (layers := {n: c for n, c in todo.items() if c.method is method})
    }


def _calibrate(
    lm: nn.Module,
    todo: dict[str, Choice],
    calibration: Any,
    report: QuantReport,
    where: tuple[int, int, bool],
    cfg: QuantConfig,
    tp: TpView | None = None,
    held: tuple[Any, Callable[[str], None] | None, Known] = (None, None, None),
) -> None:
    """The calibrated layers, on the float model before any round-to-nearest layer changes their inputs (torchao's
    order: every observer sees float activations): each method's statistics first, then each method's quantization
    in the table's order (AWQ before GPTQ, whose ``quant.gptq.sequential`` passes then see AWQ's layers). ``where``:
    ``(rank, world size, broadcast)``; under ``source=rank0`` rank 0 alone calibrates on the whole set. ``held``:
    ``(rows, release, known)`` as :func:`quantize_model` takes them (``rows`` ``None``: every layer is whole)."""
    methods = _by_method(todo, calibrated=True)
    if not methods:
        return
    if calibration is None:
        first = next(iter(methods)).name
        raise LitPplError(f"quant.method={first} needs calibration text: set quant.calibration.path=FILE")
    for method, layers in methods.items():
        for choice in set(layers.values()):
            report.backend[method.backend_key(choice)] = method.describe(choice)
    rank, size, broadcast = where
    if broadcast and rank != 0:
        return
    at = Where() if broadcast else _where(rank, size, tp)
    t0 = time.perf_counter()
    stats = {method: method.observe(lm, layers, calibration, at, cfg) for method, layers in methods.items()}
    facts: dict[str, dict[str, Any]] = {}
    if held[0] is not None:
        facts = _by_blocks(lm, methods, stats, (calibration, at, cfg), held)
    for method, layers in methods.items() if held[0] is None else ():
        facts.update(method.quantize(lm, layers, stats[method], calibration, at, cfg))
    for name, more in facts.items():
        report.modules[name].update(more)
    info: dict[str, Any] = {**calibration.describe(), "world_size": at.size, "tp": at.tp_size}
    for method in methods:
        info |= method.info(cfg)
    info |= {"method": "+".join(m.name for m in methods), "seconds": time.perf_counter() - t0}
    report.calibration = info


def _by_blocks(
    lm: nn.Module,
    methods: dict[Method, dict[str, Choice]],
    stats: dict[Method, Any],
    run: tuple[Any, Where, QuantConfig],
    held: tuple[Any, Callable[[str], None] | None, Known],
) -> dict[str, dict[str, Any]]:
    """Each method's quantization a decoder block at a time (``run``: calibration, place, config): the block's layers
    held by rows made whole, quantized by each method in the table's order, hashed whole and released (cut to this
    rank's rows) before the next block's, so a rank holds one block's float weights whole. The same weights as
    :func:`_calibrate`'s method-by-method order: a sequential GPTQ pass stops after its block, whose earlier blocks
    hold every method's layers either way."""
    from lit_ppl.quant.calibrated.gptq import blocks

    rows, release, known = held
    facts: dict[str, dict[str, Any]] = {}
    for _, names in blocks(lm, [n for layers in methods.values() for n in layers]):
        mine = [n for n in names if n in rows.handles]
        for name in mine:
            rows.whole(name)
        for method, layers in methods.items():
            part = {n: c for n, c in layers.items() if n in names}
            st = stats[method]
            if part:
                facts.update(method.quantize(lm, part, st and {n: st[n] for n in part}, *run))
        for name in mine:
            record(known, f"{name}.weight", name, lm.get_submodule(name).weight)
            if release is not None:
                release(name)
    return facts


def _held_by_blocks(
    lm: nn.Module,
    todo: dict[str, Choice],
    experts: set[str],
    report: QuantReport,
    held: tuple[Any, Callable[[str], None] | None, Known],
) -> set[str]:
    """The layers still held by rows (``quant=auto``'s policy: round to nearest, full precision) a decoder block at
    a time: made whole, quantized if ``todo`` has them, hashed and released (cut to this rank's rows); a
    full-precision layer stays whole, for FSDP to shard with its block. The layers quantized."""
    from lit_ppl.quant.calibrated.gptq import blocks

    rows, release, known = held
    _free_choices(todo, report)
    done: set[str] = set()
    for _, names in blocks(lm, list(rows.handles)):
        for name in names:
            rows.whole(name)
        for name in (n for n in names if n in todo):
            _quantize_now(lm, todo[name], name, experts, (release, known))
            done.add(name)
    return done


class _Chosen:
    """torchao's ``filter_fn`` for one scheme's modules; remembers the last one it chose, so an error can name it."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.seen = names, ""

    def __call__(self, module: nn.Module, name: str) -> bool:
        if name in self.names:
            self.seen = name
            return True
        return False


def _free_choices(todo: dict[str, Choice], report: QuantReport) -> list[Choice]:
    """The calibration-free choices in a fixed order, each one's backend recorded in the report."""
    free = [c for layers in _by_method(todo, calibrated=False).values() for c in layers.values()]
    ordered = sorted(set(free), key=lambda c: (c.scheme.label, c.kernel or "", c.method.name))
    for choice in ordered:
        report.backend[choice.method.backend_key(choice)] = choice.config()[1]
    return ordered


def _round_to_nearest(
    lm: nn.Module, todo: dict[str, Choice], experts: set[str], report: QuantReport, skip: bool, tp: TpView | None
) -> None:
    """The calibration-free layers, one torchao ``quantize_`` per choice; ``skip``: they arrive by broadcast; ``tp``:
    a row-parallel layer's int8 is its whole rows' (:func:`~lit_ppl.quant.calibrated.split.quantized_whole`)."""
    for choice in _free_choices(todo, report):
        names = {n for n, c in todo.items() if c == choice} if not skip else set()  # else quantized on rank 0
        if choice.scheme.kind == "int8":
            names = quantized_whole(lm, names, choice.config()[0], tp)
        _apply(lm, choice, names, experts)


def _apply(lm: nn.Module, choice: Choice, names: set[str], experts: set[str]) -> None:
    """torchao's ``quantize_`` of ``choice`` on the layers ``names`` (expert parameters by name)."""
    from torchao.quantization import FqnToConfig, quantize_

    config, backend = choice.config()
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


def _as_read(
    lm: nn.Module,
    todo: dict[str, Choice],
    experts: set[str],
    report: QuantReport,
    how: tuple[Stream, Callable[[str], None] | None, Known],
    layer_of: dict[str, str],
) -> None:
    """The calibration-free layers quantized as their weights arrive (``how``: the stream, the release and what
    to record); ``layer_of``: every name a layer's weight arrives under (a tied twin's too) → the layer in ``todo``."""
    stream, release, known = how
    _free_choices(todo, report)
    by_param = {n if layer_of[n] in experts else f"{n}.weight": layer for n, layer in layer_of.items()}

    def arrived(param: str) -> None:
        name = by_param.get(param)
        if name is not None:
            _quantize_now(lm, todo[name], name, experts, (release, known))

    stream(arrived)


def _quantize_now(
    lm: nn.Module, choice: Choice, name: str, experts: set[str], how: tuple[Callable[[str], None] | None, Known]
) -> None:
    """Round to nearest ``name`` now, recorded while whole, then handed to ``release`` (``how``)."""
    release, known = how
    _apply(lm, choice, {name}, experts)
    weight = lm.get_parameter(name) if name in experts else lm.get_submodule(name).weight
    record(known, name if name in experts else f"{name}.weight", name, weight)
    if release is not None and name not in experts:
        release(name)


def _finish_report(lm: nn.Module, report: QuantReport, tp: TpView | None, known: Known) -> None:
    """The quantized parameters, their bytes, the ranks' agreement, and one log line each for skips and totals
    (``known``: weights hashed and measured whole as they arrived)."""
    whole = {n: known.bytes.get(n.removesuffix(".weight")) for n in known.inner}
    report.weight_bytes_after = sum(whole.get(n) or tensor_bytes(p) for n, p in lm.named_parameters())
    quantized = {id(p) for p in lm.parameters() if is_quantized(p)}
    report.quantized_params = [n for n, p in lm.named_parameters(remove_duplicate=False) if id(p) in quantized]
    report.full_precision_bytes = sum(tensor_bytes(p) for p in lm.parameters() if id(p) not in quantized)
    hashed = [n for n, p in lm.named_parameters() if id(p) in quantized or n.endswith(f".{PRE_SCALE}")]
    size = tp.tp.size if tp is not None else 1
    report.consistency = check_ranks_agree(lm, hashed, size, known.inner)  # pre-scales included
    report.digest = whole_digest(lm, hashed, tp, known.values)
    for line in summary_lines(report):
        log.warning("%s", line)
    log.info(
        "quantized %d weights; %.1f%% of the weight bytes stay in full precision",
        report.quantized_modules,
        100 * report.full_precision_fraction,
    )
