"""A ``-m`` sweep measures ``quant=auto``'s sensitivity table once: a job with ``quant.sensitivity`` unset reuses the
table of a sibling job (a ``results.json`` under the same sweep directory) measured for the same fingerprint.

The fingerprint (:func:`lit_ppl.quant.auto.search.choose_policy`: schemes, method, group size, layers, calibration
tokens and the float model's NLL on them, ...) is compared whole, so a sibling measured for another model, text or
scheme set is never taken; :func:`lit_ppl.quant.auto.table.load_table` then checks the table itself. The sweep
directory arrives as ``quant.sweep_dir`` (the Hydra entry, :mod:`lit_ppl.validate`, sets it from ``hydra.sweep.dir``
in a multirun; null otherwise). Rank 0's choice is broadcast, so every rank reads the same table even while a
parallel launcher's sibling finishes between the ranks' searches.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

from lit_ppl.config.quant import QuantConfig

log = logging.getLogger(__name__)


def same_fingerprint(mine: dict[str, Any], theirs: Any) -> bool:
    """Whether two fingerprints are the same measurement's: equal keys and values (the NLL, a float, within 1e-9
    relative, as :func:`lit_ppl.quant.auto.table.load_table` accepts it)."""
    if not isinstance(theirs, dict) or set(theirs) != set(mine):
        return False
    for key, value in mine.items():
        other = theirs[key]
        floats = isinstance(value, float) and isinstance(other, int | float) and not isinstance(other, bool)
        if not (math.isclose(value, other, rel_tol=1e-9) if floats else value == other):
            return False
    return True


def _order(path: Path) -> list[Any]:
    """Job directories 0, 1, ..., 10 in numeric order (the sweep's own), not 0, 1, 10, 2."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def sibling_table(sweep_dir: str | Path, fingerprint: dict[str, Any]) -> Path | None:
    """The first ``results.json`` under ``sweep_dir`` (in job order) whose ``quant.auto`` holds a measured table for
    ``fingerprint``; one that reused its own table is taken only if none measured one."""
    found: list[tuple[bool, list[Any], Path]] = []
    for path in Path(sweep_dir).rglob("results.json"):
        try:
            auto = json.loads(path.read_text())["quant"]["auto"]
        except (OSError, ValueError, KeyError, TypeError):  # a job still writing, a failed one, another quant
            continue
        measured = isinstance(auto, dict) and bool(auto.get("sensitivity"))
        if measured and same_fingerprint(fingerprint, auto.get("fingerprint")):
            found.append((bool(auto.get("sensitivity_from")), _order(path.relative_to(sweep_dir)), path))
    return min(found)[2] if found else None


def _from_rank0(path: Path | None) -> Path | None:
    """Rank 0's ``path`` on every rank (a no-op in one process): siblings seen by the ranks may differ."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return path
    box = [None if path is None else str(path)]
    dist.broadcast_object_list(box, src=0)  # within the process group's timeout (distributed.timeout_s)
    return None if box[0] is None else Path(box[0])


def with_sibling_table(cfg: QuantConfig, fingerprint: dict[str, Any]) -> QuantConfig:
    """``cfg`` with ``quant.sensitivity`` set to a sibling job's table in ``quant.sweep_dir`` for ``fingerprint``
    (one log line), or unchanged: a table given, or none to find. Called on every rank."""
    if cfg.sensitivity:
        return cfg
    found = sibling_table(cfg.sweep_dir, fingerprint) if cfg.sweep_dir and Path(cfg.sweep_dir).is_dir() else None
    found = _from_rank0(found)
    if found is None:
        return cfg
    log.warning("quant=auto: reusing the sensitivity table of the sweep's job %s (same fingerprint)", found.parent)
    return dataclasses.replace(cfg, sensitivity=str(found))
