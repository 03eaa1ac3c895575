"""The batch plan: windows per step, each data-parallel rank's share, and the batches a resumed run skips.

One object owns it. The run builds it from the config, the datamodule resolves it once the model is built
(``batch_size=auto``, ``distributed.balance``) and serves batches by it, and the resume callback saves it with the
progress and restores it: the batches of a resumed run are the saved run's only under the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_ppl.errors import LitPplError


@dataclass
class ScorerProbe:
    """What the plan may run to resolve itself: the built scorer and how the run steps it."""

    scorer: Any
    model: str  # the model's path, a key of the autobatch cache
    precision: str
    chunk_size: int
    context: Callable[[], Any]  # the precision plugin's step context
    device: Any


@dataclass
class BatchPlan:
    """How the windows are batched and shared.

    Args:
        batch_size: windows per step, or ``"auto"`` until :meth:`resolve` probes the model.
        balance: ``tokens``, ``weights`` or ``measured`` (:mod:`lit_ppl.data.balance`).
        weights: ``balance=weights``: relative speed per node or per rank.
        autobatch: options of :func:`lit_ppl.data.autobatch.resolve`.
    """

    batch_size: int | str = 8
    balance: str = "tokens"
    weights: list[float] | None = None
    autobatch: dict[str, Any] = field(default_factory=dict)
    rank_weights: list[float] | None = None  # resolved, or restored from saved progress
    measured_tokens_per_s: list[float] | None = None
    skip_batches: int = 0  # batches of every rank already done (resume)
    seq_len: int = 512  # the windows' length, which probes run at (set by the datamodule)

    def __post_init__(self) -> None:
        size = self.batch_size
        if size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise LitPplError(f"batch_size={size!r} must be a positive integer or auto")

    def resolve(self, probe: Callable[[], ScorerProbe], world_size: int, num_nodes: int, tp: int = 1) -> None:
        """Resolve ``batch_size=auto`` and the rank weights (once; a restored plan keeps its saved weights)."""
        from lit_ppl.data.balance import given_weights, measured_weights, probe_tokens_per_s

        if self.batch_size == "auto":
            from lit_ppl.data.autobatch import resolve

            p = probe()
            self.batch_size = resolve(
                p.scorer,
                self.seq_len,
                model=p.model,
                precision=p.precision,
                chunk_size=p.chunk_size,
                context=p.context,
                device=p.device,
                **self.autobatch,
            )
        if self.rank_weights is not None or self.balance == "tokens":
            return
        if self.balance == "weights":
            per_rank = given_weights(self.weights or [], world_size, num_nodes)
            self.rank_weights = per_rank[::tp]  # one per data-parallel rank
            return
        p = probe()
        tokens_per_s = probe_tokens_per_s(p.scorer, self.batch_size, self.seq_len, p.context)
        self.measured_tokens_per_s, self.rank_weights = measured_weights(tokens_per_s)

    # -- resume -----------------------------------------------------------------------------------------------
    def saved(self) -> dict[str, Any]:
        """What progress files keep of the plan."""
        return {"batch_size": self.batch_size, "rank_weights": self.rank_weights}

    def restore(self, saved: dict[str, Any], step: int, where: Path) -> None:
        """Continue the saved plan from ``step``: before the model loads, so a plan that cannot be is refused now."""
        if self.batch_size == "auto":
            # Resolved to the saved size, the batches are the saved plan's: the probe need only say it still fits.
            cap = min(int(self.autobatch.get("max_batch", saved["batch_size"])), saved["batch_size"])
            self.autobatch = {**self.autobatch, "max_batch": cap}
        else:
            self.check(saved, {**saved, "batch_size": self.batch_size}, where)
        self.skip_batches, self.rank_weights = step, saved["rank_weights"]

    @staticmethod
    def check(saved: dict[str, Any], now: dict[str, Any], where: Path) -> None:
        """Refuse progress of another batch plan: its steps were other batches than this run's."""
        if saved == now:
            return
        if saved["batch_size"] != now["batch_size"]:
            what = f"batches of {saved['batch_size']} windows, but this run makes batches of {now['batch_size']}"
            hint = f"set batch_size={saved['batch_size']} if it fits, or delete {where} to start over"
        else:  # restored from the progress, unless it had none and distributed.balance now asks for weights
            what = f"rank weights {saved['rank_weights']}, but this run has {now['rank_weights']}"
            hint = f"resume with the distributed.balance it had, or delete {where} to start over"
        raise LitPplError(f"{where} holds progress of {what}: its steps are other batches than this run's; {hint}")
