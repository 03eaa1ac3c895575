"""``results.json``: the document a run writes (its schema and its one builder) and the per-document table."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_ppl.runtime.files import atomic_path, write_text_atomic

SCHEMA_VERSION = 1
# In a single run the entry hands Hydra this override, so that Hydra's copies of the config are written by
# write_hydra_files once the run holds output_dir's lock: a run refused there changes nothing in it.
DEFER_HYDRA_FILES = "++hydra.output_subdir=null"
HYDRA_FILES = ".hydra"
LIBRARIES = ("lit-ppl", "torch", "lightning", "torchmetrics", "transformers", "datasets", "torchao", "hydra-core")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that decide the numbers."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def write_hydra_files(directory: Path, task_cfg: DictConfig) -> None:
    """Hydra's ``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` in ``directory``, where the entry
    deferred them (:data:`DEFER_HYDRA_FILES`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or DEFER_HYDRA_FILES not in HydraConfig.get().overrides.hydra:
        return
    hydra_cfg = HydraConfig.instance().cfg
    files = {"config.yaml": task_cfg, "hydra.yaml": hydra_cfg, "overrides.yaml": hydra_cfg.hydra.overrides.task}
    for name, node in files.items():
        write_text_atomic(directory / HYDRA_FILES / name, OmegaConf.to_yaml(node))


def build_results(
    stats: dict[str, Any], fields: dict[str, Any], run: dict[str, Any], config: dict[str, Any]
) -> dict[str, Any]:
    """The ``results.json`` document: the metric's statistics, the module's own ``fields`` (its quantization, a
    comparison's statistics: ``PerplexityModule.result_fields``), the run's facts and its resolved config."""
    seconds = stats["seconds"]
    results = {
        "schema_version": SCHEMA_VERSION,
        "ppl": stats["ppl"],
        "nll_mean": stats["nll_mean"],
        "nll_stderr": stats["nll_stderr"],
        "ppl_stderr": stats["ppl_stderr"],
        "ppl_ci95": [stats["ppl_ci95_low"], stats["ppl_ci95_high"]],
        # None where no words or bytes were counted (eval.mode=llamacpp scores only part of its chunks' text).
        "word_ppl": stats["word_ppl"] if stats["words"] else None,
        "byte_ppl": stats["byte_ppl"] if stats["bytes"] else None,
        "bits_per_byte": stats["bits_per_byte"] if stats["bytes"] else None,
        "nll_sum": stats["nll_sum"],
        "tokens": stats["tokens"],
        "words": stats["words"],
        "bytes": stats["bytes"],
        "documents": stats["documents"],
        **run,
        "seconds": seconds,
        "tokens_per_s": stats["tokens"] / seconds if seconds > 0 else None,
        "sync_seconds": stats["sync_seconds"],
        "rank_tokens": stats["rank_tokens"],
        "rank_steps": stats["rank_steps"],
        "rank_peak_rss_mb": stats.get("rank_peak_rss_mb"),
        "rank_peak_device_mb": stats.get("rank_peak_device_mb"),
        "rank_weight_bytes": stats.get("rank_weight_bytes"),
        "scorer_check": stats.get("scorer_check"),
        "nll_by_position": stats.get("nll_by_position"),
        "config": config,
        "versions": library_versions(),
        **fields,
    }
    _auto_evaluated(results)
    return results


def _auto_evaluated(results: dict[str, Any]) -> None:
    """``quant.auto``'s budget measured on the evaluated text, when the run compares with the unquantized model:
    the mean KLD, or ``|PPL / PPL_base − 1|``, and whether it is within the budget (a size budget: the KLD, no
    loss to be within)."""
    auto, compare = (results.get("quant") or {}).get("auto"), results.get("compare")
    if not auto or not compare or (results.get("reference_quant") or {}).get("name", "none") != "none":
        return
    ((metric, value),) = auto["budget"].items()
    measured = abs(compare["ppl_ratio"] - 1.0) if metric == "ppl_increase" else compare["kld_mean"]
    auto["measured_evaluated"] = measured
    auto["met"]["evaluated"] = None if metric == "bits" else bool(measured <= value)


def quant_name(run: dict[str, Any]) -> str:
    """The run's quantization: the applied report's name, else the configured one, else ``none``."""
    applied = run.get("quant")
    if isinstance(applied, dict) and applied.get("name"):
        return str(applied["name"])
    return str(run.get("config", {}).get("quant", {}).get("name", "none"))


def batch_size(run: dict[str, Any]) -> Any:
    """Windows per step: the resolved number (also under ``batch_size=auto``), else the configured value, else None."""
    resolved = run.get("batch_size")
    return resolved if resolved is not None else run.get("config", {}).get("batch_size")


def write_per_document(path: Path, tokens: Any, nll_sum: Any) -> Path:
    """The per-document table (id, tokens, NLL sum, mean NLL, PPL) as CSV or Parquet, by ``path``'s suffix."""
    import pyarrow as pa

    n = tokens.double().clamp_min(1)
    table = pa.table(
        {
            "id": list(range(len(tokens))),
            "tokens": tokens.long().tolist(),
            "nll_sum": nll_sum.tolist(),
            "nll_mean": (nll_sum / n).tolist(),
            "ppl": (nll_sum / n).exp().tolist(),
        }
    )
    with atomic_path(path) as tmp:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        else:
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, tmp)
    return path
