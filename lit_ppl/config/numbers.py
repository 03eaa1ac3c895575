"""Which keys of a resolved config decide a run's numbers: the one answer for resume and for comparing runs."""

from __future__ import annotations

from typing import Any

# Keys of a node that never change what is scored: the class that reads it, where caches live, how many
# processes tokenize, and whether rank 0 broadcasts quantized weights or every rank quantizes (the same weights).
IGNORED = {"model": ("_target_",), "data": ("_target_", "cache_dir", "num_proc"), "quant": ("source", "sweep_dir")}
EVAL_NUMBER_KEYS = ("mode", "seq_len", "stride")
# What may change between attempts of one run without changing what its saved progress holds (the batch plan,
# batch_size and autobatch, is checked as resolved: lit_ppl.data.batch_plan).
VOLATILE = ("output_dir", "distributed", "resume", "report", "batch_size", "autobatch", "hydra")


def _without(node: Any, keys: tuple[str, ...]) -> Any:
    return {k: v for k, v in node.items() if k not in keys} if isinstance(node, dict) else node


def number_keys(config: dict[str, Any]) -> dict[str, Any]:
    """What decides the numbers, never the layout: two runs equal here must give the same PPL and token count
    whatever their world size, strategy, batch size or number of nodes."""
    ev = config.get("eval") or {}
    return {
        "model": _without(config.get("model"), IGNORED["model"]),
        "data": _without(config.get("data"), IGNORED["data"]),
        **{k: ev.get(k) for k in EVAL_NUMBER_KEYS},
        "precision": config.get("precision"),
        "quant": _without(config.get("quant"), IGNORED["quant"]),
    }


def progress_keys(config: dict[str, Any]) -> dict[str, Any]:
    """What saved progress must match to be continued: :func:`number_keys`, plus everything else of the run (the
    layout, the rest of ``eval``, the Trainer) except what may change between attempts (:data:`VOLATILE`)."""
    rest = {k: v for k, v in config.items() if k not in (*VOLATILE, "model", "data", "precision", "quant")}
    return {"numbers": number_keys(config), **rest}
