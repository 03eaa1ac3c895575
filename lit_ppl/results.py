"""``results.json``: what a run measured, written atomically, and its Rich summary table."""

from __future__ import annotations

import json
import os
import resource
import sys
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


def host_rss(field: str = "VmRSS") -> int:
    """This process's current (``VmRSS``) or peak (``VmHWM``) resident set size in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_memory(device: Any) -> tuple[int, int]:
    """This process's peak host RSS in KiB and, on a CUDA ``device``, its peak allocated bytes there (else -1).

    Integers, so that the ranks' figures travel in the same int64 all-gather as their token counts.
    """
    import torch

    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the process that forked this one, so a rank
    # started by a 1.3 GB pytest (or by rank 0) reported its parent's peak (measured: 1305.9 MB on rank 0 of every
    # layout, whatever it loaded).
    try:
        rss_kib = host_rss("VmHWM") // 1024
    except (OSError, RuntimeError):  # not Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_kib = rss // 1024 if sys.platform == "darwin" else rss  # bytes on macOS, KiB on Linux
    on_cuda = getattr(device, "type", None) == "cuda"
    return rss_kib, int(torch.cuda.max_memory_allocated(device)) if on_cuda else -1


def rank_memory(rss_kib: list[int], device_bytes: list[int]) -> dict[str, list[float] | None]:
    """``rank_peak_rss_mb`` and ``rank_peak_device_mb`` (``None`` off CUDA) from every rank's :func:`peak_memory`."""
    on_cuda = all(b >= 0 for b in device_bytes)
    return {
        "rank_peak_rss_mb": [round(k / 1024, 1) for k in rss_kib],
        "rank_peak_device_mb": [round(b / 2**20, 1) for b in device_bytes] if on_cuda else None,
    }


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to a temp file in the same directory, fsync, then rename over ``path``.

    A crash or a full disk leaves the previous file intact, never a truncated one, and concurrent writers (one
    per Slurm job of a sweep) replace it whole: a reader never sees half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        # Name the file the caller asked for, not a temp name it never heard of (OSError picks the subclass).
        raise OSError(err.errno, err.strerror, str(path)) from err
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """``obj`` as strict JSON (no NaN/inf: other readers reject them), written by :func:`write_text_atomic`."""
    return write_text_atomic(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


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
        "rank_peak_rss_mb": stats.get("rank_peak_rss_mb"),
        "rank_peak_device_mb": stats.get("rank_peak_device_mb"),
        "rank_weight_bytes": stats.get("rank_weight_bytes"),
        "scorer_check": stats.get("scorer_check"),
        "nll_by_position": stats.get("nll_by_position"),
        "config": config,
        "versions": library_versions(),
    }


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
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp)
    else:
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, tmp)
    os.replace(tmp, path)
    return path


def per_rank(values: list[float]) -> str:
    """Few ranks: every value; many: the max and the min, with their ranks."""
    if len(values) <= 4:
        return " · ".join(f"{v:,.0f}" for v in values)
    hi, lo = max(range(len(values)), key=values.__getitem__), min(range(len(values)), key=values.__getitem__)
    return f"max {values[hi]:,.0f} (rank {hi}) · min {values[lo]:,.0f} (rank {lo})"


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
    layout = results.get("parallel")
    if layout and layout["kind"] not in ("single", "ddp"):  # a split model: what each rank holds is the point
        dims = f"{layout['dp_replicate']} × {layout['dp_shard']} × {layout['tp']}"
        rows.append(("layout dp_replicate × dp_shard × tp", dims))
        rows.append(("weights per rank (MB)", per_rank([round(b / 2**20, 1) for b in results["rank_weight_bytes"]])))
    for key, name in (
        ("rank_peak_rss_mb", "peak RSS per rank (MB)"),
        ("rank_peak_device_mb", "peak GPU per rank (MB)"),
    ):
        if results.get(key):
            rows.append((name, per_rank(results[key])))
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


def print_compare_table(compare: dict[str, Any]) -> None:
    """Print llama.cpp-style headline statistics of a comparison (``results.json``'s ``compare``)."""
    from rich.console import Console
    from rich.table import Table

    c = compare
    table = Table(title=f"candidate vs reference · {c['tokens']:,} tokens")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    rows = [
        ("PPL(Q) · PPL(base)", f"{c['ppl']:.6f} ± {c['ppl_unc']:.6f} · {c['ppl_base']:.6f} ± {c['ppl_base_unc']:.6f}"),
        ("Cor(ln PPL(Q), ln PPL(base))", f"{100 * c['ln_ppl_correlation']:.2f}%"),
        ("PPL(Q)/PPL(base)", f"{c['ppl_ratio']:.6f} ± {c['ppl_ratio_unc']:.6f}"),
        ("mean KLD", f"{c['kld_mean']:.6f} ± {c['kld_mean_unc']:.6f}"),
        (
            "KLD max · 99% · median · min",
            f"{c['kld_max']:.6f} · {c['kld_p99']:.6f} · {c['kld_p50']:.6f} · {c['kld_min']:.6f}",
        ),
        ("mean Δp · RMS Δp", f"{100 * c['p_diff_mean']:.3f}% · {100 * c['p_diff_rms']:.3f}%"),
        ("same top-1", f"{100 * c['same_top']:.3f} ± {100 * c['same_top_unc']:.3f}%"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
