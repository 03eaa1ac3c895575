"""Target 5 — start-up: the entry's --help against ``import torch``, then process start → first batch, cold and
warm tokenization cache.

First, best of 3 wall times of fresh processes, side by side: ``python -m lit_ppl.validate --help`` (composes the
typed config and renders it; imports neither torch nor Lightning), ``python -c "import torch"``,
``python -c "import lit_ppl.validate"`` and a bare ``python -c pass`` (the interpreter alone).

Runs ``python -m lit_ppl.validate`` (the whole text by default) twice in fresh processes with a fresh
``data.cache_dir``: the first run tokenizes the text, the second must not (it memory-maps the token store
kept under lit-ppl's fingerprint of files + tokenizer; the check is that no ``tokenizing`` progress
appears in its output). A small
wrapper (``--child``) timestamps the stages inside the process: imports done, model built, first batch
(scored); it then stops the process, unless ``--full`` asks for the whole run (the ``result`` column).

    python benchmarks/startup.py              # ~1 minute on 2 cores
    python benchmarks/startup.py --entry-only # only the --help / import timings (no shared data needed)
    python benchmarks/startup.py --outside    # time outside the step loop vs a bare script (bare_ppl.py), ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, STORIES, WIKITEXT, cut_text, require_shared, table


def child(marks_path: str, overrides: list[str]) -> None:
    t0 = float(os.environ["LIT_PPL_BENCH_T0"])
    marks: dict[str, float] = {}
    import lit_ppl.data.datamodule as data
    import lit_ppl.evaluation.module as module
    import lit_ppl.validate as validate

    marks["imports done"] = time.time() - t0
    step, configure = module.PerplexityModule.validation_step, module.PerplexityModule.configure_model

    def first_step(self, batch, batch_idx):
        out = step(self, batch, batch_idx)
        if "first batch" not in marks:
            marks["first batch"] = time.time() - t0
            if not os.environ.get("LIT_PPL_BENCH_FULL"):
                Path(marks_path).write_text(json.dumps(marks))
                os._exit(0)  # start-up is measured: skip the rest of the text
        return out

    def timed_configure(self):
        configure(self)
        marks.setdefault("model built", time.time() - t0)

    prepare = data.prepare

    def timed_prepare(*a, **k):
        t = time.time()
        out = prepare(*a, **k)
        marks["token store s"] = marks.get("token store s", 0.0) + time.time() - t
        return out

    module.PerplexityModule.validation_step = first_step
    module.PerplexityModule.configure_model = timed_configure
    data.prepare = timed_prepare
    sys.argv = ["lit_ppl.validate", *overrides]
    try:
        validate.main()
    except SystemExit as e:
        if e.code:
            raise
    marks["result"] = time.time() - t0
    Path(marks_path).write_text(json.dumps(marks))


ENTRY_COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "python -m lit_ppl.validate --help": ["-m", "lit_ppl.validate", "--help"],
    'python -c "import lit_ppl.validate"': ["-c", "import lit_ppl.validate"],
    'python -c "import torch"': ["-c", "import torch"],
}


def entry_startup(repeats: int) -> list[dict]:
    """Best-of-``repeats`` wall time of each command in a fresh process, interleaved so that load hits all alike."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    best = dict.fromkeys(ENTRY_COMMANDS, float("inf"))
    for _ in range(repeats):
        for name, args in ENTRY_COMMANDS.items():
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
            elapsed = time.perf_counter() - t
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            best[name] = min(best[name], elapsed)
    torch_s = best['python -c "import torch"']
    return [{"command": k, "best s": round(v, 3), "vs import torch": f"{v / torch_s:.2f}×"} for k, v in best.items()]


def outside_the_loop(args: argparse.Namespace, text: Path) -> list[dict]:
    """Wall time outside the step loop: fresh ``python -m lit_ppl.validate`` (cold and warm token store) against
    a bare PyTorch + transformers script (``bare_ppl.py``), same model, text, windows and batch, 1 thread each.

    Each process's wall time (start to exit, as a user waits for it) minus its own clock of its loop (lit-ppl's
    ``results["seconds"]``, the bare script's ``loop_s``); rounds interleaved, best of ``--rounds`` per side.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["OMP_NUM_THREADS"] = "1"
    work = args.work / "outside"
    shape = [f"eval.seq_len={args.seq_len}", f"batch_size={args.batch_size}"]
    lit = [sys.executable, "-m", "lit_ppl.validate", f"model.path={args.model}", "data=text", f"data.path={text}"]
    lit += ["eval=rolling", *shape, "precision=32-true", "report.plots=false", "trainer=cpu"]
    lit += [f"output_dir={work / 'out'}", f"hydra.run.dir={work / 'out'}"]
    bare = [sys.executable, str(Path(__file__).with_name("bare_ppl.py")), "--model", str(args.model)]
    bare += ["--text", str(text), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
    sides = {
        "bare PyTorch + transformers": bare,
        "lit-ppl, cold token store": [*lit, f"data.cache_dir={work / 'cold'}"],
        "lit-ppl, warm token store": [*lit, f"data.cache_dir={work / 'warm'}"],
    }
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms the file cache and fills the warm store; not counted
        for name, cmd in sides.items() if r % 2 else reversed(sides.items()):
            shutil.rmtree(work / "cold", ignore_errors=True)
            shutil.rmtree(work / "out", ignore_errors=True)
            t = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            if name.startswith("bare"):
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                loop, tokens = out["loop_s"], out["tokens"]
            else:
                res = json.loads((work / "out" / "results.json").read_text())
                loop, tokens = res["seconds"], res["tokens"]
            if r and wall - loop < best.get(name, {}).get("outside s", float("inf")):
                best[name] = {"wall s": wall, "loop s": loop, "outside s": wall - loop, "tokens": tokens}
    base = best["bare PyTorch + transformers"]["outside s"]
    rows = [{"process": k, **{c: round(v, 2) for c, v in b.items()}} for k, b in best.items()]
    for r in rows:
        r["outside vs bare"] = f"{r['outside s'] - base:+.2f} s"
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=STORIES)
    p.add_argument("--text-bytes", type=int, default=0, help="cut the text (0: whole)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench" / "startup")
    p.add_argument("--full", action="store_true", help="run to the result, not just the first batch")
    p.add_argument("--repeats", type=int, default=3, help="best of N for the --help / import timings")
    p.add_argument("--entry-only", action="store_true", help="only the --help / import timings")
    p.add_argument("--outside", action="store_true", help="only the time outside the step loop vs a bare script")
    p.add_argument("--rounds", type=int, default=3, help="best of N interleaved rounds for --outside")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--child", nargs="*", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child[0], args.child[1:])
        return
    if args.outside:
        require_shared()
        text = cut_text(WIKITEXT, args.text_bytes or None, args.work / "text.txt")
        rows = outside_the_loop(args, text)
        print(f"{args.model.name} · {text.stat().st_size:,} bytes · rolling {args.seq_len}, batch {args.batch_size}, ")
        print(f"1 thread · wall seconds, best of {args.rounds} interleaved rounds (outside = wall - loop)")
        print(table(rows, ["process", "wall s", "loop s", "outside s", "tokens", "outside vs bare"]))
        return
    print(f"fresh processes, best of {args.repeats} · wall seconds")
    print(table(entry_startup(args.repeats), ["command", "best s", "vs import torch"]))
    if args.entry_only:
        return
    print()
    require_shared()
    text = cut_text(WIKITEXT, args.text_bytes or None, args.work / "text.txt")
    shutil.rmtree(args.work / "cache", ignore_errors=True)
    overrides = [f"model.path={args.model}", "data=text", f"data.path={text}", f"data.cache_dir={args.work / 'cache'}",
                 "trainer=cpu", f"output_dir={args.work / 'out'}", f"hydra.run.dir={args.work / 'out'}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if args.full:
        env["LIT_PPL_BENCH_FULL"] = "1"
    rows = []
    for name in ("cold cache", "warm cache"):
        marks = args.work / "marks.json"
        env["LIT_PPL_BENCH_T0"] = repr(time.time())
        cmd = [sys.executable, __file__, "--child", str(marks), *overrides]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name} run failed:\n{proc.stderr[-3000:]}")
        m = json.loads(marks.read_text())
        rows.append({"run": name, **{k: round(v, 2) for k, v in m.items()}, "tokenized": "tokenizing" in proc.stderr})
    print(f"{args.model.name} · {text.stat().st_size:,} bytes · seconds from process start")
    cols = ["run", "imports done", "token store s", "model built", "first batch", "tokenized"]
    cols += ["result"] if args.full else []
    print(table(rows, cols))
    saving = rows[0]["first batch"] - rows[1]["first batch"]
    print(
        f"\nfirst batch after {rows[0]['first batch']:.2f} s cold, {rows[1]['first batch']:.2f} s warm: "
        f"the tokenization cache saves {saving:.2f} s; second run tokenized again: {rows[1]['tokenized']}"
    )
    if rows[1]["tokenized"]:
        sys.exit("the second run tokenized again: the tokenization cache did not work")


if __name__ == "__main__":
    main()
