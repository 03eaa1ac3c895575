"""``quant=auto``: precision per layer, chosen by measured sensitivity under a budget.

1. Every quantizable layer's candidates: its weight under each scheme of ``quant.schemes`` (int4 by
   ``quant.method``, with the group fallback; int8 by round-to-nearest), the calibrated ones from statistics
   reduced over the ranks like AWQ's and GPTQ's (:mod:`lit_ppl.quant.candidates`).
2. Each candidate measured alone on the calibration text: the mean KL divergence from the float model and the
   change in mean NLL (:class:`lit_ppl.quant.sensitivity.Probe`), summed over the ranks in float64 with one
   ``all_reduce``, so every rank holds the same numbers and makes the same choice.
3. The assignment with the fewest weight bytes whose summed cost stays within the budget: a multiple-choice
   knapsack solved by dynamic programming over the budget in 4,000 steps, each cost rounded up, so the
   prediction never exceeds the budget (:mod:`lit_ppl.quant.budget`).
4. The assignment measured as a whole on the calibration text; interactions make that differ from the sum, so
   while it exceeds the budget the search target shrinks by the ratio and the knapsack runs again (at most
   :data:`ROUNDS` times).

The choice becomes ``quant=policy`` rules, one per layer (written next to ``results.json`` as
``quant_policy.yaml``), applied by :func:`lit_ppl.quant.apply.quantize_model` like any policy.
Bytes: :func:`lit_ppl.quant.budget.packed_bytes`.
"""

from __future__ import annotations

import logging
import math
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.model.nll import auto_chunk
from lit_ppl.quant.budget import Budget, Option, cheapest, packed_bytes
from lit_ppl.quant.calibration import Calibration, all_reduce, block_of
from lit_ppl.quant.candidates import Candidates, installed
from lit_ppl.quant.plan import Scheme
from lit_ppl.quant.sensitivity import Probe

log = logging.getLogger(__name__)

ROUNDS = 6  # whole-assignment measurements before giving up on a shrinking target
SHRINK = 0.95  # the next target is this times budget / measured (below the plain ratio: interactions add up)
CHUNK_BUDGET_MB = 256  # float64 statistics per chunk of positions, as eval.chunk_budget_mb


Table = dict[str, dict[str, dict[str, float]]]  # layer -> scheme -> {"kld", "nll_delta"}


def measure_layers(
    lm: nn.Module, candidates: Candidates, probe: Probe, kinds: list[str], world_size: int
) -> tuple[Table, int]:
    """Every candidate alone against the float model: ``{layer: {scheme: {kld, nll_delta}}}`` (means over the
    calibration tokens of every rank) and the number of passes."""
    layers = candidates.layers
    local = torch.zeros(len(layers), len(kinds), 4, dtype=torch.float64)
    passes, t0, last = 0, time.perf_counter(), None
    for u, name in enumerate(layers):
        where = block_of(name)
        if where is not None:
            probe.advance(where[1])  # with float weights: the kept block inputs are the float model's
        if where != last and last is not None:  # an hour on a large model: say where it is
            log.info(
                "quant=auto: measured %d of %d layers (%d passes, %.0f s)",
                u,
                len(layers),
                passes,
                time.perf_counter() - t0,
            )
        last = where
        for j, kind in enumerate(kinds):
            if candidates.scheme(name, kind) is not None:
                with installed(lm, {name: candidates.weight(name, kind)}):
                    local[u, j] = probe.measure(where[1] if where else None)
                passes += 1
    sums = all_reduce(local.to(next(lm.parameters()).device), world_size).cpu()
    table = {
        name: {
            kind: {
                "kld": float(sums[u, j, 0] / sums[u, j, 3]),
                "nll_delta": float((sums[u, j, 1] - sums[u, j, 2]) / sums[u, j, 3]),
            }
            for j, kind in enumerate(kinds)
            if candidates.scheme(name, kind) is not None
        }
        for u, name in enumerate(layers)
    }
    return table, passes


def load_table(path: str, fingerprint: dict[str, Any], measured: dict[str, list[str]]) -> Table:
    """The sensitivities of an earlier ``quant=auto`` run (its ``results.json`` or directory), if they were measured
    for this model, calibration text and schemes (``fingerprint``) and hold a finite measurement (KLD >= 0) of
    every candidate of ``measured`` (layer -> its schemes), else one line saying what differs or is wrong."""
    import json

    file = Path(path).expanduser()
    file = file / "results.json" if file.is_dir() else file
    try:
        auto = json.loads(file.read_text())["quant"]["auto"]
        theirs, table = auto["fingerprint"], auto["sensitivity"]
        if not isinstance(theirs, dict) or not isinstance(table, dict):
            raise TypeError("its quant.auto.fingerprint and quant.auto.sensitivity must be objects")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LitPplError(
            f"quant.sensitivity={path!r} is not the results.json of a quant=auto run ({type(err).__name__}: {err})"
        ) from None
    for key, mine in fingerprint.items():
        other = theirs.get(key)
        number = isinstance(other, int | float) and not isinstance(other, bool)
        same = math.isclose(mine, other, rel_tol=1e-9) if key == "nll" and number else mine == other
        if not same:
            raise LitPplError(
                f"quant.sensitivity={path!r} was measured with {key}={other!r}, this run has {mine!r}: measure again "
                "(quant.sensitivity=null)"
            )
    extra = sorted(set(table) - set(measured))
    if extra:
        raise LitPplError(f"quant.sensitivity={path!r} measures {extra[0]}, which is no candidate layer of this model")
    for layer, kinds in measured.items():
        row = table.get(layer)
        if not isinstance(row, dict) or sorted(row) != sorted(kinds):
            raise LitPplError(
                f"quant.sensitivity={path!r} holds {sorted(row) if isinstance(row, dict) else row!r} for {layer}, "
                f"not one measurement per scheme {kinds}: it is damaged or edited; measure again "
                "(quant.sensitivity=null)"
            )
        for kind in kinds:
            entry = row[kind] if isinstance(row[kind], dict) else {}
            for name, least in (("kld", 0.0), ("nll_delta", -math.inf)):
                value = entry.get(name)
                if isinstance(value, bool) or not isinstance(value, int | float) or not least <= value < math.inf:
                    what = "a finite number >= 0" if least == 0 else "a finite number"
                    raise LitPplError(
                        f"quant.sensitivity={path!r}: {layer} {kind} {name}={value!r} is not {what}: the table is "
                        "damaged or edited; measure again (quant.sensitivity=null)"
                    )
    return table


def unit_options(
    lm: nn.Module, candidates: Candidates, kinds: list[str], table: Table, keep_none: bool
) -> list[list[Option]]:
    """Per layer, the options the knapsack chooses among (full precision first, if ``quant.schemes`` has it)."""
    out = []
    for name in candidates.layers:
        weight = lm.get_submodule(name).weight
        unit = [Option("none", packed_bytes(Scheme("none"), weight))]
        for kind in kinds:
            chosen = candidates.scheme(name, kind)
            if chosen is not None:
                unit.append(Option(kind, packed_bytes(chosen[0], weight), **table.get(name, {}).get(kind, {})))
        out.append(unit[1:] if not keep_none and len(unit) > 1 else unit)
    return out


def choose_policy(
    lm: nn.Module, cfg: dict[str, Any], calibration: Calibration, rank: int, world_size: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``quant=policy`` node that holds the fewest bytes within ``cfg``'s budget, and the facts for
    ``results.json`` (``quant.auto``)."""
    t0 = time.perf_counter()
    budget = Budget.from_node(cfg)
    kinds = [k for k in cfg["schemes"] if k != "none"]
    if cfg["gptq"]["sequential"]:
        raise LitPplError(
            "quant=auto with quant.gptq.sequential=true: each layer is measured alone, on the float model's inputs; "
            "use quant.gptq.sequential=false"
        )
    candidates = Candidates(lm, cfg, kinds, calibration, (rank, world_size))
    layers = candidates.layers
    if not layers:
        raise LitPplError(f"quant=auto finds no linear layer that {', '.join(kinds)} can take in {type(lm).__name__}")
    lists = {b[0] for b in map(block_of, layers) if b is not None}
    chunk = auto_chunk("auto", lm.get_output_embeddings().weight.shape[0], CHUNK_BUDGET_MB, "compare")
    probe = Probe(lm, calibration, rank, world_size, chunk, lists.pop() if len(lists) == 1 else None)
    device = next(lm.parameters()).device

    def measured(quantized: dict[str, str]) -> tuple[float, torch.Tensor]:
        """The budget's cost of these layers quantized together, on every rank's calibration tokens."""
        with installed(lm, {n: candidates.weight(n, k) for n, k in quantized.items()}):
            sums = all_reduce(probe.measure().to(device), world_size).cpu()
        return budget.cost(sums), sums

    _, base = measured({})
    fingerprint = {
        "schemes": list(cfg["schemes"]),
        "method": cfg["method"],
        "group_size": cfg["group_size"],
        "layers": layers,
        "tokens": int(base[3]),
        "nll": float(base[2] / base[3]),  # the float model's mean NLL on the calibration text: model, text, dtype
    }
    t1 = time.perf_counter()
    keep_none = "none" in cfg["schemes"]
    table, passes = {}, 0
    if not any(len(u) > 1 for u in unit_options(lm, candidates, kinds, table, keep_none)):
        pass  # one option per layer (e.g. quant.schemes=[int8]): nothing to choose, only the whole to measure
    elif cfg["sensitivity"]:
        expected = {n: [k for k in kinds if candidates.scheme(n, k) is not None] for n in layers}
        table = load_table(cfg["sensitivity"], fingerprint, expected)
    else:
        table, passes = measure_layers(lm, candidates, probe, kinds, world_size)
    t2 = time.perf_counter()
    options = unit_options(lm, candidates, kinds, table, keep_none)
    floor = sum(min(o.cost(budget) for o in unit) for unit in options)
    if floor > budget.limit:
        reused = f" from quant.sensitivity={cfg['sensitivity']!r}" if cfg["sensitivity"] and table else ""
        raise LitPplError(
            f"quant.budget.{budget.metric}={budget.value:g} cannot be met with quant.schemes={list(cfg['schemes'])}: "
            f"the least reachable on the calibration text is {budget.shown(floor):.4g} (predicted{reused}); raise the "
            "budget or add none to quant.schemes"
        )
    rounds, target, chosen, tried = [], budget.limit, None, set()
    for _ in range(ROUNDS):
        picks = cheapest([[(o.bytes, o.cost(budget)) for o in unit] for unit in options], target)
        if picks is None or tuple(picks) in tried:  # nothing fits a smaller target, or no other choice
            break
        tried.add(tuple(picks))
        picked = {n: options[u][j] for u, (n, j) in enumerate(zip(layers, picks, strict=True))}
        cost, _ = measured({n: o.kind for n, o in picked.items() if o.kind != "none"})
        predicted = sum(o.cost(budget) for o in picked.values())
        size = sum(o.bytes for o in picked.values())
        shown = {"predicted": budget.shown(predicted), "measured": budget.shown(cost), "bytes": size}
        rounds.append({"target": budget.shown(target), **shown})
        if cost <= budget.limit:
            chosen = picked
            break
        # Below this assignment's own prediction, scaled by how far the whole overshot it: the next round must
        # choose another (a target that only shrinks from the budget may still admit the same one).
        target = min(target, predicted) * SHRINK * budget.limit / cost
    if chosen is None:
        # No round at all: costs rounded up to the budget's steps left no assignment within it (floor is close).
        best, how = min(((r["measured"], "measured") for r in rounds), default=(budget.shown(floor), "predicted"))
        raise LitPplError(
            f"quant.budget.{budget.metric}={budget.value:g} is not met on the calibration text: the best reachable "
            f"with quant.schemes={list(cfg['schemes'])} is {best:.4g} ({how}, {len(rounds)} assignments tried); "
            "raise the budget"
        )
    quantized = {n: candidates.scheme(n, o.kind) for n, o in chosen.items() if o.kind != "none"}
    if not quantized:
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
    by_scheme: dict[str, dict[str, int]] = {}
    for name, option in chosen.items():
        label = quantized[name][0].label if name in quantized else "none"
        entry = by_scheme.setdefault(label, {"layers": 0, "bytes": 0})
        entry["layers"], entry["bytes"] = entry["layers"] + 1, entry["bytes"] + option.bytes
    full = sum(packed_bytes(Scheme("none"), lm.get_submodule(n).weight) for n in layers)
    uniform = {k: sum(next((o.bytes for o in u if o.kind == k), u[0].bytes) for u in options) for k in kinds}
    policy = policy_node(cfg, quantized)
    info = {
        "budget": {budget.metric: budget.value},
        "predicted": rounds[-1]["predicted"] if table else None,  # nothing measured alone: nothing predicted
        "measured_calibration": rounds[-1]["measured"],
        "bytes": rounds[-1]["bytes"],
        "bytes_full_precision": full,
        "bytes_uniform": uniform,  # every layer the scheme takes; the rest in full precision
        "by_scheme": by_scheme,
        "rounds": rounds,
        "choice": {name: option.kind for name, option in chosen.items()},
        "calibration_tokens": fingerprint["tokens"],
        "fingerprint": fingerprint,
        "sensitivity_from": cfg["sensitivity"],
        "measurement": {
            "passes": passes,
            "replayed_blocks": probe.replay,
            "seconds_candidates": t1 - t0,
            "seconds_layers": t2 - t1,
            "seconds": time.perf_counter() - t0,
        },
        "sensitivity": table,
        "policy": policy,
    }
    predicted = "" if info["predicted"] is None else f", predicted {info['predicted']:.4g}"
    log.warning(
        "quant=auto: %s within %s=%g (measured %.4g on the calibration text%s): %d of %d bytes",
        ", ".join(f"{v['layers']} {k}" for k, v in by_scheme.items()),
        budget.metric,
        budget.value,
        info["measured_calibration"],
        predicted,
        info["bytes"],
        full,
    )
    return {**cfg, "name": "policy", "rules": policy["rules"]}, info


def policy_node(cfg: dict[str, Any], chosen: dict[str, tuple[Scheme, str]]) -> dict[str, Any]:
    """The chosen assignment as a ``quant=policy`` node: one rule per quantized layer (full precision: no rule)."""
    rules = []
    for name, (scheme, method) in chosen.items():
        rule: dict[str, Any] = {"match": f"^{re.escape(name)}$", "config": scheme.kind}
        if scheme.kind == "int4":
            rule["group_size"] = scheme.group_size
        rule["method"] = method
        rules.append(rule)
    node = {k: cfg[k] for k in ("method", "group_size", "backend", "source")}
    calibrated = {r["method"] for r in rules} & {"awq", "gptq"}
    if calibrated:
        node["calibration"] = dict(cfg["calibration"])
    if "gptq" in calibrated:
        node["gptq"] = dict(cfg["gptq"])
    return {"name": "policy", **node, "group_fallback": False, "rules": rules}


POLICY_FILE = "quant_policy.yaml"  # next to results.json


def write_policy(path: Path, auto: dict[str, Any]) -> Path:
    """The chosen policy as a ``quant`` config file: with it at ``DIR/quant/NAME.yaml``,
    ``hydra.searchpath=[file://DIR] quant=NAME`` evaluates the same quantization without measuring again."""
    import yaml

    from lit_ppl.runtime.files import write_text_atomic

    ((metric, value),) = auto["budget"].items()
    predicted = "" if auto["predicted"] is None else f" (predicted {auto['predicted']:.4g})"
    header = (
        f"# quant=auto: {metric} budget {value:g}; measured {auto['measured_calibration']:.4g} on "
        f"{auto['calibration_tokens']} calibration tokens{predicted};\n"
        f"# {auto['bytes']} weight bytes of {auto['bytes_full_precision']} in full precision. "
        "Layers no rule matches stay in full precision.\n"
    )
    body = yaml.safe_dump(auto["policy"], sort_keys=False, default_flow_style=None, width=200)
    return write_text_atomic(path, header + body)
