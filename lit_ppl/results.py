"""``results.json``: what a run measured, written atomically, and its Rich summary table."""

from __future__ import annotations

import json
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
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


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write JSON to a temp file in the same directory, fsync, then rename over ``path``.

    A crash or a full disk leaves the previous file intact, never a truncated one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def build_results(stats: dict[str, Any], run: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Assemble the ``results.json`` document from the metric's statistics and the run's facts."""
    seconds = stats["seconds"]
    return {
        "schema_version": SCHEMA_VERSION,
        "ppl": stats["ppl"],
        "nll_mean": stats["nll_mean"],
        "nll_stderr": stats["nll_stderr"],
        "ppl_stderr": stats["ppl_stderr"],
        "ppl_ci95": [stats["ppl_ci95_low"], stats["ppl_ci95_high"]],
        "word_ppl": stats["word_ppl"],
        "byte_ppl": stats["byte_ppl"],
        "bits_per_byte": stats["bits_per_byte"],
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
        "scorer_check": stats.get("scorer_check"),
        "nll_by_position": stats.get("nll_by_position"),
        "config": config,
        "versions": library_versions(),
    }


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
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp)
    else:
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, tmp)
    os.replace(tmp, path)
    return path


def print_table(results: dict[str, Any]) -> None:
    """Print the headline numbers as a Rich table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lit-ppl · {results['mode']} · seq_len {results['seq_len']}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    lo, hi = results["ppl_ci95"]
    rows = [
        ("token perplexity", f"{results['ppl']:.6f}"),
        ("95% interval", f"[{lo:.4f}, {hi:.4f}]"),
        ("mean NLL (nats)", f"{results['nll_mean']:.6f} ± {results['nll_stderr']:.6f}"),
        ("word perplexity", f"{results['word_ppl']:.4f}"),
        ("byte perplexity", f"{results['byte_ppl']:.6f}"),
        ("bits per byte", f"{results['bits_per_byte']:.6f}"),
        ("tokens / words / bytes", f"{results['tokens']:,} / {results['words']:,} / {results['bytes']:,}"),
        ("documents", f"{results['documents']:,}"),
        (
            "world size · strategy · precision",
            f"{results['world_size']} · {results['strategy']} · {results['precision']}",
        ),
        ("seconds · tokens/s", f"{results['seconds']:.2f} · {results['tokens_per_s'] or 0:,.0f}"),
    ]
    quant = results.get("quant")
    if quant:
        rows.append(
            (
                f"quant={quant['name']}",
                f"{quant['quantized_modules']} weights quantized · "
                f"{100 * quant['full_precision_fraction']:.1f}% of weight bytes in full precision",
            )
        )
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
