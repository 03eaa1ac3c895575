"""The baseline of ``startup.py --outside``: perplexity as a bare PyTorch + transformers script computes it.

What a user writes from the Hugging Face perplexity guide, without lit-ppl: load the tokenizer and the model,
tokenize the whole text, score non-overlapping windows of ``--seq-len`` tokens in batches of ``--batch-size``
under ``torch.inference_mode``, sum the cross-entropy. Prints one JSON line: the tokens scored, the NLL sum and
the seconds of the loop alone, so that the caller can take the time outside the loop from the process's wall time.

    python benchmarks/bare_ppl.py --model ../shared/data/stories260K --text ../shared/data/wikitext-2/valid.tokens.txt
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lm = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tokenizer(args.text.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    n = (len(ids) - 1) // args.seq_len
    inputs = ids[: n * args.seq_len].view(n, args.seq_len)
    targets = ids[1 : n * args.seq_len + 1].view(n, args.seq_len)

    start = time.perf_counter()
    nll = torch.zeros((), dtype=torch.float64)
    with torch.inference_mode():
        for a in range(0, n, args.batch_size):
            logits = lm(inputs[a : a + args.batch_size], use_cache=False).logits.flatten(0, 1).float()
            nll += F.cross_entropy(logits, targets[a : a + args.batch_size].flatten(), reduction="sum")
    loop_s = time.perf_counter() - start
    print(json.dumps({"tokens": targets.numel(), "nll_sum": float(nll), "loop_s": loop_s}))


if __name__ == "__main__":
    main()
