"""Target 2 — lit-ppl against lm-evaluation-harness 0.4.13 (goal: ≥ 1.8× faster end to end, equal within 2e-5).

Both run as fresh processes, timed from process start to result, on the same model (stories260K), the same
text (WikiText-2 validation as one document), windows of ``--seq-len`` tokens (``loglikelihood_rolling``:
lm-eval's ``max_length``), the same batch size, precision and thread count. lm-eval runs ``model="hf"`` with
``add_bos_token=False`` on a local task over the text file (written here); the two word perplexities (same
log-likelihood sum, same word count) must agree within ``2e-5`` relative. lit-ppl runs once first to fill
its tokenization cache (a user's second run); lm-eval has no such cache for rolling loglikelihoods.

    pip install lm-eval==0.4.13
    python benchmarks/vs_lm_eval.py           # ~1.5-2 minutes on 2 cores
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

TASK = """\
task: lit_ppl_bench_text
dataset_path: text
dataset_kwargs:
  data_files:
    test: {text}
  sample_by: document
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def timed(cmd: list[str], env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed:\n{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    p.add_argument("--text-bytes", type=int, default=None, help="cut the text (default: whole)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--lit-args", default="", help="extra lit-ppl overrides, space separated (e.g. compile=true)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench")
    args = p.parse_args()
    require_shared()
    work = args.work / "vs_lm_eval"
    text = cut_text(WIKITEXT, args.text_bytes, work / "text.txt")
    (work / "tasks").mkdir(parents=True, exist_ok=True)
    (work / "tasks" / "lit_ppl_bench_text.yaml").write_text(TASK.format(text=text))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    dtype = {"32-true": "float32", "bf16-true": "bfloat16"}[args.precision]
    lm_eval = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={STORIES},dtype={dtype},add_bos_token=False,max_length={args.seq_len}",
        "--tasks", "lit_ppl_bench_text", "--include_path", str(work / "tasks"),
        "--batch_size", str(args.batch_size), "--device", "cpu", "--output_path", str(work / "lm_eval_out"),
    ]  # fmt: skip
    lit = [
        sys.executable, "-m", "lit_ppl.validate", f"model.path={STORIES}", "data=text", f"data.path={text}",
        f"data.cache_dir={work / 'cache'}", "trainer=cpu", "eval=rolling", f"eval.seq_len={args.seq_len}",
        f"batch_size={args.batch_size}", f"precision={args.precision}", f"output_dir={work / 'lit_out'}",
        f"hydra.run.dir={work / 'lit_out'}", *args.lit_args.split(),
    ]  # fmt: skip
    timed(lit, env, work)  # fills the tokenization cache
    t_lit = min(timed(lit, env, work) for _ in range(args.repeats))
    t_lm = min(timed(lm_eval, env, work) for _ in range(args.repeats))

    lit_res = json.loads((work / "lit_out" / "results.json").read_text())
    lm_res = json.loads(sorted((work / "lm_eval_out").rglob("results_*.json"))[-1].read_text())
    lm = lm_res["results"]["lit_ppl_bench_text"]
    rows = []
    for name, ours, theirs in (
        ("word_ppl", lit_res["word_ppl"], lm["word_perplexity,none"]),
        ("byte_ppl", lit_res["byte_ppl"], lm["byte_perplexity,none"]),
        ("bits_per_byte", lit_res["bits_per_byte"], lm["bits_per_byte,none"]),
    ):
        rows.append(
            {"metric": name, "lit-ppl": ours, "lm-eval": theirs, "rel diff": f"{abs(ours - theirs) / abs(theirs):.1e}"}
        )
    print(
        f"stories260K · {text.stat().st_size:,} bytes, {lit_res['tokens']:,} tokens · rolling {args.seq_len} · "
        f"batch {args.batch_size} · {args.precision} · {args.threads} threads"
    )
    print(table(rows, ["metric", "lit-ppl", "lm-eval", "rel diff"]))
    print()
    print(table(
        [{"lm-eval s": t_lm, "lit-ppl s": t_lit, "lit-ppl loop s": lit_res["seconds"], "speed-up": t_lm / t_lit}],
        ["lm-eval s", "lit-ppl s", "lit-ppl loop s", "speed-up"],
    ))  # fmt: skip
    worst = max(float(r["rel diff"]) for r in rows)
    print(f"\nspeed-up {t_lm / t_lit:.2f}x (goal >= 1.8) · largest relative difference {worst:.2e} (goal <= 2e-5)")


if __name__ == "__main__":
    main()
