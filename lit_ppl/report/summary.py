"""The summary a run prints: its headline numbers and, when comparing, llama.cpp's KL statistics (Rich tables)."""

from __future__ import annotations

from typing import Any


def per_rank(values: list[float]) -> str:
    """Few ranks: every value; many: the max and the min, with their ranks."""
    if len(values) <= 4:
        return " · ".join(f"{v:,.0f}" for v in values)
    hi, lo = max(range(len(values)), key=values.__getitem__), min(range(len(values)), key=values.__getitem__)
    return f"max {values[hi]:,.0f} (rank {hi}) · min {values[lo]:,.0f} (rank {lo})"


def _number(value: float | None, digits: int) -> str:
    """``value`` to ``digits`` decimals, or ``n/a`` where the mode does not define it."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_results_table(results: dict[str, Any]) -> None:
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
        ("word perplexity", _number(results["word_ppl"], 4)),
        ("byte perplexity", _number(results["byte_ppl"], 6)),
        ("bits per byte", _number(results["bits_per_byte"], 6)),
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
    if quant and quant.get("source") == "checkpoint":  # quantized by another tool, evaluated as stored
        held = quant.get("ggml_types")  # a GGUF's tensors of each GGML type, else the quantized modules
        bits = f" · {quant['bits']:.2f} bits" if quant.get("bits") else ""
        count = f"{quant.get('quantized_modules', 0)} modules"
        types = " ".join(f"{k}×{v}" for k, v in sorted(held.items(), key=lambda kv: -kv[1])) if held else count
        rows.append(("quant (checkpoint)", f"{quant['name']}{bits} · {types}"))
    elif quant:
        rows.append(
            (
                f"quant={quant['name']}",
                f"{quant['quantized_modules']} weights quantized · "
                f"{100 * quant['full_precision_fraction']:.1f}% of weight bytes in full precision",
            )
        )
    saved, store = results.get("saved_reference"), results.get("reference_store")
    if saved:
        rows.append(("saved reference", f"{saved['path']} · {saved['bytes'] / 2**20:,.1f} MiB"))
    if store:
        quant = store.get("quant")
        weights = f"quant={quant['name']}" if quant else "unquantized"
        rows.append(("reference", f"saved: {store['store']} ({store['model']}, {weights}, {store['dtype']} states)"))
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
        *noise_floor_rows(c.get("noise_floor")),
        ("mean reverse KLD, KL(Q‖base)", f"{c['kld_rev_mean']:.6f} ± {c['kld_rev_mean_unc']:.6f}"),
        (
            "KLD max · 99% · median · min",
            f"{c['kld_max']:.6f} · {c['kld_p99']:.6f} · {c['kld_p50']:.6f} · {c['kld_min']:.6f}",
        ),
        ("mean Δp · RMS Δp", f"{100 * c['p_diff_mean']:.3f}% · {100 * c['p_diff_rms']:.3f}%"),
        ("same top-1", f"{100 * c['same_top']:.3f} ± {100 * c['same_top_unc']:.3f}%"),
    ]
    for b in c.get("kld_by_top_p") or []:
        if b["tokens"]:  # the reference's top-1 probability: where the mean KLD comes from
            lo, hi = b["top_p"]
            rows.append(
                (
                    f"  base top-1 p in [{lo:.2f}, {hi:.2f}{']' if hi == 1 else ')'}",
                    f"{100 * b['share']:.1f}% · KLD {b['kld_mean']:.3g} · rev {b['kld_rev_mean']:.3g} · "
                    f"top-1 {100 * b['same_top']:.1f}%",
                )
            )
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def noise_floor_rows(floor: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The reference's noise floor beside the mean KLD: what rounding alone gives (none when it is off)."""
    if not floor:
        return []
    if floor.get("kld_mean") is None:
        return [("  noise floor", f"not measured: {floor.get('note')}")]
    return [
        (
            "  noise floor (float64 re-score)",
            f"{floor['kld_mean']:.3g} ± {floor['kld_mean_unc']:.2g} · {floor['windows']} windows, "
            f"{floor['tokens']:,} tokens · {floor['precision']}",
        )
    ]
