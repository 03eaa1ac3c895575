"""``quant=auto``: precision per layer, chosen by measured sensitivity under a budget.

1. Every quantizable layer's candidates: its weight under each scheme of ``quant.schemes`` (int4 by
   ``quant.method``, with the group fallback; int8 by round-to-nearest), the calibrated ones from statistics
   reduced over the ranks (:mod:`lit_ppl.quant.auto.candidates`).
2. Each candidate's cost on the calibration text, the mean KL divergence from the float model and the change in
   mean NLL: estimated from gradients in a few passes (:mod:`lit_ppl.quant.auto.fisher`, the default) or, with
   ``quant.sensitivity_method=exact``, measured alone (:class:`lit_ppl.quant.auto.sensitivity.Meter`); summed over
   the ranks in float64 in global batch order (:func:`lit_ppl.quant.calibrated.stream.ordered_sum`), so every rank,
   at any world size, holds the same numbers and makes the same choice (:mod:`lit_ppl.quant.auto.table`).
3. The assignment with the fewest weight bytes whose summed cost stays within a target: a multiple-choice
   knapsack solved by dynamic programming over the target in 4,000 steps, each cost rounded up, so the
   prediction never exceeds the target (:mod:`lit_ppl.quant.auto.budget`).
4. The assignment measured as a whole on the calibration text, against the budget by its upper prediction bound
   for another text (:meth:`~lit_ppl.quant.auto.budget.Budget.bound`); interactions make that differ from the sum,
   so the target starts at the budget, shrinks while the bound exceeds it, grows into the slack a met bound leaves,
   and the knapsack runs again (:func:`_search`, at most :data:`ROUNDS` measurements); the cheapest assignment that
   met the budget is the choice.

A size budget (``quant.budget.bits``) has no loss to meet: the assignment of the least predicted KLD within the
size (:func:`~lit_ppl.quant.auto.budget.least_cost`), measured once as a whole for the report.

The choice becomes ``quant=policy`` rules, one per layer (written next to ``results.json`` as
``quant_policy.yaml``: :mod:`lit_ppl.quant.auto.policy`), applied by :func:`lit_ppl.quant.apply.quantize_model`
like any policy. Bytes: :func:`lit_ppl.quant.auto.budget.packed_bytes`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from lit_ppl.config.quant import QuantConfig
from lit_ppl.errors import LitPplError
from lit_ppl.model.nll import auto_chunk
from lit_ppl.quant.auto.budget import (
    BINS,
    CONFIDENCE,
    Budget,
    Option,
    cheapest,
    least_cost,
    packed_bytes,
    real_units,
)
from lit_ppl.quant.auto.candidates import Candidates, installed
from lit_ppl.quant.auto.facts import facts
from lit_ppl.quant.auto.fisher import estimate_layers
from lit_ppl.quant.auto.policy import policy_node
from lit_ppl.quant.auto.reuse import with_sibling_table
from lit_ppl.quant.auto.sensitivity import Meter
from lit_ppl.quant.auto.table import Table, load_table, measure_layers, table_from_sums
from lit_ppl.quant.calibrated.stream import Where, block_of, ordered_rows, ordered_sum
from lit_ppl.quant.calibrated.text import Calibration
from lit_ppl.quant.schemes import NONE

log = logging.getLogger(__name__)

ROUNDS = 8  # whole-assignment measurements at most: shrinking until the budget is met, then growing into its slack
SOLVES = 4 * ROUNDS  # knapsack solves at most (one that repeats a measured assignment costs no measurement)
SHRINK = 0.95  # the next target is this times budget / measured (below the plain ratio: interactions add up)
SLACK = 0.03  # a met bound within this fraction below the budget ends the search: little is left to gain
CHUNK_BUDGET_MB = 256  # float64 statistics per chunk of positions, as eval.chunk_budget_mb


def unit_options(candidates: Candidates, kinds: list[str], table: Table, keep_none: bool) -> list[list[Option]]:
    """Per layer, the options the knapsack chooses among (full precision first, if ``quant.schemes`` has it)."""
    out = []
    for name in candidates.layers:
        weight = candidates.tensor(name)
        unit = [Option("none", packed_bytes(NONE, weight))]
        for kind in kinds:
            chosen = candidates.scheme(name, kind)
            if chosen is not None:
                unit.append(Option(kind, packed_bytes(chosen[0], weight), **table.get(name, {}).get(kind, {})))
        out.append(unit[1:] if not keep_none and len(unit) > 1 else unit)
    return out


def _table(
    lm: nn.Module,
    cfg: QuantConfig,
    candidates: Candidates,
    meter: Meter,
    calibration: Calibration,
    kinds: list[str],
    fingerprint: dict,
    at: Where,
    lockstep: bool,
) -> tuple[Table, int]:
    """The sensitivity table (with the passes it took): none when no layer has a choice, reused, or measured."""
    if not any(len(u) > 1 for u in unit_options(candidates, kinds, {}, "none" in cfg.schemes)):
        return {}, 0  # one option per layer (e.g. quant.schemes=[int8]): nothing to choose, only the whole to measure
    if cfg.sensitivity:
        expected = {n: [k for k in kinds if candidates.scheme(n, k) is not None] for n in candidates.layers}
        return load_table(cfg.sensitivity, fingerprint, expected), 0
    if cfg.sensitivity_method == "exact":
        return measure_layers(lm, candidates, meter, kinds, at)
    if candidates.routed:
        log.warning(
            "quant=auto: the gradient estimate does not see tokens routed to other experts, so it underestimates "
            "layers before a router; the whole-assignment rounds check the choice, and "
            "quant.sensitivity_method=exact measures each candidate"
        )
    local, windows = estimate_layers(lm, candidates, calibration, kinds, at, meter.chunk_size, meter.blocks, lockstep)
    return table_from_sums(ordered_sum(local.to(next(lm.parameters()).device), at).cpu(), candidates, kinds), windows


def _search(
    layers: list[str],
    options: list[list[Option]],
    budget: Budget,
    measured: Callable[[dict[str, str]], tuple[float, float]],
    schemes: list[str],
) -> tuple[dict[str, Option], int, list[dict[str, Any]]]:
    """The cheapest assignment whose whole measurement meets the budget, its round's index, and every round.

    The knapsack's target is bracketed between the largest that met the budget and the smallest that did not: a
    miss shrinks it by the overshoot, a met bound with slack grows it into the slack, and a step that would leave
    the bracket halves it instead; a target whose assignment was measured already moves the bracket for free."""
    costs = _costs(options, budget)
    rounds: list[dict[str, Any]] = []
    tried: dict[tuple[int, ...], tuple[dict[str, Option], float, float, int]] = {}  # picks → its round's figures
    target, low, high = budget.limit, 0.0, math.inf
    best: tuple[dict[str, Option], int] | None = None
    for _ in range(SOLVES):
        picks = cheapest(costs, target)
        if picks is None:  # nothing fits a smaller target
            break
        if tuple(picks) not in tried:
            if len(rounds) == ROUNDS:
                break
            picked, predicted, bound, figures = _measure(layers, options, picks, target, budget, measured)
            tried[tuple(picks)] = picked, predicted, bound, len(rounds)
            rounds.append(figures)
        picked, predicted, bound, index = tried[tuple(picks)]
        if bound <= budget.limit:
            low = max(low, target)
            if best is None or rounds[index]["bytes"] < rounds[best[1]]["bytes"]:
                best = picked, index
            if bound >= budget.limit * (1 - SLACK):
                break
            step = target * budget.limit / max(bound, budget.limit / 2)  # at most doubled
        else:
            high = min(high, target)
            # Below this assignment's own prediction: a target that only shrinks from the last may still admit it.
            step = min(target, predicted) * SHRINK * budget.limit / bound
        target = step if low < step < high else (low + high) / 2
        if high - low <= budget.limit / BINS:  # the knapsack's resolution: no other assignment lies between
            break
    if best is not None:
        return *best, rounds
    # No round at all: costs rounded up to the budget's steps left no assignment within it (the floor is close).
    floor = sum(min(o.cost(budget) for o in unit) for unit in options)
    least, how = min(((r["bound"], "prediction bound") for r in rounds), default=(budget.shown(floor), "predicted"))
    raise LitPplError(
        f"quant.budget.{budget.metric}={budget.value:g} is not met with {CONFIDENCE:.0%} confidence on text like "
        f"the calibration text: the best reachable "
        f"with quant.schemes={schemes} is {least:.4g} ({how}, {len(rounds)} assignments tried); raise the budget"
    )


def _fit(
    layers: list[str],
    options: list[list[Option]],
    budget: Budget,
    measured: Callable[[dict[str, str]], tuple[float, float]],
    weights: int,
    schemes: list[str],
) -> tuple[dict[str, Option], int, list[dict[str, Any]]]:
    """A size budget's choice: the least predicted KLD within its bytes, measured once (:func:`_search`'s return)."""
    fitted = least_cost(_costs(options, budget), budget.max_bytes(weights))
    if fitted is None:
        least = sum(min(o.bytes for o in unit) for unit in options)
        raise LitPplError(
            f"quant.budget.bits={budget.value:g} is below the fewest bits per weight quant.schemes={schemes} reach: "
            f"{8 * least / weights:.4g} ({least:,} bytes for {weights:,} weights); raise the budget"
        )
    picked, _, _, figures = _measure(layers, options, *fitted, budget, measured)
    return picked, 0, [figures]


def _costs(options: list[list[Option]], budget: Budget) -> list[list[tuple[int, float]]]:
    """The knapsack's ``(bytes, cost)`` per option of each layer."""
    return [[(o.bytes, o.cost(budget)) for o in unit] for unit in options]


def _measure(
    layers: list[str],
    options: list[list[Option]],
    picks: list[int],
    target: float,
    budget: Budget,
    measured: Callable[[dict[str, str]], tuple[float, float]],
) -> tuple[dict[str, Option], float, float, dict[str, Any]]:
    """One round: the knapsack's picks measured as a whole; ``(assignment, predicted, bound, the round's figures in
    the budget's terms)``."""
    picked = {n: options[u][j] for u, (n, j) in enumerate(zip(layers, picks, strict=True))}
    cost, bound = measured({n: o.kind for n, o in picked.items() if o.kind != "none"})
    predicted = sum(o.cost(budget) for o in picked.values())
    figures = {"target": target, "predicted": predicted, "measured": cost, "bound": bound}
    shown = {k: budget.shown(v) for k, v in figures.items()} | {"bytes": sum(o.bytes for o in picked.values())}
    return picked, predicted, bound, shown


def _check_reachable(
    budget: Budget, layers: list[str], options: list[list[Option]], cfg: QuantConfig, reused: bool
) -> None:
    """A budget the least sensitive assignment exceeds, predicted, is one line before any round runs."""
    floor = sum(min(o.cost(budget) for o in unit) for unit in options)
    if floor > budget.limit:
        source = f" from quant.sensitivity={cfg.sensitivity!r}" if reused else ""
        raise LitPplError(
            f"quant.budget.{budget.metric}={budget.value:g} cannot be met with quant.schemes={list(cfg.schemes)}: "
            f"the least reachable on the calibration text is {budget.shown(floor):.4g} (predicted{source}); raise "
            "the budget or add none to quant.schemes"
        )


def _check_quantizes(
    budget: Budget, quantized: dict[str, Any], layers: list[str], options: list[list[Option]], weights: int
) -> None:
    """A budget met only by full precision everywhere is the user's to know: one line with the smallest change."""
    if quantized:
        return
    if budget.metric == "bits":
        full = sum(u[0].bytes for u in options)
        raise LitPplError(
            f"quant.budget.bits={budget.value:g} holds every layer in full precision ({8 * full / weights:.4g} bits "
            "per weight): give fewer bits, or use quant=none"
        )
    least, where = min(
        (o.cost(budget), f"{o.kind} on {n}")
        for n, u in zip(layers, options, strict=True)
        for o in u
        if o.kind != "none"
    )
    raise LitPplError(
        f"quant.budget.{budget.metric}={budget.value:g} leaves every layer in full precision: the smallest "
        f"change one quantized layer makes on the calibration text is {budget.shown(least):.4g} ({where}); "
        "raise the budget, or use quant=none"
    )


def choose_policy(
    lm: nn.Module, cfg: QuantConfig, calibration: Calibration, at: Where, lockstep: bool = False
) -> tuple[QuantConfig, dict[str, Any]]:
    """The ``quant=policy`` config that holds the fewest bytes within ``cfg``'s budget, and the facts for
    ``results.json`` (``quant.auto``); ``at``: this rank's share of the calibration batches; ``lockstep``: layers
    are held by rows (:mod:`lit_ppl.parallel.float_rows`), every rank runs every pass."""
    t0 = time.perf_counter()
    budget = Budget.from_config(cfg)
    kinds = [k for k in cfg.schemes if k != "none"]
    candidates = Candidates(lm, cfg, kinds, calibration, at)
    layers = candidates.layers
    if not layers:
        raise LitPplError(f"quant=auto finds no linear layer that {', '.join(kinds)} can take in {type(lm).__name__}")
    lists = {b[0] for b in map(block_of, layers) if b is not None}
    chunk = auto_chunk("auto", lm.get_output_embeddings().weight.shape[0], CHUNK_BUDGET_MB, "compare")
    blocks = lists.pop() if len(lists) == 1 else None
    meter = Meter(lm, calibration, at.rank, at.size, chunk, blocks, lockstep)
    device = next(lm.parameters()).device

    def measured(quantized: dict[str, str]) -> tuple[float, float]:
        """The budget's cost of these layers quantized together, on every rank's calibration tokens, and its
        upper prediction bound for another text."""
        with installed(lm, {n: candidates.held(n, k) for n, k in quantized.items()}):
            units = ordered_rows(meter.measure().to(device), at).cpu()
        return budget.cost(units), budget.bound(units)

    base = real_units(ordered_rows(meter.measure().to(device), at).cpu()).sum(0)
    fingerprint = {
        "schemes": list(cfg.schemes),
        "method": cfg.method,
        "group_size": cfg.group_size,
        "layers": layers,
        "sensitivity_method": cfg.sensitivity_method,
        "tokens": int(base[3]),
        "nll": float(base[2] / base[3]),  # the float model's mean NLL on the calibration text: model, text, dtype
    }
    cfg = with_sibling_table(cfg, fingerprint)  # a -m sweep: a sibling job measured this table already
    t1 = time.perf_counter()
    table, passes = _table(lm, cfg, candidates, meter, calibration, kinds, fingerprint, at, lockstep)
    t2 = time.perf_counter()
    options = unit_options(candidates, kinds, table, "none" in cfg.schemes)
    weights = candidates.weights
    if budget.metric == "bits":
        chosen, index, rounds = _fit(layers, options, budget, measured, weights, list(cfg.schemes))
    else:
        _check_reachable(budget, layers, options, cfg, bool(cfg.sensitivity and table))
        chosen, index, rounds = _search(layers, options, budget, measured, list(cfg.schemes))
    quantized = {n: candidates.scheme(n, o.kind) for n, o in chosen.items() if o.kind != "none"}
    _check_quantizes(budget, quantized, layers, options, weights)
    policy = policy_node(cfg, quantized)
    seconds = {"passes": passes, "replayed_blocks": meter.replay, "seconds_candidates": t1 - t0}
    seconds |= {"held_by_rows": lockstep}
    seconds |= {"seconds_layers": t2 - t1, "seconds": time.perf_counter() - t0}
    info = facts(
        candidates, budget, layers, options, kinds, chosen, quantized, table, (rounds, index), fingerprint, cfg, seconds
    )
    info["policy"] = policy
    return dataclasses.replace(cfg, name="policy", rules=policy["rules"]), info
