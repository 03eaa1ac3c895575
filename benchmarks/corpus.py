"""Corpora at scale: rank memory, start-up, tokenization throughput and token store size on 1 MB … 1 GB of text.

The corpora are generated (seeded, reused when present) from the WikiText-2 validation text: documents of 5–40
consecutive paragraphs, one JSON line ``{"text": ...}`` each, in gzip shards of ~64 MB of text in a directory
(``data.path=DIR``). stories260K's tokenizer and model; four figures, each side by side in one run:

1. rank memory — each rank's peak RSS (``VmHWM`` once both ranks scored a batch) of a 2-rank CPU run
   (``strategy=ddp trainer.devices=2``: data preparation and the first batch, not the loop) on the
   large corpus vs the small one, warm token store (target: at most 300 MB above); the cold run (rank 0 builds
   the store) is reported too;
2. start-up — process start → first batch scored (``startup.py``'s ``--child``), warm store, medium vs small
   corpus, best of ``--repeats`` interleaved (target: at most 1.5 s slower);
3. cold tokenization — ``python -m lit_ppl.fetch`` of the medium corpus into a fresh ``data.cache_dir`` minus the
   same fetch warm (its start-up), ``data.num_proc=2`` vs ``1``: MB of text/s, tokens/s (target: ≥ 1.7×), and the
   CPU seconds of the process and its tokenizing pool; also ``lit_ppl.data.store.prepare`` alone under ``python -c``,
   whose pool workers import no main module (a CLI's workers import ``lit_ppl.fetch``/``validate`` again);
4. token store — bytes per token of ``tokens.bin`` (target ≤ 2 for ``uint16``), the whole store vs the text,
   and what else was cached: the cache directory must hold only ``tokens/`` and ``datasets``' cache
   (``HF_DATASETS_CACHE``, pointed into ``--work``) nothing (files are streamed, not copied).

Also printed: the windows + sampler plan memory of a rank at each corpus size (``tracemalloc``, and the RSS added).

    python benchmarks/corpus.py            # 1 MB / 100 MB / 1 GB: ~10 minutes on 2 idle cores, ~2 GB under --work
    python benchmarks/corpus.py --quick    # 1 MB / 10 MB / 50 MB: ~2-3 minutes
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import ROOT, STORIES, WIKITEXT, require_shared, table
from startup import child as first_batch_child

SHARD_BYTES = 64 << 20  # text per gzip shard
SEED = 0
MB = 1e6  # text sizes and throughputs: decimal MB of UTF-8 text
MIB = 2**20  # memory, as results.json's rank_peak_rss_mb


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", s.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size such as 1MB, 100MB, 1GB")
    return int(float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]])


def label(n: int) -> str:
    return f"{n / 1e9:g} GB" if n >= 1e9 else f"{n / 1e6:g} MB" if n >= 1e6 else f"{n / 1e3:g} KB"


# --------------------------------------------------------------------------------------------------- corpora


def generate(size: int, work: Path) -> tuple[Path, dict]:
    """The corpus of ``size`` bytes of text: ``work/corpus-<size>/shard-NNNNN.jsonl.gz`` (reused if present).

    Its manifest lies next to the directory, not in it (every file in ``data.path=DIR`` is read as data).
    """
    out, manifest = work / f"corpus-{size}", work / f"corpus-{size}.json"
    want = {"size": size, "seed": SEED, "source": str(WIKITEXT), "source_bytes": WIKITEXT.stat().st_size}
    if manifest.is_file() and out.is_dir():
        m = json.loads(manifest.read_text())
        if {k: m.get(k) for k in want} == want:
            return out, m
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    paragraphs = [line.strip() for line in WIKITEXT.read_text(encoding="utf-8").splitlines() if line.strip()]
    rng = random.Random(SEED)
    t0 = time.perf_counter()
    text_bytes = docs = shards = 0
    while text_bytes < size:
        path, shard_bytes = out / f"shard-{shards:05d}.jsonl.gz", 0
        # mtime=0 and no file name in the header: the same seed writes the same bytes.
        with open(path, "wb") as raw, gzip.GzipFile("", "wb", compresslevel=1, fileobj=raw, mtime=0) as gz:
            lines: list[str] = []
            while shard_bytes < SHARD_BYTES and text_bytes < size:
                k = rng.randint(5, 40)
                start = rng.randrange(len(paragraphs) - k + 1)
                doc = "\n".join(paragraphs[start : start + k])
                n = len(doc.encode("utf-8"))
                lines.append(json.dumps({"text": doc}, ensure_ascii=False))
                shard_bytes, text_bytes, docs = shard_bytes + n, text_bytes + n, docs + 1
                if len(lines) >= 256:  # stream: a few MB in memory at a time
                    gz.write(("\n".join(lines) + "\n").encode("utf-8"))
                    lines = []
            if lines:
                gz.write(("\n".join(lines) + "\n").encode("utf-8"))
        shards += 1
    m = {
        **want,
        "text_bytes": text_bytes,
        "documents": docs,
        "shards": shards,
        "gz_bytes": sum(p.stat().st_size for p in out.iterdir()),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    manifest.write_text(json.dumps(m, indent=2))
    return out, m


# ------------------------------------------------------------------------------------------- subprocesses


def env(work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_CACHE": str(work / "hf_datasets_cache"),  # checked to stay empty: streaming caches nothing
    }


def overrides(model: Path, corpus: Path, cache: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model}",
        "data=text",
        f"data.path={corpus}",
        f"data.cache_dir={cache}",
        "trainer=cpu",
        "distributed.timeout_s=3600",
        "report.plots=false",
        f"output_dir={out}",
        f"hydra.run.dir={out}",
        *extra,
    ]


def run(cmd: list[str], work: Path, what: str, extra_env: dict[str, str] | None = None):
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**env(work), **(extra_env or {})}, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc, wall


def validate_2ranks(args, corpus: Path, cache: Path, work: Path, name: str) -> dict:
    """A 2-rank evaluation stopped once both ranks have scored a batch (each has saved progress after step 1): each
    rank's peak RSS from ``/proc`` (``VmHWM``: data preparation and the first batch, not the whole loop), its wall
    time and whether it tokenized. Stopped by the benchmark: lit-ppl refuses a partial run's results
    (``trainer.limit_val_batches``), whose counts would be the whole corpus's."""
    out = work / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    ov = overrides(args.model, corpus, cache, out, "strategy=ddp", "trainer.devices=2", "resume.save_every=1")
    log = work / f"{name}.stderr"
    t0 = time.perf_counter()
    with open(log, "w") as err:
        cmd = [sys.executable, "-m", "lit_ppl.validate", *ov, "resume.check_every=1"]
        proc = subprocess.Popen(
            cmd, env=env(work), cwd=work, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        try:
            while not all((out / "progress" / f"rank{r}-step1.pt").exists() for r in (0, 1)):
                if proc.poll() is not None:
                    sys.exit(f"{name} failed:\n{log.read_text()[-3000:]}")
                time.sleep(0.05)
            wall = time.perf_counter() - t0
            ranks = [
                proc.pid,
                *map(
                    int, subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
                ),
            ]
            rss = [vm_of(pid, "VmHWM") for pid in ranks[:2]]
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()
    return {"results": {"rank_peak_rss_mb": rss}, "wall": wall, "tokenized": "tokenizing" in log.read_text()}


def vm_of(pid: int, field: str) -> float:
    """A process's ``/proc/PID/status`` memory field in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children, and of theirs that they waited for."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fetch(args, corpus: Path, cache: Path, work: Path, num_proc: int) -> tuple[float, float]:
    """``python -m lit_ppl.fetch`` (the CLI, as a user runs it): its wall and CPU seconds, pool workers included."""
    out = work / "runs" / f"fetch-np{num_proc}"
    cpu0 = children_cpu()
    _, wall = run(
        [
            sys.executable,
            "-m",
            "lit_ppl.fetch",
            *overrides(args.model, corpus, cache, out, f"data.num_proc={num_proc}"),
        ],
        work,
        f"lit_ppl.fetch with data.num_proc={num_proc}",
    )
    return wall, children_cpu() - cpu0


def prepare_child(cache: str, num_proc: str, corpus: str, model: str) -> None:
    """``lit_ppl.data.store.prepare`` alone, as the CLI would call it; run under ``python -c``, so that the spawned pool
    workers import no main module (a ``python -m lit_ppl.fetch`` pool's workers import ``lit_ppl.fetch``)."""
    from common import compose

    from lit_ppl.data.store import Corpus, prepare
    from lit_ppl.run import build

    cfg = compose(f"model.path={model}", "data=text", f"data.path={corpus}", f"data.cache_dir={cache}")
    cfg.data.num_proc = int(num_proc)
    spec, tokenizer = build(cfg.data), build(cfg.model).tokenizer()

    def cpu() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    cpu0, t0 = cpu(), time.perf_counter()
    store = prepare(spec, tokenizer, timeout_s=3600, progress=False)
    seconds, cpu_s = time.perf_counter() - t0, cpu() - cpu0
    c = Corpus.open(store)
    print(json.dumps({"seconds": seconds, "cpu": cpu_s, "tokens": len(c.tokens), "text": int(c.doc_bytes.sum())}))


def tokenize_bare(corpus: Path, work: Path, num_proc: int, cache: Path, model: Path) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    code = "import sys; from corpus import prepare_child; prepare_child(*sys.argv[1:])"
    cmd = [sys.executable, "-c", code, str(cache), str(num_proc), str(corpus), str(model)]
    proc, _ = run(cmd, work, f"prepare() with num_proc={num_proc}", {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}"})
    shutil.rmtree(cache, ignore_errors=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "tokenizing s": r["seconds"],
        "MB/s": r["text"] / MB / r["seconds"],
        "tokens/s": r["tokens"] / r["seconds"],
        "tokens": r["tokens"],
        "CPU s": r["cpu"],
    }


def tokenize_cold(args, corpus: Path, work: Path, num_proc: int, cache: Path) -> dict:
    """A cold fetch into a fresh cache minus a warm one (the same start-up, nothing to tokenize)."""
    shutil.rmtree(cache, ignore_errors=True)
    cold_s, cold_cpu = fetch(args, corpus, cache, work, num_proc)
    warm_s, warm_cpu = fetch(args, corpus, cache, work, num_proc)
    (store,) = [d for d in (cache / "tokens").iterdir() if d.is_dir()]
    meta = json.loads((store / "meta.json").read_text())
    text = int(np.load(store / "documents.npy")[:, 2].sum())
    seconds = cold_s - warm_s
    return {
        "cold fetch s": cold_s,
        "warm fetch s": warm_s,
        "tokenizing s": seconds,
        "MB/s": text / MB / seconds,
        "tokens/s": meta["tokens"] / seconds,
        "tokens": meta["tokens"],
        "CPU s": cold_cpu - warm_cpu,
    }


def first_batch(args, corpus: Path, cache: Path, work: Path, name: str) -> dict:
    """``startup.py``'s child: seconds from process start to the first batch scored (one rank)."""
    out, marks = work / "runs" / name, work / "runs" / f"{name}.marks.json"
    marks.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", str(marks), *overrides(args.model, corpus, cache, out)]
    proc, _ = run(cmd, work, name, {"LIT_PPL_BENCH_T0": repr(time.time())})
    return {**json.loads(marks.read_text()), "tokenized": "tokenizing" in proc.stderr}


def vm(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process, MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def plan_child(store: str, seq_len: str, batch_size: str) -> None:
    """Memory of rank 0's windows and sampler plan (2 ranks) over a stored corpus: the RSS it adds, then (a second
    time, the first freed) the allocations ``tracemalloc`` traces."""
    import gc
    import tracemalloc

    from lit_ppl.data.sampler import ExactBatchSampler
    from lit_ppl.data.store import Corpus
    from lit_ppl.data.windows import build_windows

    c = Corpus.open(Path(store))
    seq, batch = int(seq_len), int(batch_size)
    rss0 = vm("VmRSS")
    w = build_windows("rolling", c.doc_lengths, seq, None, c.doc_words, c.doc_bytes)
    rss_windows = vm("VmRSS") - rss0
    t0 = time.perf_counter()
    sampler = ExactBatchSampler(w.lengths, 0, 2, batch)
    seconds = time.perf_counter() - t0
    rss_all, hwm = vm("VmRSS") - rss0, vm("VmHWM") - rss0
    n, fields = len(w), sum(getattr(w, f).nbytes for f in ("start", "end", "score_from", "documents", "words", "bytes"))
    del w, sampler
    gc.collect()
    tracemalloc.start()
    w = build_windows("rolling", c.doc_lengths, seq, None, c.doc_words, c.doc_bytes)
    windows = tracemalloc.get_traced_memory()[0]
    sampler = ExactBatchSampler(w.lengths, 0, 2, batch)
    assert sampler.plan  # alive while measured
    current, peak = tracemalloc.get_traced_memory()
    print(
        json.dumps(
            {
                "windows": n,
                "windows_bytes": fields,
                "windows_traced": windows,
                "plan_traced": current - windows,
                "peak_traced": peak,
                "rss_windows": rss_windows,
                "rss_windows_plan": rss_all,
                "hwm_windows_plan": hwm,
                "sampler_s": seconds,
            }
        )
    )


def plan_size(corpus_store: Path, work: Path, seq_len: int, batch_size: int) -> dict:
    cmd = [sys.executable, __file__, "--plan-child", str(corpus_store), str(seq_len), str(batch_size)]
    proc, _ = run(cmd, work, "plan size")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=None,
        help="small,medium,large corpus text sizes (default 1MB,100MB,1GB)",
    )
    p.add_argument("--quick", action="store_true", help="1MB,10MB,50MB: the whole script in a few minutes")
    p.add_argument("--model", type=Path, default=STORIES)
    p.add_argument("--repeats", type=int, default=3, help="start-up runs per side (best kept)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench" / "corpus")
    p.add_argument("--child", nargs="*", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan-child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        first_batch_child(args.child[0], args.child[1:])
        return
    if args.plan_child is not None:
        plan_child(*args.plan_child)
        return
    require_shared()
    sizes = args.sizes or ([int(1e6), int(10e6), int(50e6)] if args.quick else [int(1e6), int(100e6), int(1e9)])
    if len(sizes) != 3 or not sizes[0] < sizes[1] < sizes[2]:
        p.error("--sizes takes three increasing sizes: small,medium,large")
    small, medium, large = sizes
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "hf_datasets_cache", ignore_errors=True)

    corpora: dict[int, tuple[Path, dict]] = {}
    gen_rows = []
    for size in sorted(set(sizes)):
        corpora[size] = generate(size, work)
        m = corpora[size][1]
        gen_rows.append(
            {
                "corpus": label(size),
                "text bytes": m["text_bytes"],
                "documents": m["documents"],
                "shards": m["shards"],
                "gzip bytes": m["gz_bytes"],
                "generated in s": m["seconds"],
            }
        )
    print(f"corpora under {work} (generated once, seed {SEED}; the time is from the run that wrote them)")
    print(table(gen_rows, list(gen_rows[0])))
    cache = {size: work / f"cache-{size}" for size in sizes}
    summary = []
    load = os.getloadavg()

    # 3 · cold tokenization, num_proc 2 vs 1 (the 2-process store is kept: it is the medium corpus's warm cache)
    cold = {n: tokenize_cold(args, corpora[medium][0], work, n, work / f"cold-np{n}") for n in (1, 2)}
    shutil.rmtree(work / "cold-np1", ignore_errors=True)
    shutil.rmtree(cache[medium], ignore_errors=True)
    (work / "cold-np2").rename(cache[medium])
    rows = [{"num_proc": n, **r} for n, r in cold.items()]
    speedup = cold[2]["tokens/s"] / cold[1]["tokens/s"]
    bare = {n: tokenize_bare(corpora[medium][0], work, n, work / f"bare-np{n}", args.model) for n in (1, 2)}
    rows += [
        {"num_proc": f"{n} (prepare() alone)", "cold fetch s": "", "warm fetch s": "", **r} for n, r in bare.items()
    ]
    print(
        f"\n3 · cold tokenization of the {label(medium)} corpus: `python -m lit_ppl.fetch` into a fresh cache minus "
        "the same fetch warm (start-up); MB = 1e6 bytes of text; CPU s: the process and its tokenizing pool"
    )
    print(table(rows, list(rows[0])))
    print(
        f"num_proc=2 vs 1: {speedup:.2f}x; CPU {cold[2]['CPU s']:.1f} s vs {cold[1]['CPU s']:.1f} s: "
        f"{cold[2]['CPU s'] - cold[1]['CPU s']:+.1f} s for the pool (its workers' start-up, pickling)"
    )
    bare_speedup = bare[2]["tokens/s"] / bare[1]["tokens/s"]
    print(
        f"prepare() alone (python -c: the workers import no main module): {bare_speedup:.2f}x; "
        f"CPU {bare[2]['CPU s']:.1f} s vs {bare[1]['CPU s']:.1f} s"
    )
    summary.append(
        (
            "3 · cold tokenization, num_proc 2 vs 1",
            f"{label(medium)}, lit_ppl.fetch",
            f"{speedup:.2f}x (prepare() alone {bare_speedup:.2f}x)",
            ">= 1.7x",
            speedup >= 1.7,
        )
    )

    # 1 · rank memory: cold runs build the stores, then warm runs of the large and the small corpus
    runs = {}
    for size in (large, small):
        shutil.rmtree(cache[size], ignore_errors=True)
        runs[("cold", size)] = validate_2ranks(args, corpora[size][0], cache[size], work, f"cold-{size}")
    for size in (large, small):
        runs[("warm", size)] = validate_2ranks(args, corpora[size][0], cache[size], work, f"warm-{size}")
    rows = []
    for (kind, size), r in runs.items():
        res = r["results"]
        rows.append(
            {
                "corpus": label(size),
                "cache": kind,
                "documents": res["data"]["documents"],
                "rank peak RSS MB": ", ".join(f"{x:,.0f}" for x in res["rank_peak_rss_mb"]),
                "wall s": r["wall"],
                "tokenized": r["tokenized"],
            }
        )
    if any(runs[("warm", s)]["tokenized"] for s in (large, small)):
        sys.exit("a warm run tokenized again: the token store was not reused")
    warm_l, warm_s = (runs[("warm", s)]["results"]["rank_peak_rss_mb"] for s in (large, small))
    extra = [a - b for a, b in zip(warm_l, warm_s, strict=True)]
    print(f"\n1 · 2 CPU ranks, 2 batches: each rank's peak RSS (ru_maxrss), {label(large)} vs {label(small)}")
    print(table(rows, list(rows[0])))
    print(f"warm, {label(large)} - {label(small)} per rank: " + ", ".join(f"{x:+.0f} MB" for x in extra))
    cold_l = runs[("cold", large)]["results"]["rank_peak_rss_mb"]
    print(
        f"cold - warm, {label(large)}, per rank: "
        + ", ".join(f"{a - b:+.0f} MB" for a, b in zip(cold_l, warm_l, strict=True))
    )
    summary.append(
        (
            f"1 · rank peak RSS above {label(small)}",
            f"{label(large)}, 2 ranks, warm",
            f"{max(extra):+.0f} MB",
            "<= +300 MB",
            max(extra) <= 300,
        )
    )

    # 2 · start-up with a warm store, medium vs small, interleaved, best of --repeats
    best: dict[int, dict] = {}
    for i in range(args.repeats):
        for size in (medium, small):
            m = first_batch(args, corpora[size][0], cache[size], work, f"first-batch-{size}-{i}")
            if m["tokenized"]:
                sys.exit(f"the start-up run on {label(size)} tokenized: the token store was not reused")
            if size not in best or m["first batch"] < best[size]["first batch"]:
                best[size] = m
    rows = [
        {"corpus": label(s), **{k: best[s][k] for k in ("imports done", "token store s", "model built", "first batch")}}
        for s in (small, medium)
    ]
    slower = best[medium]["first batch"] - best[small]["first batch"]
    print(f"\n2 · process start → first batch, warm store, 1 rank, best of {args.repeats} (seconds)")
    print(table(rows, list(rows[0])))
    print(f"{label(medium)} is {slower:+.2f} s from {label(small)}")
    summary.append(
        (f"2 · first batch vs {label(small)}", f"{label(medium)}, warm", f"{slower:+.2f} s", "<= +1.5 s", slower <= 1.5)
    )

    # 4 · the token stores, and nothing else cached
    rows, others = [], []
    for size in sorted(set(sizes)):
        (store,) = [d for d in (cache[size] / "tokens").iterdir() if d.is_dir()]
        meta = json.loads((store / "meta.json").read_text())
        parts = {f.name: f.stat().st_size for f in store.iterdir()}
        text = corpora[size][1]["text_bytes"]
        rows.append(
            {
                "corpus": label(size),
                "dtype": meta["dtype"],
                "tokens": meta["tokens"],
                "tokens.bin B/token": parts["tokens.bin"] / meta["tokens"],
                "documents.npy + meta.json B": parts["documents.npy"] + parts["meta.json"],
                "store / text": sum(parts.values()) / text,
                "store / gzip files": sum(parts.values()) / corpora[size][1]["gz_bytes"],
            }
        )
        others += [str(q.relative_to(cache[size])) for q in cache[size].iterdir() if q.name != "tokens"]
        others += [str(q.relative_to(cache[size])) for q in (cache[size] / "tokens").iterdir() if q != store]
    hf = [q for q in (work / "hf_datasets_cache").rglob("*") if q.is_file()]
    hf_bytes = sum(q.stat().st_size for q in hf)
    locks = sum(q.suffix == ".lock" and q.stat().st_size == 0 for q in hf)
    print("\n4 · token stores (tokens.bin + documents.npy + meta.json)")
    print(table(rows, list(rows[0])))
    print(
        f"else in the cache dirs: {others or 'nothing'}; in datasets' cache (HF_DATASETS_CACHE): {len(hf)} files, "
        f"{hf_bytes:,} bytes ({locks} of them empty .lock files)"
    )
    bpt = max(r["tokens.bin B/token"] for r in rows)
    summary.append(
        ("4 · tokens.bin bytes per token", ", ".join(r["dtype"] for r in rows), f"{bpt:.2f}", "<= 2", bpt <= 2)
    )
    summary.append(
        (
            "4 · cached besides the store",
            "cache dirs + datasets' cache",
            f"{len(others) + len(hf) - locks} files, {hf_bytes:,} B (+{locks} empty locks)",
            "nothing",
            not others and hf_bytes == 0 and locks == len(hf),
        )
    )

    # plan memory of one rank: the windows (6 int64 per window) and the sampler's plan (window ids, Python ints)
    rows = []
    for size in sorted(set(sizes)):
        (store,) = [d for d in (cache[size] / "tokens").iterdir() if d.is_dir()]
        r = plan_size(store, work, 512, 8)
        rows.append(
            {
                "corpus": label(size),
                "windows": r["windows"],
                "windows MB (6 × int64)": r["windows_bytes"] / MIB,
                "plan MB": r["plan_traced"] / MIB,
                "B/window": (r["windows_traced"] + r["plan_traced"]) / r["windows"],
                "peak while built MB": r["peak_traced"] / MIB,
                "RSS added MB": r["rss_windows_plan"],
                "RSS peak added MB": r["hwm_windows_plan"],
                "sampler s": r["sampler_s"],
            }
        )
    print(
        "\nplan memory of a rank (rolling 512, batch 8, 2 ranks): windows + sampler plan traced by tracemalloc "
        "(MB, B/window, peak), and the RSS they add (separate pass); memory MB = 2^20 bytes"
    )
    print(table(rows, list(rows[0])))

    print("\nsummary")
    print(
        table(
            [
                {"figure": f, "at": at, "measured": v, "target": t, "pass": "yes" if ok else "NO"}
                for f, at, v, t, ok in summary
            ],
            ["figure", "at", "measured", "target", "pass"],
        )
    )
    print(f"\nload average (1 min) at the start {load[0]:.1f}, at the end {os.getloadavg()[0]:.1f} (2 cores)")
    if args.quick or args.sizes:
        print(f"\n(scaled run: {', '.join(label(s) for s in sizes)}; the targets are for 1 MB / 100 MB / 1 GB)")


if __name__ == "__main__":
    main()
