"""SmolLM2-135M as a GGUF file (Q4_1) and as a Hugging Face checkpoint, in `rolling` and `llamacpp` modes.

Prints PPL, scored tokens and seconds per run side by side: the same model in two formats, and the two modes that
reproduce lm-evaluation-harness (`rolling`) and llama.cpp's `llama-perplexity` (`llamacpp`) at n_ctx 512 and 2048.
The text is the first ``--max-bytes`` of the WikiText-2 validation split (the shared data holds no test split),
read as one document, so `llamacpp` sees the stream `llama-perplexity -f` would.

    python benchmarks/formats.py [--max-bytes 40000] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from common import WIKITEXT, cut_text, lit_ppl, require_shared, table

MODELS = Path(os.path.expanduser("~/.cache/lit_ppl/models"))
GGUF = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
HF = MODELS / "smollm2-135m"


def run(model: Path, text: Path, work: Path, mode: str, seq_len: int) -> dict:
    t0 = time.perf_counter()
    r = lit_ppl(model, text, work, f"eval.seq_len={seq_len}", "batch_size=1", mode=mode)
    r["wall_s"] = time.perf_counter() - t0
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-bytes", type=int, default=40_000, help="bytes of WikiText-2 validation (None: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-lens", default="512,2048")
    args = ap.parse_args()
    require_shared()
    if not GGUF.is_file() or not HF.is_dir():
        raise SystemExit(f"SmolLM2 is absent (expected {GGUF} and {HF}): run ../shared/models/smollm2.sh")
    import torch

    torch.set_num_threads(args.threads)
    work = Path(tempfile.gettempdir()) / "lit_ppl_bench" / "formats"
    text = cut_text(WIKITEXT, args.max_bytes, work / "wikitext2_valid_head.txt")
    rows = []
    for seq_len in [int(s) for s in args.seq_lens.split(",")]:
        for mode in ("rolling", "llamacpp"):
            for name, model in (("GGUF Q4_1", GGUF), ("HF float32", HF)):
                r = run(model, text, work, mode, seq_len)
                rows.append(
                    {
                        "model": name,
                        "mode": mode,
                        "n_ctx": seq_len,
                        "PPL": f"{r['ppl']:.4f} ± {r['ppl_stderr']:.4f}",
                        "tokens": r["tokens"],
                        "quant": (r["quant"] or {}).get("name", "none"),
                        "step loop s": round(r["seconds"], 1),
                        "run s": round(r["wall_s"], 1),
                    }
                )
                print(rows[-1], flush=True)
    print(f"\n{text.stat().st_size:,} bytes of {WIKITEXT.name}, {args.threads} threads, float32\n")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
