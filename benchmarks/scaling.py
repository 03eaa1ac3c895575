"""Target 4 — data parallel scaling on this machine: 2 ranks × 1 thread vs 1 rank × 1 thread (goal ≥ 1.8×).

Both are fresh ``python -m lit_ppl.validate`` processes on the same text, model, windows and batch size; the
2-rank run is ``strategy=ddp trainer.devices=2`` (Lightning launches the second rank). Reported: the step
loop's tokens/s (``results["seconds"]`` on rank 0, which ends after the final metric sync) and the end-to-end
wall time, whose ratio also pays for starting a second interpreter on a machine with 2 cores.

    python benchmarks/scaling.py              # ~1.5-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, STORIES, WIKITEXT, cut_text, require_shared, table


def run(args: argparse.Namespace, text: Path, work: Path, ranks: int) -> dict:
    out = work / f"ranks{ranks}"
    cmd = [
        sys.executable, "-m", "lit_ppl.validate", f"model.path={args.model}", "data=text", f"data.path={text}",
        f"data.cache_dir={work / 'cache'}", "trainer=cpu", "eval=rolling", f"eval.seq_len={args.seq_len}",
        f"batch_size={args.batch_size}", f"output_dir={out}", f"hydra.run.dir={out}",
        *(["strategy=ddp", f"trainer.devices={ranks}"] if ranks > 1 else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{ranks}-rank run failed:\n{proc.stderr[-3000:]}")
    r = json.loads((out / "results.json").read_text())
    return {"ranks": ranks, "tokens": r["tokens"], "loop s": r["seconds"], "loop tok/s": r["tokens"] / r["seconds"],
            "wall s": wall, "rank tokens": r.get("rank_tokens"), "ppl": r["ppl"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=STORIES)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--text-bytes", type=int, default=300_000, help="cut the text (0: whole)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench" / "scaling")
    args = p.parse_args()
    require_shared()
    text = cut_text(WIKITEXT, args.text_bytes or None, args.work / "text.txt")
    run(args, text, args.work, 1)  # fills the tokenization cache: neither measured run tokenizes
    best: dict[int, dict] = {}
    for _ in range(args.repeats):
        for ranks in (1, 2):
            r = run(args, text, args.work, ranks)
            if ranks not in best or r["loop s"] < best[ranks]["loop s"]:
                best[ranks] = r
    one, two = best[1], best[2]
    if one["tokens"] != two["tokens"] or abs(one["ppl"] - two["ppl"]) > 1e-9 * one["ppl"]:
        raise AssertionError(f"1 and 2 ranks disagree: {one} vs {two}")
    print(f"{args.model.name} · {text.stat().st_size:,} bytes · rolling {args.seq_len} · batch {args.batch_size}")
    print(table(list(best.values()), ["ranks", "tokens", "rank tokens", "loop s", "loop tok/s", "wall s"]))
    print(
        f"\nloop speed-up {one['loop s'] / two['loop s']:.2f}x · end-to-end {one['wall s'] / two['wall s']:.2f}x "
        "(goal >= 1.8)"
    )


if __name__ == "__main__":
    main()
