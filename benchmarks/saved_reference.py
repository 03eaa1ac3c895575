"""A reference saved once vs the live comparison, and the memory of ``eval.chunk_size=auto`` by vocabulary.

Part 1 (SmolLM2-135M from ``../shared/models/smollm2.sh`` if the cache has it, else stories260K), WikiText-2 text,
32-true, each run a fresh ``python -m lit_ppl.validate`` process (peak RSS from ``results.json``):
the candidate alone (``quant=int8``); ``save_reference`` of the unquantized model; ``quant=int8 compare=unquantized``
(both models loaded); ``quant=int8 compare=saved`` (the store read). Prints peak RSS, seconds, the store's bytes per
token and the largest relative difference of any comparison statistic between the live and the saved run.

Part 2: random Llamas built from a config (vocabularies 49,152 and 262,144; hidden 256, 2 layers) at seq 1024,
batch 8: peak RSS of a plain and of a comparing run with ``eval.chunk_size=1024`` (the old default) and ``auto``.

    python benchmarks/saved_reference.py            # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, STORIES, WIKITEXT, cut_text, make_llama, require_shared, table

SMOLLM2 = Path(os.environ.get("LIT_PPL_CACHE", Path.home() / ".cache" / "lit_ppl")) / "models" / "smollm2-135m"


def run(out: Path, *overrides: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lit_ppl.validate", f"output_dir={out}", f"hydra.run.dir={out}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text())


def worst(a: dict, b: dict) -> float:
    return max(abs(a[k] - b[k]) / abs(a[k]) if a[k] else abs(b[k]) for k in a)


def part1(tmp: Path, model: Path, text: Path, seq: int) -> None:
    base = ["model=hf", f"model.path={model}", "data=text", f"data.path={text}", f"eval.seq_len={seq}",
            "batch_size=4", "report.plots=false", "resume.enabled=false"]  # fmt: skip
    store = tmp / "store"
    runs = {
        "int8 alone": run(tmp / "alone", *base, "quant=int8"),
        "save_reference (unquantized)": run(tmp / "save", *base, f"save_reference={store}"),
        "int8 compare=unquantized (live)": run(tmp / "live", *base, "quant=int8", "compare=unquantized"),
        "int8 compare=saved": run(
            tmp / "saved", *base, "quant=int8", "compare=saved", f"compare.reference.store={store}"
        ),
    }
    tokens = runs["save_reference (unquantized)"]["tokens"]
    size = sum(p.stat().st_size for p in store.iterdir())
    head = (store / "head.pt").stat().st_size
    rows = [
        {"run": name, "peak RSS (MB)": r["rank_peak_rss_mb"][0], "seconds": r["seconds"], "chunk_size": r["chunk_size"]}
        for name, r in runs.items()
    ]
    print(f"\n{model.name}: {tokens:,} tokens, seq {seq}, 32-true")
    print(table(rows, ["run", "peak RSS (MB)", "seconds", "chunk_size"]))
    print(f"store: {size / 2**20:.1f} MiB = {(size - head) / tokens:.1f} bytes/token + head {head / 2**20:.1f} MiB")
    live, saved = runs["int8 compare=unquantized (live)"], runs["int8 compare=saved"]
    print(
        f"live - saved peak RSS {live['rank_peak_rss_mb'][0] - saved['rank_peak_rss_mb'][0]:.0f} MB; mean KLD "
        f"{saved['compare']['kld_mean']:.6g}; largest relative difference of any statistic, live vs saved: "
        f"{worst(live['compare'], saved['compare']):.3g}; reference head: {saved['reference_store']['head']}"
    )


def part2(tmp: Path, text: Path) -> None:
    rows = []
    for vocab in (49_152, 262_144):
        model = make_llama(tmp / f"llama-v{vocab}", vocab_size=vocab, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
        base = ["model=hf", f"model.path={model}", "data=text", f"data.path={text}", "eval.seq_len=1024",
                "batch_size=8", "report.plots=false", "resume.enabled=false"]  # fmt: skip
        for chunk in ("1024", "auto"):
            plain = run(tmp / f"p{vocab}{chunk}", *base, f"eval.chunk_size={chunk}")
            comp = run(tmp / f"c{vocab}{chunk}", *base, f"eval.chunk_size={chunk}", "quant=int8", "compare=unquantized")
            rows.append({
                "vocab": vocab, "eval.chunk_size": chunk,
                "rows (ppl · compare)": f"{plain['chunk_size']} · {comp['chunk_size']}",
                "peak RSS ppl (MB)": plain["rank_peak_rss_mb"][0],
                "peak RSS compare (MB)": comp["rank_peak_rss_mb"][0],
                "ppl": plain["ppl"],
            })  # fmt: skip
            print(rows[-1], flush=True)
    print("\nrandom Llama, hidden 256, 2 layers, seq 1024, batch 8, 32-true")
    print(table(rows, ["vocab", "eval.chunk_size", "rows (ppl · compare)", "peak RSS ppl (MB)",
                       "peak RSS compare (MB)", "ppl"]))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-bytes", type=int, default=150_000, help="WikiText-2 bytes scored in part 1")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--part", choices=("1", "2", "both"), default="both")
    p.add_argument("--model", type=Path, default=None, help="part 1's model (default: SmolLM2-135M, else stories260K)")
    args = p.parse_args()
    require_shared()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        text = cut_text(WIKITEXT, args.max_bytes, tmp / "wiki.txt")
        if args.part in ("1", "both"):
            model = args.model or (SMOLLM2 if (SMOLLM2 / "config.json").is_file() else STORIES)
            part1(tmp / "p1", model, text, args.seq)
        if args.part in ("2", "both"):
            part2(tmp / "p2", cut_text(WIKITEXT, 40_000, tmp / "short.txt"))


if __name__ == "__main__":
    main()
