"""quant=auto's frontier: budget → (weight bytes, KLD predicted, measured on the calibration text, on held-out text).

Every row evaluates the same held-out text with ``compare=unquantized`` (the float model as reference). The first
``quant=auto`` run measures every layer under every scheme; the later budgets reuse its measurements
(``quant.sensitivity``), so their ``seconds`` are the choice, its check on the calibration text and the
evaluation. Uniform int8 and uniform int4 rows, in the same run, are the points the frontier is read against.

    python benchmarks/auto_policy.py                          # SmolLM2-135M, WikiText-2, budgets 0.005 0.02 0.1
    python benchmarks/auto_policy.py --model ../shared/data/stories260K --text ../shared/data/tinyshakespeare.txt

Figures: benchmarks/README.md ("Precision per layer under a budget").
"""

from __future__ import annotations

import time

from common import lit_ppl, table
from int4_methods import calibrated_parser, calibrated_texts


def main() -> None:
    parser = calibrated_parser(__doc__)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--method", default="awq", help="int4's method")
    parser.add_argument("--budget", type=float, action="append", help="mean-KLD budgets (default 0.005 0.02 0.1)")
    args = parser.parse_args()
    work, evaluated, cal = calibrated_texts(args, "auto_policy_")
    cal.append(f"quant.method={args.method}")
    common = ["compare=unquantized", f"eval.seq_len={args.seq_len}", f"precision={args.precision}"]
    common += ["report.plots=false", f"quant.group_size={args.group}"]
    rows = []

    def g4(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    def row(label: str, r: dict, seconds: float, auto: dict) -> None:
        c, q = r["compare"], r["quant"]
        rows.append(
            {
                "run": label,
                "bytes": f"{auto['bytes']:,}",
                "of_full": auto["bytes"] / auto["bytes_full_precision"],
                "kld_predicted": g4(auto["predicted"]),
                "kld_calibration": g4(auto["measured_calibration"]),
                "kld_held_out": g4(c["kld_mean"]),
                "kld_p99": g4(c["kld_p99"]),
                "same_top1": c["same_top"],
                "ppl": r["ppl"],
                "ppl_base": c["ppl_base"],
                "layers": ", ".join(f"{v['layers']} {k}" for k, v in auto["by_scheme"].items()),
                "memory_bytes": f"{q['weight_bytes_after']:,}",
                "seconds": seconds,
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)

    # Uniform references, measured by the same machinery: quant=auto allowed a single scheme (every layer gets it).
    for kind in ("int8", "int4"):
        t0 = time.perf_counter()
        extra = [*common, *cal, "quant=auto", f"quant.schemes=[{kind}]", "quant.budget.kld=100"]
        r = lit_ppl(args.model, evaluated, work / f"uniform-{kind}", *extra)
        row(f"uniform {kind}", r, time.perf_counter() - t0, r["quant"]["auto"])
    first = None
    for budget in args.budget or [0.005, 0.02, 0.1]:
        t0 = time.perf_counter()
        reuse = [f"quant.sensitivity={first}"] if first else []
        extra = [*common, *cal, "quant=auto", f"quant.budget.kld={budget}", *reuse]
        r = lit_ppl(args.model, evaluated, work / f"auto-{budget}", *extra)
        first = first or work / f"auto-{budget}" / "out"
        row(f"auto kld<={budget}", r, time.perf_counter() - t0, r["quant"]["auto"])
        if budget == (args.budget or [0.005])[0]:
            m = r["quant"]["auto"]["measurement"]
            print(f"layer measurements: {m['passes']} passes in {m['seconds_layers']:.0f} s", flush=True)
    print(
        f"\n{args.model.name}, {args.text.name}: first {args.eval_bytes:,} bytes evaluated (seq_len {args.seq_len}), "
        f"the next {args.calib_bytes:,} bytes calibrate and measure ({args.calib_tokens} tokens), int4 "
        f"{args.method} g{args.group}, precision {args.precision}; bytes: the linear layers' weights as packed\n"
    )
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
