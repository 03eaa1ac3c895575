"""``results.json``'s ``quant.auto``: what :func:`lit_ppl.quant.auto.search.choose_policy` chose, measured and
spent, and the log's one line."""

from __future__ import annotations

import logging
from typing import Any

from lit_ppl.config.quant import QuantConfig
from lit_ppl.quant.auto.budget import Budget, Option, packed_bytes
from lit_ppl.quant.auto.candidates import Candidates
from lit_ppl.quant.auto.table import Table
from lit_ppl.quant.schemes import NONE

log = logging.getLogger(__name__)


def facts(
    candidates: Candidates,
    budget: Budget,
    layers: list[str],
    options: list[list[Option]],
    kinds: list[str],
    chosen: dict[str, Option],
    quantized: dict[str, Any],
    table: Table,
    search: tuple[list[dict[str, Any]], int],
    fingerprint: dict[str, Any],
    cfg: QuantConfig,
    measurement: dict[str, Any],
) -> dict[str, Any]:
    """``results.json``'s ``quant.auto`` (without the policy), and the log's one line; ``search``: every round
    and the chosen one's index."""
    rounds, index = search
    last = rounds[index]
    by_scheme: dict[str, dict[str, int]] = {}
    for name, option in chosen.items():
        label = quantized[name][0].label if name in quantized else "none"
        entry = by_scheme.setdefault(label, {"layers": 0, "bytes": 0})
        entry["layers"], entry["bytes"] = entry["layers"] + 1, entry["bytes"] + option.bytes
    full = sum(packed_bytes(NONE, candidates.tensor(n)) for n in layers)
    uniform = {k: sum(next((o.bytes for o in u if o.kind == k), u[0].bytes) for u in options) for k in kinds}
    info = {
        "budget": {budget.metric: budget.value},
        "predicted": last["predicted"] if table else None,  # nothing measured alone: nothing predicted
        "bound": last["bound"],  # one-sided upper prediction bound at CONFIDENCE for another text
        "measured_calibration": last["measured"],
        "measured_evaluated": None,  # the evaluated text's, set with results.json when the run compares
        "met": met(budget, last, table),
        "bytes": last["bytes"],
        "bits": 8 * last["bytes"] / candidates.weights,  # per weight of the candidates, as quant.budget.bits
        "bytes_full_precision": full,
        "bytes_uniform": uniform,  # every layer the scheme takes; the rest in full precision
        "by_scheme": by_scheme,
        "rounds": rounds,
        "chosen_round": index + 1,
        "choice": {name: option.kind for name, option in chosen.items()},
        "calibration_tokens": fingerprint["tokens"],
        "fingerprint": fingerprint,
        "sensitivity_from": cfg.sensitivity,
        "measurement": measurement,
        "sensitivity": table,
    }
    predicted = "" if info["predicted"] is None else f", predicted {info['predicted']:.4g}"
    log.warning(
        "quant=auto: %s within %s=%g (measured %.4g on the calibration text%s): %d of %d bytes, %.4g bits per weight",
        ", ".join(f"{v['layers']} {k}" for k, v in by_scheme.items()),
        budget.metric,
        budget.value,
        info["measured_calibration"],
        predicted,
        info["bytes"],
        full,
        info["bits"],
    )
    return info


def met(budget: Budget, last: dict[str, Any], table: Table) -> dict[str, bool | None]:
    """Whether each figure of the chosen assignment is within the budget (``evaluated``: set with results.json);
    a size budget limits no loss (its bytes are within it by construction): none."""
    if budget.metric == "bits":
        return dict.fromkeys(("predicted", "bound", "calibration", "evaluated"))
    within = {key: bool(last[key] <= budget.value) for key in ("predicted", "bound", "measured")}
    return {
        "predicted": within["predicted"] if table else None,
        "bound": within["bound"],
        "calibration": within["measured"],
        "evaluated": None,
    }
