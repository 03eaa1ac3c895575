"""The architecture table: each zoo family's reference PPL, lit-ppl at 1 process, under fsdp × 2 and tp × 2, int8.

Not a speed benchmark: the figures the architectures table in docs/guides/architectures.md and the closing notes
quote. It builds the tiny random-init models of ``tests/helpers/zoo.py``, scores them with a plain Hugging Face
float64 forward, then runs ``python -m lit_ppl.validate`` on each (1 process, ``strategy=fsdp trainer.devices=2``,
``strategy=tp trainer.devices=2``, ``quant=int8``).

    python benchmarks/zoo_table.py [--arch gpt2 --arch mixtral]    # ~5 minutes on 2 cores for all
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, STORIES, require_shared

sys.path.insert(0, str(ROOT / "tests"))  # for tests/helpers
from helpers import zoo

SEQ_LEN = 128


def run(model: Path, docs: Path, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "lit_ppl.validate", "model=hf", f"model.path={model}", "data=text"]
    cmd += [f"data.path={docs}", f"eval.seq_len={SEQ_LEN}", "report.plots=false", "trainer.accelerator=cpu"]
    cmd += [f"output_dir={out}", f"hydra.run.dir={out}", f"data.cache_dir={out.parent / 'cache'}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    return json.loads((out / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=zoo.ARCHITECTURES, help="default: every family")
    args = parser.parse_args()
    require_shared()
    text = (STORIES.parent / "tinystories_sample.txt").read_text(encoding="utf-8")
    stories = [t.strip() for t in text.split("<|endoftext|>") if t.strip()]
    documents = [t[:120] for t in stories] + [stories[0][200:260]]
    root = Path(tempfile.gettempdir()) / "lit_ppl_bench" / "zoo"
    root.mkdir(parents=True, exist_ok=True)
    docs = zoo.write_documents(root / "docs.jsonl", documents)
    header = ["family", "reference PPL", "1 process", "Δ rel", "fsdp × 2", "Δ rel", "tp × 2", "Δ rel", "int8 PPL"]
    header += ["int8 weights"]
    print("| " + " | ".join([*header, "full precision"]) + " |")
    print("|---" + "|---:" * len(header) + "|")
    for arch in args.arch or zoo.ARCHITECTURES:
        path = zoo.build(arch, root, STORIES)
        nll, tokens = zoo.reference_nll(path, documents, SEQ_LEN)
        ref = math.exp(nll / tokens)
        out = root / "out" / arch
        one = run(path, docs, out / "one")
        two = run(path, docs, out / "fsdp2", "strategy=fsdp", "trainer.devices=2")
        tp = run(path, docs, out / "tp2", "strategy=tp", "trainer.devices=2")
        q8 = run(path, docs, out / "int8", "quant=int8")
        cells = [arch, f"{ref:.6f}"]
        for r in (one, two, tp):
            ok = "error" not in r and r["tokens"] == tokens
            cells += [f"{r['ppl']:.6f}", f"{abs(r['ppl'] / ref - 1):.1e}"] if ok else [r.get("error", "tokens"), "—"]
        if "error" in q8:
            cells += [q8["error"], "—", "—"]
        else:
            q = q8["quant"]
            cells += [f"{q8['ppl']:.6f}", str(q["quantized_modules"]), f"{100 * q['full_precision_fraction']:.1f}%"]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
