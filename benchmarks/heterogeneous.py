"""A fast and a slow node: ``distributed.balance=tokens`` vs ``measured`` (and ``weights``), side by side.

Two torchrun "nodes" of one rank each on 127.0.0.1, one thread per rank, ``strategy=ddp``,
``eval.deterministic=true``; node 1 runs inside a cgroup v1 CPU quota of ``--slow`` of one core (root needed).
stories260K over the WikiText-2 validation text. Printed per balance: the evaluation time (rank 0's loop plus its
wait at the final sync: the slowest rank's time), the wall time of the whole job (start-up on the slow node is
slow too, whatever the balance), each rank's share of the tokens, and ``nll_sum``, which must be identical.

    python benchmarks/heterogeneous.py [--slow 0.3] [--max-bytes 600000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, STORIES, WIKITEXT, cut_text, require_shared, table

sys.path.insert(0, str(ROOT / "tests"))  # for tests/helpers
from helpers.nodes import launch, slow_cgroup, wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow", type=float, default=0.3, help="the slow node's CPU quota, in cores")
    parser.add_argument("--max-bytes", type=int, default=None, help="cut the text (default: the whole file)")
    args = parser.parse_args()
    require_shared()
    group = slow_cgroup("lit_ppl_bench_slow", args.slow)
    if group is None:
        sys.exit("cgroup v1 CPU quotas cannot be set here (needs root and /sys/fs/cgroup/cpu)")
    work = Path(tempfile.gettempdir()) / "lit_ppl_bench" / "heterogeneous"
    text = cut_text(WIKITEXT, args.max_bytes, work / "valid.txt")
    rows = []
    for balance, extra in (
        ("tokens", []),
        ("measured", []),
        ("weights", ["distributed.weights=[1.0," + str(args.slow) + "]"]),
    ):
        out = work / balance
        run_args = [f"model.path={STORIES}", f"data.path={text}", f"data.cache_dir={work / 'cache'}"]
        run_args += ["trainer.accelerator=cpu", "strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1"]
        run_args += ["eval.deterministic=true", "report.plots=false", f"output_dir={out}"]
        run_args += [f"distributed.balance={balance}", *extra]
        start = time.perf_counter()
        results = wait(launch(run_args, work, nodes=2, per_node=1, cgroups={1: group}), timeout=1800)
        wall = time.perf_counter() - start
        if any(code for code, _ in results):
            sys.exit(f"{balance}: {results[0][1][-2000:]}")
        r = json.loads((out / "results.json").read_text())
        share = [t / r["tokens"] for t in r["rank_tokens"]]
        rows.append(
            {
                "balance": balance,
                "evaluation s": round(r["seconds"] + r["sync_seconds"], 1),
                "wall s": round(wall, 1),
                "token share (fast, slow)": f"{share[0]:.2f}, {share[1]:.2f}",
                "measured tok/s": r["balance"]["measured_tokens_per_s"]
                and [round(s) for s in r["balance"]["measured_tokens_per_s"]],
                "nll_sum": repr(r["nll_sum"]),
            }
        )
    print(table(rows, list(rows[0])))
    base = rows[0]["evaluation s"]
    for row in rows[1:]:
        print(f"{row['balance']}: {base / row['evaluation s']:.2f}x faster evaluation than tokens")
    print(f"identical nll_sum: {len({row['nll_sum'] for row in rows}) == 1}")


if __name__ == "__main__":
    main()
