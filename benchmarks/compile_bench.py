"""``compile=true`` measured: eager vs ``torch.compile``d decoder on the same batches (lit-ppl's step).

Reports the compile time (the first pass, including compilation, minus an eager pass) and the steady
tokens/s of both, for stories260K and the config-built ~41M Llama, and the break-even token count.

    python benchmarks/compile_bench.py        # ~2-4 minutes on 2 cores (compilation is CPU-heavy)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import (
    DTYPES,
    STORIES,
    WIKITEXT,
    cut_text,
    load_model,
    make_llama,
    raw_batches,
    require_shared,
    table,
)

from lit_ppl.model.compiling import compile_decoder
from lit_ppl.model.scorer import TokenScorer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--text-bytes", type=int, default=60_000)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench")
    args = p.parse_args()
    require_shared()
    torch.set_num_threads(args.threads)
    text = cut_text(WIKITEXT, args.text_bytes, args.work / f"wiki_{args.text_bytes}.txt")
    rows = []
    for model in (STORIES, make_llama(args.work / "llama41m")):
        batches = raw_batches(model, text, args.work, args.seq_len, args.batch_size)[:4]
        row = {"model": model.name}
        for name in ("eager", "compiled"):
            scorer = TokenScorer(load_model(model, DTYPES[args.precision]), chunk_size=1024)
            if name == "compiled":
                compile_decoder(scorer)
            with torch.inference_mode():
                t0 = time.perf_counter()
                scorer(*batches[0])
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                tokens = sum(len(b[2]) for b in batches[1:])
                for b in batches[1:]:
                    scorer(*b)
                row[f"{name} tok/s"] = tokens / (time.perf_counter() - t0)
            row[f"{name} first s"] = first
        row["compile s"] = row["compiled first s"] - row["eager first s"]
        row["speed-up"] = row["compiled tok/s"] / row["eager tok/s"]
        gain = 1 / row["eager tok/s"] - 1 / row["compiled tok/s"]  # seconds saved per token
        row["break-even tokens"] = f"{row['compile s'] / gain:,.0f}" if gain > 0 else "never"
        rows.append(row)
        print(row, flush=True)
    print(f"\nseq_len {args.seq_len}, batch {args.batch_size}, {args.precision}, {args.threads} thread(s)")
    print(table(rows, ["model", "eager tok/s", "compiled tok/s", "speed-up", "compile s", "break-even tokens"]))


if __name__ == "__main__":
    main()
