"""What ``eval.deterministic=true`` costs: tokens/s with and without it, at 1 and 2 ranks, side by side.

stories260K over the WikiText-2 validation text (rolling, seq_len 512, batch 16, CPU), each configuration run
``--repeats`` times interleaved, the best kept; the loop's tokens/s is ``tokens / (seconds + sync_seconds)`` from
``results.json``. Deterministic mode pins every CPU rank to one thread (a matmul's result can depend on its thread
count), so at 1 rank on a multi-core machine it also gives up intra-op parallelism; ``--threads`` sets both sides.

    python benchmarks/deterministic.py [--max-bytes 300000] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, STORIES, WIKITEXT, cut_text, require_shared, table


def run(text: Path, out: Path, world: int, deterministic: bool, threads: int | None) -> dict:
    cmd = [sys.executable, "-m", "lit_ppl.validate", f"model.path={STORIES}", f"data.path={text}", "batch_size=16"]
    cmd += [f"eval.deterministic={str(deterministic).lower()}", "trainer.accelerator=cpu", "report.plots=false"]
    cmd += [f"output_dir={out}", f"hydra.run.dir={out}", f"data.cache_dir={out.parent / 'cache'}"]
    if world > 1:
        cmd += ["strategy=ddp", f"trainer.devices={world}"]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return json.loads((out / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=None, help="cut the text (default: the whole file)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every rank of both sides")
    args = parser.parse_args()
    require_shared()
    work = Path(tempfile.gettempdir()) / "lit_ppl_bench" / "deterministic"
    text = cut_text(WIKITEXT, args.max_bytes, work / "valid.txt")
    best: dict[tuple[int, bool], dict] = {}
    for i in range(args.repeats):
        for world in (1, 2):
            for det in (False, True):
                r = run(text, work / f"r{i}-w{world}-{det}", world, det, args.threads)
                r["tok_s"] = r["tokens"] / (r["seconds"] + r["sync_seconds"])
                if (world, det) not in best or r["tok_s"] > best[world, det]["tok_s"]:
                    best[world, det] = r
    rows = []
    for world in (1, 2):
        off, on = best[world, False], best[world, True]
        rows.append(
            {
                "ranks": world,
                "tokens": f"{on['tokens']:,}",
                "tok/s default": round(off["tok_s"]),
                "tok/s deterministic": round(on["tok_s"]),
                "ratio": f"{on['tok_s'] / off['tok_s']:.3f}",
                "nll_sum default": repr(off["nll_sum"]),
                "nll_sum deterministic": repr(on["nll_sum"]),
            }
        )
    print(table(rows, list(rows[0])))
    same = best[1, True]["nll_sum"] == best[2, True]["nll_sum"]
    print(f"deterministic nll_sum identical at 1 and 2 ranks: {same}")


if __name__ == "__main__":
    main()
