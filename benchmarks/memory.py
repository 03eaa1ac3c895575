"""Target 3 — peak memory of the loss path: lit-ppl's chunked NLL vs full float32 logits + ``cross_entropy``.

Each measurement runs in a fresh process: it allocates the final hidden states ``(batch, seq, hidden)``, the
output head ``(vocab, hidden)`` and the targets, reads its resident set size, computes per-token NLL one way,
and reports the peak RSS (``getrusage``'s ``ru_maxrss``) minus that baseline. The full path is what
``model(labels=...)`` and torchmetrics' ``Perplexity`` do: the whole ``(batch·seq, vocab)`` float32 logits,
then ``cross_entropy``. lit-ppl's path is ``TokenScorer`` after the decoder: gather the scored positions
(``index_select``, a copy), then ``chunked_nll`` with the default ``chunk_size`` (1024). Goal: ≤ 1/8.

    python benchmarks/memory.py               # ~2-3 minutes on 2 cores (it computes the logits for real)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

from common import ROOT, table


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(path: str, vocab: int, batch: int, seq: int, hidden_size: int, chunk: int) -> dict:
    import torch
    import torch.nn.functional as F

    from lit_ppl.model.nll import chunked_nll

    torch.manual_seed(0)
    hidden = torch.randn(batch, seq, hidden_size)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).requires_grad_(False)
    targets = torch.randint(0, vocab, (batch * seq,))
    score_index = torch.arange(batch * seq)  # rolling mode scores (almost) every position
    base, high_before = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with torch.inference_mode():
        if path == "full":
            logits = head(hidden).float()  # (b, t, vocab)
            nll = F.cross_entropy(logits.flatten(0, 1), targets, reduction="none")
        else:
            scored = hidden.reshape(-1, hidden_size).index_select(0, score_index)
            nll = chunked_nll(scored, targets, head, chunk)
        nll_sum = float(nll.double().sum())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # The high-water mark before the call must not hide the call's own peak.
    return {"delta_mb": peak - max(base, high_before), "base_mb": base, "nll_sum": nll_sum}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="32000,128256")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.vocab, args.batch, args.seq, args.hidden, args.chunk)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        out = {}
        for path in ("full", "chunked"):
            cmd = [sys.executable, __file__, "--child", path, "--vocab", str(vocab), "--batch", str(args.batch),
                   "--seq", str(args.seq), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            out[path] = json.loads(proc.stdout.strip().splitlines()[-1])
        if abs(out["full"]["nll_sum"] - out["chunked"]["nll_sum"]) > 1e-5 * abs(out["full"]["nll_sum"]):
            raise AssertionError(f"the two paths disagree: {out}")
        rows.append({
            "vocab": vocab,
            "full logits + CE (MiB)": out["full"]["delta_mb"],
            "lit-ppl chunked (MiB)": out["chunked"]["delta_mb"],
            "ratio": out["chunked"]["delta_mb"] / out["full"]["delta_mb"],
        })  # fmt: skip
        print(rows[-1], flush=True)
    print(f"\npeak RSS above the inputs; batch {args.batch} × seq {args.seq}, hidden {args.hidden}, chunk {args.chunk}")
    print(table(rows, ["vocab", "full logits + CE (MiB)", "lit-ppl chunked (MiB)", "ratio"]))
    print(f"worst ratio {max(r['ratio'] for r in rows):.3f} (goal <= 0.125)")


if __name__ == "__main__":
    main()
