"""``quant=auto``'s sensitivity table: every candidate measured alone, or an earlier run's table checked and reused."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_ppl.errors import LitPplError
from lit_ppl.quant.auto.candidates import Candidates, installed
from lit_ppl.quant.auto.sensitivity import Meter
from lit_ppl.quant.calibrated.stream import Where, block_of, ordered_sum

log = logging.getLogger(__name__)

Table = dict[str, dict[str, dict[str, float]]]  # layer -> scheme -> {"kld", "nll_delta"}


def measure_layers(
    lm: nn.Module, candidates: Candidates, meter: Meter, kinds: list[str], at: Where
) -> tuple[Table, int]:
    """Every candidate alone against the float model: ``{layer: {scheme: {kld, nll_delta}}}`` (means over the
    calibration tokens of every rank) and the number of passes."""
    layers = candidates.layers
    local = torch.zeros(meter.steps, len(layers), len(kinds), 4, dtype=torch.float64)
    passes, t0, last = 0, time.perf_counter(), None
    for u, name in enumerate(layers):
        where = block_of(name)
        if where is not None:
            meter.advance(where[1])  # with float weights: the kept block inputs are the float model's
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
                with installed(lm, {name: candidates.held(name, kind)}):
                    local[:, u, j] = meter.measure(where[1] if where else None).sum(1)
                passes += 1
    return table_from_sums(ordered_sum(local.to(next(lm.parameters()).device), at).cpu(), candidates, kinds), passes


def table_from_sums(sums: torch.Tensor, candidates: Candidates, kinds: list[str]) -> Table:
    """``{layer: {scheme: {kld, nll_delta}}}`` from ``(Σ KLD, Σ NLL, Σ NLL of the float model, tokens)`` per
    candidate and scheme, summed over every rank's calibration tokens."""
    return {
        name: {
            kind: {
                "kld": float(sums[u, j, 0] / sums[u, j, 3]),
                "nll_delta": float((sums[u, j, 1] - sums[u, j, 2]) / sums[u, j, 3]),
            }
            for j, kind in enumerate(kinds)
            if candidates.scheme(name, kind) is not None
        }
        for u, name in enumerate(candidates.layers)
    }


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
