"""Layouts side by side: tokens/s, weights and peak RSS per rank under ddp, fsdp, tp and fsdp_tp.

One random-init Llama built from a config (by default the models-at-scale issue's: 8 layers, hidden 1024, vocab
32k, untied head: 160M parameters, 640 MB in float32), saved as safetensors and evaluated from that checkpoint by
fresh ``python -m lit_ppl.validate`` processes on the same text, windows and batch size, one layout after the
other. Rank 0 reads the checkpoint for the others under fsdp/tp (it holds the model while it broadcasts), so its
peak RSS is reported apart from the other ranks'.

    python benchmarks/parallel.py                      # 4 ranks on CPU: ~3-5 minutes on 2 cores
    python benchmarks/parallel.py --world 8 --trainer default --precision bf16-true   # one 8-GPU node
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

from common import ROOT, TINYSTORIES, cut_text, make_llama, require_shared, table

SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
LAYOUTS = {
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "tp": ["strategy=tp"],
    "fsdp_tp": ["strategy=fsdp_tp", "parallel.tp=2"],
}


def run(args: argparse.Namespace, model: Path, text: Path, work: Path, layout: str) -> dict:
    out = work / layout
    cmd = [
        sys.executable, "-m", "lit_ppl.validate", f"model.path={model}", "data=text", f"data.path={text}",
        f"data.cache_dir={work / 'cache'}", f"trainer={args.trainer}", f"trainer.devices={args.world}",
        f"eval.seq_len={args.seq_len}", f"batch_size={args.batch_size}", f"precision={args.precision}",
        "report.plots=false", f"output_dir={out}", f"hydra.run.dir={out}", *LAYOUTS[layout],
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{layout} failed:\n{proc.stderr[-3000:]}")
    r = json.loads((out / "results.json").read_text())
    rss = r["rank_peak_rss_mb"]
    return {
        "layout": layout,
        "ppl": r["ppl"],
        "tokens/s": r["tokens_per_s"],
        "weights/rank MB": max(r["rank_weight_bytes"]) / 2**20,
        "peak RSS rank 0 MB": rss[0],
        "peak RSS other ranks MB": max(rss[1:]),
        "wall s": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--trainer", default="cpu", help="conf/trainer option: cpu, or default on GPUs")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--text-bytes", type=int, default=3000, help="bytes of TinyStories text to evaluate")
    parser.add_argument("--work", type=Path, default=None, help="keep the checkpoint here between runs")
    args = parser.parse_args()
    require_shared()
    work = args.work or Path(tempfile.mkdtemp(prefix="lit-ppl-parallel-"))
    model = make_llama(work / "model", **SHAPE)
    text = cut_text(TINYSTORIES, args.text_bytes, work / "text.txt")
    rows = [run(args, model, text, work, layout) for layout in args.layouts]
    base = rows[0]
    for row in rows:
        row["ppl rel. diff"] = f"{abs(row['ppl'] - base['ppl']) / base['ppl']:.1e}"
        row["weights ÷ first"] = row["weights/rank MB"] / base["weights/rank MB"]
    print(f"{args.world} ranks, {args.precision}, model {SHAPE}")
    columns = ["layout", "tokens/s", "weights/rank MB", "weights ÷ first", "peak RSS rank 0 MB"]
    print(table(rows, [*columns, "peak RSS other ranks MB", "ppl rel. diff", "wall s"]))


if __name__ == "__main__":
    main()
