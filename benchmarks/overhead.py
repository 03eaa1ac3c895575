"""Target 1 — framework overhead: lit-ppl's tokens/s over a raw ``torch.inference_mode()`` loop (goal ≥ 0.95).

Both sides run the same model on the same windows (lit-ppl's, in the same batches), batch size, precision and
thread count, in this one process, alternately, ``--repeats`` times; the best of each side is kept. lit-ppl's
time is its step loop (``results["seconds"]``: Lightning loop, collation, metric, progress bar); the raw
loop's batches are prebuilt before its clock starts. Models: the real stories260K and a config-built ~41M
Llama (vocab 32k), in fp32 and bf16, rolling mode over WikiText-2 validation.

    python benchmarks/overhead.py            # ~3-4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import (
    DTYPES,
    STORIES,
    WIKITEXT,
    cut_text,
    lit_ppl,
    load_model,
    make_llama,
    n_params,
    raw_batches,
    raw_loop,
    require_shared,
    table,
)


def measure(model: Path, text: Path, work: Path, precision: str, seq_len: int, batch_size: int, repeats: int) -> dict:
    batches = raw_batches(model, text, work, seq_len, batch_size)
    lm = load_model(model, DTYPES[precision])
    best_lit = best_raw = 0.0
    for _ in range(repeats):
        r = lit_ppl(model, text, work, f"precision={precision}", f"eval.seq_len={seq_len}", f"batch_size={batch_size}")
        best_lit = max(best_lit, r["tokens"] / r["seconds"])
        tokens, seconds, nll_sum = raw_loop(lm, batches)
        best_raw = max(best_raw, tokens / seconds)
    if tokens != r["tokens"] or abs(nll_sum - r["nll_sum"]) > 1e-4 * abs(nll_sum):
        raise AssertionError(
            f"lit-ppl and the raw loop disagree: {r['tokens']} vs {tokens} tokens, NLL sum {r['nll_sum']} vs {nll_sum}"
        )
    return {
        "model": f"{model.name} ({n_params(lm) / 1e6:.2f}M)",
        "precision": precision,
        "tokens": tokens,
        "raw tok/s": best_raw,
        "lit-ppl tok/s": best_lit,
        "ratio": best_lit / best_raw,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--stories-bytes", type=int, default=300_000, help="cut the text for stories260K (0: whole)")
    p.add_argument("--llama-bytes", type=int, default=48_000, help="cut the text for the 41M model")
    p.add_argument("--precisions", default="32-true,bf16-true")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench")
    args = p.parse_args()
    require_shared()
    torch.set_num_threads(args.threads)
    llama = make_llama(args.work / "llama41m")
    texts = {
        STORIES: cut_text(WIKITEXT, args.stories_bytes or None, args.work / f"wiki_{args.stories_bytes}.txt"),
        llama: cut_text(WIKITEXT, args.llama_bytes, args.work / f"wiki_{args.llama_bytes}.txt"),
    }
    rows = []
    for model, text in texts.items():
        for precision in args.precisions.split(","):
            rows.append(measure(model, text, args.work, precision, args.seq_len, args.batch_size, args.repeats))
            print(rows[-1], flush=True)
    print(
        f"\nrolling, seq_len {args.seq_len}, batch {args.batch_size}, {args.threads} threads; "
        f"text: WikiText-2 valid ({args.stories_bytes or 'whole'} / {args.llama_bytes} bytes)"
    )
    print(table(rows, ["model", "precision", "tokens", "raw tok/s", "lit-ppl tok/s", "ratio"]))


if __name__ == "__main__":
    main()
