"""A large plain-text file's token store: peak memory of the build against a 1 MB file's (issue 25, item 5).

A ``.txt`` file is one document unless ``data.document_separator`` splits it. It is read a chunk at a time and a
document larger than a chunk is tokenized in pieces cut where the tokens stay those of the whole text
(:mod:`lit_ppl.data.reading`, :mod:`lit_ppl.data.tokenize`), so the build's memory no longer grows with the file.
Each build runs in a fresh process (``lit_ppl.data.store.prepare``, one tokenizing process) that reports its own
peak RSS (``VmHWM``); ``--whole`` also builds the large file the old way, the text read and tokenized in one go
(chunk and piece sizes set beyond the file), for contrast.

    python benchmarks/plain_text.py                    # 1 MB vs 200 MB, stories260K's tokenizer (~2 minutes)
    python benchmarks/plain_text.py --large 20MB --whole
    python benchmarks/plain_text.py --large 20MB --whole --model ~/.cache/lit_ppl/models/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, STORIES, WIKITEXT, require_shared, table

CHILD = """
import json, sys, time
from pathlib import Path
from lit_ppl.data import reading, tokenize
from lit_ppl.data.sources import DataSpec
from lit_ppl.data.store import Corpus, prepare
from lit_ppl.model.spec import ModelSpec

path, cache, model, whole = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if whole:  # the old way: the file read and tokenized in one go
    import os

    reading.CHUNK_CHARS = tokenize.PIECE_CHARS = os.path.getsize(path) + 1
tokenizer = ModelSpec(path=model).tokenizer()
t0 = time.perf_counter()
store = prepare(DataSpec(path=path, cache_dir=cache, num_proc=1), tokenizer, progress=False)
seconds = time.perf_counter() - t0
corpus = Corpus.open(store)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"peak_mb": hwm / 1024, "seconds": seconds, "tokens": len(corpus.tokens)}))
"""


def size(s: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    return int(float(s[:-2]) * units[s[-2:].upper()])


def make(path: Path, n: int) -> Path:
    if not path.exists() or path.stat().st_size != n:
        text = WIKITEXT.read_text(encoding="utf-8")
        with open(path, "w", encoding="utf-8") as f:
            written = 0
            while written < n:
                piece = text[: n - written]
                f.write(piece)
                written += len(piece.encode("utf-8"))
    return path


def build(path: Path, work: Path, whole: bool, model: Path) -> dict:
    cache = Path(tempfile.mkdtemp(dir=work))
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-c", CHILD, str(path), str(cache), str(model), "1" if whole else "0"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", default="200MB")
    p.add_argument("--model", type=Path, default=STORIES, help="whose tokenizer (default: stories260K)")
    p.add_argument("--whole", action="store_true", help="also build the large file the old way, in one go")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench" / "plain_text")
    args = p.parse_args()
    require_shared()
    args.work.mkdir(parents=True, exist_ok=True)
    small, large = make(args.work / "small.txt", 1 << 20), make(args.work / "large.txt", size(args.large))
    t0 = time.perf_counter()
    rows = {"1 MB": build(small, args.work, False, args.model), args.large: build(large, args.work, False, args.model)}
    if args.whole:
        rows[f"{args.large}, in one go (before)"] = build(large, args.work, True, args.model)
    columns = ["file", "peak RSS MB", "build s", "tokens", "MB/s"]
    lines = [
        {
            "file": name,
            "peak RSS MB": f"{r['peak_mb']:,.0f}",
            "build s": f"{r['seconds']:.1f}",
            "tokens": f"{r['tokens']:,}",
            "MB/s": f"{size_of(name, args) / r['seconds']:.2f}",
        }
        for name, r in rows.items()
    ]
    print(table(lines, columns))
    extra = rows[args.large]["peak_mb"] - rows["1 MB"]["peak_mb"]
    print(f"{args.large} vs 1 MB: +{extra:,.0f} MB peak RSS (target <= +300 MB); {time.perf_counter() - t0:.0f} s")


def size_of(name: str, args) -> float:
    return 1.0 if name == "1 MB" else size(args.large) / 2**20


if __name__ == "__main__":
    main()
