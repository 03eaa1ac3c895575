"""quant=auto's sensitivity estimate against the exact measurement, side by side in one run.

For each ``quant.sensitivity_method`` (fisher, the default, and exact) the first budget measures the table, the later
budgets reuse it (``quant.sensitivity``); every row evaluates the same held-out text with ``compare=unquantized``.
Prints per row the bytes, the KLD predicted, its upper bound and measured on the calibration text, on the held-out
text, and whether each is within the budget; then the time of each table and the estimate's error against the exact
table per layer type and scheme. Then, with both tables, the estimate's choice at each exact choice's size
(``quant.budget.bits``, the fisher table reused): the two tables compared at no more bytes, wherever either search
lands.

    python benchmarks/auto_estimate.py                    # SmolLM2-135M, WikiText-2, budgets 0.005 0.02 0.1
    python benchmarks/auto_estimate.py --model ../shared/data/stories260K --text ../shared/data/tinyshakespeare.txt
    python benchmarks/auto_estimate.py --tables /tmp/auto_estimate_XXXX   # that run's tables, the rows again
    python benchmarks/auto_estimate.py --estimators fisher --against /tmp/auto_estimate_XXXX/tables.json

Figures: benchmarks/README.md ("The sensitivity estimate").
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

from common import lit_ppl, table
from int4_methods import calibrated_parser, calibrated_texts


def g4(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties broken by order: the values are continuous)."""

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0] * len(v)
        for r, i in enumerate(order):
            out[i] = r
        return out

    return statistics.correlation(ranks(a), ranks(b))


def errors(estimate: dict, exact: dict) -> list[dict]:
    """Per layer type and scheme: estimate / exact KLD (median, range) and the rank correlation over layers."""
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for layer, row in exact.items():
        kind = re.sub(r".*\.", "", layer)
        for scheme, value in row.items():
            groups.setdefault((kind, scheme), []).append((estimate[layer][scheme]["kld"], value["kld"]))
    groups[("all", "all")] = [p for pairs in list(groups.values()) for p in pairs]
    rows = []
    for (kind, scheme), pairs in groups.items():
        ratios = [e / x for e, x in pairs if x > 0]
        rows.append(
            {
                "layers": kind,
                "scheme": scheme,
                "n": len(pairs),
                "median_est/exact": g4(statistics.median(ratios)),
                "min": g4(min(ratios)),
                "max": g4(max(ratios)),
                "rank_corr": g4(spearman([e for e, _ in pairs], [x for _, x in pairs]) if len(pairs) > 2 else None),
            }
        )
    return rows


def frontiers(tables: dict[str, dict], model: Path, group: int, levels: list[float]) -> list[dict]:
    """Each table's knapsack choices judged by the exact table's sums: over targets 0.5% apart, the fewest bytes
    at which a table's choice keeps the exact summed KLD within each level (the exact table's choices are the best
    for these sums up to the knapsack's rounding, so another table's bytes above them are what its errors cost,
    without the whole measurement's interactions or where a search lands)."""
    import torch
    from safetensors import safe_open

    from lit_ppl.quant.auto.budget import cheapest, packed_bytes
    from lit_ppl.quant.schemes import NONE, Scheme

    shapes = {}
    for file in model.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            shapes |= {k.removesuffix(".weight"): f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    exact, layers = tables["exact"], list(tables["exact"])
    schemes = {"none": NONE, "int8": Scheme("int8"), "int4": Scheme("int4", group)}
    kinds = {n: ["none", *exact[n]] for n in layers}  # a layer int4 cannot take has no int4 entry
    size = {(n, k): packed_bytes(schemes[k], torch.empty(shapes[n], device="meta")) for n in layers for k in kinds[n]}
    costs = {
        how: [[(size[n, k], t[n][k]["kld"] if k != "none" else 0.0) for k in kinds[n]] for n in layers]
        for how, t in tables.items()
    }

    def judged(how: str, target: float) -> tuple[int, float] | None:  # a choice's bytes and exact summed KLD
        picks = cheapest(costs[how], target)
        if picks is None:
            return None
        picked = [(n, kinds[n][j]) for n, j in zip(layers, picks, strict=True)]
        return sum(size[nk] for nk in picked), sum(exact[n][k]["kld"] for n, k in picked if k != "none")

    targets = [0.001 * 1.005**i for i in range(1063)]  # 0.001 to 0.2
    curves = {how: [p for p in (judged(how, t) for t in targets) if p] for how in tables}
    rows = []
    for level in levels:
        best = {how: min((b for b, c in pts if c <= level), default=None) for how, pts in curves.items()}
        rows.append({"exact sum <=": level} | {f"{how} bytes": f"{b:,}" if b else "-" for how, b in best.items()})
        for how in (h for h in best if h != "exact"):
            both = best[how] is not None and best["exact"] is not None
            rows[-1][f"{how} vs exact"] = f"{best[how] / best['exact'] - 1:+.2%}" if both else "-"
    return rows


def main() -> None:
    parser = calibrated_parser(__doc__)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--method", default="awq", help="int4's method")
    parser.add_argument("--budget", type=float, action="append", help="mean-KLD budgets (default 0.005 0.02 0.1)")
    parser.add_argument("--estimators", default="fisher,exact", help="sensitivity methods, comma-separated")
    parser.add_argument("--tables", type=Path, help="an earlier run's work dir: its tables reused, the rows run again")
    parser.add_argument("--against", type=Path, help="an earlier run's tables.json: tables this run did not measure")
    args = parser.parse_args()
    work, evaluated, cal = calibrated_texts(args, "auto_estimate_")
    budgets = args.budget or [0.005, 0.02, 0.1]
    common = ["compare=unquantized", f"eval.seq_len={args.seq_len}", f"precision={args.precision}"]
    common += ["report.plots=false", f"quant.group_size={args.group}", f"quant.method={args.method}", *cal]
    rows, tables, seconds, chosen, firsts = [], {}, {}, {}, {}

    def run(how: str, budget: str, out: Path, reuse: Path | None) -> dict:
        """One quant=auto job (``budget``: ``kld=X`` or ``bits=X``), its row printed; its ``quant.auto``."""
        t0 = time.perf_counter()
        extra = [*common, "quant=auto", f"quant.sensitivity_method={how}", f"quant.budget.{budget}"]
        r = lit_ppl(args.model, evaluated, out, *extra, *([f"quant.sensitivity={reuse}"] if reuse else []))
        auto = r["quant"]["auto"]
        met = "".join("-" if v is None else "yn"[not v] for v in auto["met"].values())
        rows.append(
            {
                "table": how,
                "budget": budget,
                "bytes": f"{auto['bytes']:,}",
                "of_full": auto["bytes"] / auto["bytes_full_precision"],
                "predicted": g4(auto["predicted"]),
                "bound": g4(auto["bound"]),
                "calibration": g4(auto["measured_calibration"]),
                "held_out": g4(auto["measured_evaluated"]),
                "met p/b/c/e": met,
                "rounds": len(auto["rounds"]),
                "layers": ", ".join(f"{v['layers']} {k}" for k, v in auto["by_scheme"].items()),
                "seconds": time.perf_counter() - t0,
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)
        return auto

    for how in args.estimators.split(","):
        first = None if args.tables is None else args.tables / f"{how}-{budgets[0]}" / "out"
        for budget in budgets:
            out = work / f"{how}-{budget}"
            chosen[how, budget] = run(how, f"kld={budget}", out, first)
            first = first or out / "out"
        firsts[how] = first
        measured = json.loads((first / "results.json").read_text())["quant"]["auto"]  # the run that measured it
        tables[how] = measured["sensitivity"]
        seconds[how] = measured["measurement"]["seconds_layers"], measured["measurement"]["passes"]
    sized = []
    if {"fisher", "exact"} <= set(firsts):  # the estimate's choice within each exact choice's bytes
        for budget in budgets:
            exact = chosen["exact", budget]
            fit = run("fisher", f"bits={exact['bits']!r}", work / f"fisher-bits-{budget}", firsts["fisher"])
            estimated = chosen["fisher", budget]
            sized.append(
                {
                    "kld budget": budget,
                    "exact bytes": f"{exact['bytes']:,}",
                    "exact held out": g4(exact["measured_evaluated"]),
                    "fisher bytes": f"{estimated['bytes']:,} ({estimated['bytes'] / exact['bytes'] - 1:+.2%})",
                    "fisher held out": g4(estimated["measured_evaluated"]),
                    "fisher at exact's size": f"{fit['bytes']:,} ({fit['bytes'] / exact['bytes'] - 1:+.2%})",
                    "its held out": g4(fit["measured_evaluated"]),
                    "vs exact": f"{fit['measured_evaluated'] / exact['measured_evaluated'] - 1:+.1%}",
                }
            )
    (work / "tables.json").write_text(json.dumps({"tables": tables, "seconds": seconds}))
    if args.against is not None:  # e.g. the exact table (50 minutes), measured once on the same texts
        earlier = json.loads(args.against.read_text())
        for how in set(earlier["tables"]) - set(tables):
            tables[how], seconds[how] = earlier["tables"][how], tuple(earlier["seconds"][how])
    print(
        f"\n{args.model.name}, {args.text.name}: first {args.eval_bytes:,} bytes evaluated (seq_len {args.seq_len}), "
        f"the next {args.calib_bytes:,} bytes calibrate and measure ({args.calib_tokens} tokens), int4 "
        f"{args.method} g{args.group}, precision {args.precision}; bytes: the linear layers' weights as packed; "
        f"tables: {work / 'tables.json'}\n"
    )
    print(table(rows, list(rows[0])))
    for how, (s, passes) in seconds.items():
        print(f"{how}: table in {s:.1f} s ({passes} passes)")
    if {"fisher", "exact"} <= set(tables):
        print(f"exact / fisher seconds: {seconds['exact'][0] / seconds['fisher'][0]:.1f}x\n")
        print(
            table(
                errors(tables["fisher"], tables["exact"]),
                ["layers", "scheme", "n", "median_est/exact", "min", "max", "rank_corr"],
            )
        )
        print("\nEach table's knapsack choices, judged by the exact table's summed KLD:\n")
        fronts = frontiers(tables, args.model, args.group, [0.004, 0.008, 0.015, 0.03, 0.07, 0.1])
        print(table(fronts, list(fronts[0])))
    if sized:
        print("\nEach budget's exact choice, the estimate's, and the estimate's within the exact choice's bytes:\n")
        print(table(sized, list(sized[0])))


if __name__ == "__main__":
    main()
