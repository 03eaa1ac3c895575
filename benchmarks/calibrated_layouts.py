"""Calibrated INT4 (AWQ by default) under every layout: one process, fsdp × 2, tp × 3, side by side in one run.

Each layout is one ``python -m lit_ppl.validate`` process (torchrun for two ranks) on the same evaluated text,
calibrated on the bytes after it, in deterministic mode where the layout allows it (not tp): the calibration time
(``quant.calibration.seconds``), the whole run's wall time, the perplexity, and whether the layout-free digest of
the quantized weights (``quant.digest``) equals the first row's (one process's).

    nice -n 10 python benchmarks/calibrated_layouts.py                   # SmolLM2-135M, WikiText-2, AWQ int4 g64

Figures: benchmarks/README.md ("Calibrated quantization under split layouts").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, table
from int4_methods import METHODS, calibrated_parser, calibrated_texts

# Deterministic mode (one thread per rank, exact sums) where the layout allows it: tp refuses it (its split matmuls
# round differently); calibration itself reads only the thread count, which OMP_NUM_THREADS=1 fixes for every run.
LAYOUTS = {
    "1 process": ["eval.deterministic=true"],
    "fsdp": ["strategy=fsdp", "eval.deterministic=true"],
    "tp": ["strategy=tp"],  # SmolLM2-135M's 9 attention heads take tp=3, not 2
}


def run(args: list[str], ranks: int, out: Path) -> tuple[dict, float]:
    """One run of ``lit_ppl.validate`` (under torchrun for several ranks): its results and wall seconds."""
    cmd = [sys.executable, "-m"]
    if ranks > 1:
        cmd += ["torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", "29531", "-m"]
    cmd += ["lit_ppl.validate", *args, f"trainer.devices={ranks}", f"output_dir={out}", f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return json.loads((out / "results.json").read_text()), time.perf_counter() - t0


def main() -> None:
    parser = calibrated_parser(__doc__)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--method", default="awq", choices=["awq", "gptq", "gptq-seq"])
    parser.add_argument("--layout", action="append", choices=list(LAYOUTS), help="default: all, in this order")
    parser.add_argument("--fsdp", type=int, default=2, help="ranks of the fsdp row")
    parser.add_argument("--tp", type=int, default=3, help="ranks of the tp row (they must divide the heads)")
    args = parser.parse_args()
    work, evaluated, cal = calibrated_texts(args, "calibrated_layouts_")
    common = [f"model.path={args.model}", "data=text", f"data.path={evaluated}", f"data.cache_dir={work / 'cache'}"]
    common += [*METHODS[args.method], "quant.name=int4", f"quant.group_size={args.group}", *cal, "trainer=cpu"]
    common += [f"eval.seq_len={args.seq_len}", f"precision={args.precision}", "report.plots=false"]
    rows, first = [], None
    for label in args.layout or list(LAYOUTS):
        extra = LAYOUTS[label]
        ranks = {"fsdp": args.fsdp, "tp": args.tp}.get(label, 1)
        r, wall = run([*common, *extra], ranks, work / label.split()[0])
        q = r["quant"]
        first = first or q["digest"]
        rows.append(
            {
                "layout": label if ranks == 1 else f"{label} × {ranks}",
                "calibration_s": q["calibration"]["seconds"],
                "wall_s": wall,
                "ppl": r["ppl"],
                "ppl_vs_1": r["ppl"] / rows[0]["ppl"] - 1 if rows else 0.0,
                "digest": q["digest"][:12],
                "same_digest": q["digest"] == first,
                "peak_rss_mb": max(r.get("rank_peak_rss_mb") or [0]),
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(
        f"\n{args.model.name}, {args.text.name}: {args.method} int4 g{args.group}, first {args.eval_bytes:,} bytes "
        f"evaluated (seq_len {args.seq_len}), the next {args.calib_bytes:,} calibrate ({args.calib_tokens} tokens, "
        f"grid {args.grid}), precision {args.precision}; same_digest: against the first row\n"
    )
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
