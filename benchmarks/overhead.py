"""Target 1 — framework overhead: lit-ppl's step loop against a raw ``torch.inference_mode()`` loop.

Both sides run stories260K on the same windows (lit-ppl's, in the same batches), rolling ``--seq-len`` with
batch ``--batch-size``, float32, in this one process. The raw loop's batches are prebuilt before its clock
starts (it pays nothing for batching: a strict bar); lit-ppl's time is its step loop (``results["seconds"]``:
Lightning's loop, collation, the model, the metric, the progress bar and the resume checks), run as
``python -m lit_ppl.validate`` runs it, with ``report.plots=false`` (the per-position breakdown off).

Rounds are interleaved (every thread count and both sides per round, the order reversed every other round) and
every round is printed with the load average, in wall-clock and process CPU time (on a shared machine CPU time
sees through a descheduled process at 1 thread; at 2 it also counts OpenMP's spin-waits), and with the page
faults per step. lit-ppl keeps the step's freed memory in the heap on CPU (``PerplexityModule.on_validation_start``:
glibc's ``mallopt``), which is process-wide: after the warm-up run the raw loop here has it too, so the ratio is
the framework's cost alone. What it is worth against a raw loop on glibc's defaults shows in the last line of
the rounds table: the raw loop once per thread count in a fresh process.

Then, per thread count, the per-step breakdown:

* the raw step and lit-ppl's ``TokenScorer`` (``inference_mode`` and ``no_grad``) on the same batch tensors,
  alternated batch by batch (so that a change of load hits all three alike);
* one instrumented lit-ppl run (timers patched into the methods below, plus ``logger=csv`` so that the
  loggers' callback runs): the scorer, the metric update, the rest of ``validation_step``, the collator, the
  DataLoader around it, the batch transfer, each callback's ``on_validation_batch_end``, and what remains of
  Lightning's loop.

    python benchmarks/overhead.py                      # whole WikiText-2 valid, 1 and 2 threads, 3 rounds: ~20 min
    python benchmarks/overhead.py --threads 1 --rounds 2 --text-bytes 300000 --no-breakdown
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import (
    ROOT,
    STORIES,
    WIKITEXT,
    cut_text,
    lit_ppl,
    load_model,
    raw_batches,
    raw_loop,
    raw_step,
    require_shared,
    table,
)

RELATIVE_NLL = 1e-6  # the raw loop's F.cross_entropy and lit-ppl's in-place loss differ in the last bits only


def use_threads(n: int) -> None:
    """``n`` intra-op threads for both sides; ``OMP_NUM_THREADS`` keeps lit-ppl from resetting the count to one per
    core (:func:`lit_ppl.runtime.threads.set_cpu_threads`), which would run both sides at 2 after lit-ppl's first
    run."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def load_average() -> float:
    return os.getloadavg()[0]


@dataclass
class Usage:
    """What a stretch of this process cost: wall and CPU seconds, system seconds and minor page faults."""

    wall: float = 0.0
    cpu: float = 0.0
    sys: float = 0.0
    faults: int = 0

    @staticmethod
    def now() -> tuple[float, resource.struct_rusage]:
        return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)

    @classmethod
    def since(cls, start: tuple[float, resource.struct_rusage]) -> Usage:
        (wall0, r0), (wall1, r1) = start, cls.now()
        return cls(
            wall1 - wall0,
            r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
            r1.ru_stime - r0.ru_stime,
            r1.ru_minflt - r0.ru_minflt,
        )


@dataclass
class Clock:
    """Wall and process CPU seconds spent in one timed method, and how often it ran."""

    wall: float = 0.0
    cpu: float = 0.0
    calls: int = 0

    def add(self, wall: float, cpu: float) -> None:
        self.wall, self.cpu, self.calls = self.wall + wall, self.cpu + cpu, self.calls + 1


@dataclass
class Timers:
    """Wraps methods of classes with wall/CPU timers; ``restore()`` puts the originals back.

    Timers nest: a method timed inside another is counted in both (the breakdown subtracts). Each wrapper costs
    a few µs per call, against a step of hundreds of milliseconds.
    """

    clocks: dict[str, Clock] = field(default_factory=lambda: defaultdict(Clock))
    originals: list[tuple[type, str, Any]] = field(default_factory=list)

    def wrap(self, owner: type, name: str, label: str) -> None:
        original, clock = owner.__dict__[name], self.clocks[label]

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                clock.add(time.perf_counter() - wall, time.process_time() - cpu)

        self.originals.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self.originals):
            setattr(owner, name, original)
        self.originals.clear()


@contextlib.contextmanager
def step_loop_usage() -> Iterator[Usage]:
    """The usage of lit-ppl's step loop: from the module's validation start (where its ``seconds`` clock starts,
    after the allocator setting) to its epoch end (where it stops). Nothing is added per step."""
    from lit_ppl.evaluation.module import PerplexityModule

    usage, start = Usage(), []
    on_start, on_end = PerplexityModule.on_validation_start, PerplexityModule.on_validation_epoch_end

    def started(module: PerplexityModule) -> None:
        on_start(module)
        start.append(Usage.now())

    def ended(module: PerplexityModule) -> None:
        usage.__dict__.update(Usage.since(start[-1]).__dict__)
        on_end(module)

    PerplexityModule.on_validation_start, PerplexityModule.on_validation_epoch_end = started, ended
    try:
        yield usage
    finally:
        PerplexityModule.on_validation_start, PerplexityModule.on_validation_epoch_end = on_start, on_end


def run_lit(text: Path, work: Path, seq_len: int, batch_size: int, *extra: str) -> tuple[dict[str, Any], Usage]:
    """One lit-ppl evaluation as the CLI runs it (resume checks and progress bar on): ``(results, loop usage)``."""
    overrides = (f"eval.seq_len={seq_len}", f"batch_size={batch_size}", "report.plots=false", *extra)
    # An interrupted run's progress would be resumed: every run here starts from step 0.
    shutil.rmtree(work / "out" / "progress", ignore_errors=True)
    with step_loop_usage() as usage:
        results = lit_ppl(STORIES, text, work, "precision=32-true", *overrides)
    return results, usage


def run_raw(lm: torch.nn.Module, batches: list) -> tuple[int, float, Usage]:
    """The raw loop: ``(tokens, nll_sum, usage)``."""
    start = Usage.now()
    tokens, _, nll_sum = raw_loop(lm, batches)
    return tokens, nll_sum, Usage.since(start)


def check_agree(raw_tokens: int, raw_nll: float, lit: dict[str, Any]) -> None:
    if raw_tokens != lit["tokens"] or abs(raw_nll - lit["nll_sum"]) > RELATIVE_NLL * abs(raw_nll):
        raise AssertionError(
            f"lit-ppl and the raw loop disagree: {lit['tokens']} vs {raw_tokens} tokens, "
            f"NLL sum {lit['nll_sum']} vs {raw_nll}"
        )


def row(r: int | str, n: int, steps: int, tokens: int, raw: Usage, lit: Usage | None, load: str) -> dict[str, Any]:
    per_step = lambda u: f"{u.faults / steps:,.0f} / {u.sys / steps * 1e3:.1f}" if u else "—"  # noqa: E731
    return {
        "round": r,
        "threads": n,
        "raw tok/s": tokens / raw.wall,
        "lit-ppl tok/s": tokens / lit.wall if lit else "—",
        "ratio": raw.wall / lit.wall if lit else "—",
        "ratio (CPU time)": raw.cpu / lit.cpu if lit else "—",
        "raw faults / sys ms per step": per_step(raw),
        "lit-ppl faults / sys ms per step": per_step(lit),
        "load avg": load,
    }


def rounds(text: Path, work: Path, lm: torch.nn.Module, batches: list, args: argparse.Namespace) -> list[dict]:
    """Interleaved rounds: every thread count and both sides per round, the order reversed every other round."""
    rows = []
    for r in range(1, args.rounds + 1):
        for n in args.threads if r % 2 else args.threads[::-1]:
            use_threads(n)
            loads = {}
            for side in ("raw", "lit") if r % 2 else ("lit", "raw"):
                loads[side] = load_average()
                if side == "raw":
                    tokens, nll, raw = run_raw(lm, batches)
                else:
                    res, lit = run_lit(text, work, args.seq_len, args.batch_size)
                    lit.wall = res["seconds"]  # lit-ppl's own clock of its step loop (the same span)
            check_agree(tokens, nll, res)
            rows.append(row(r, n, len(batches), tokens, raw, lit, f"{loads['raw']:.1f} / {loads['lit']:.1f}"))
            print(rows[-1], flush=True)
    return rows


def raw_in_fresh_process(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """The raw loop in its own process, on glibc's default heap (nothing of lit-ppl's has run there)."""
    cmd = [sys.executable, __file__, "--raw-child", "--threads", str(n), "--seq-len", str(args.seq_len)]
    cmd += ["--batch-size", str(args.batch_size), "--text-bytes", str(args.text_bytes), "--work", str(args.work)]
    env = {**os.environ, "OMP_NUM_THREADS": str(n)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def raw_child(args: argparse.Namespace, batches: list) -> None:
    use_threads(args.threads[0])
    tokens, _, usage = run_raw(load_model(STORIES, torch.float32), batches)
    print(json.dumps({"tokens": tokens, **usage.__dict__}))


def paired_steps(lm: torch.nn.Module, batches: list, repeats: int) -> dict[str, Clock]:
    """The raw step and lit-ppl's ``TokenScorer`` (as ``validation_step`` calls it) on the same batch tensors,
    alternated batch by batch in a rotating order."""
    from lit_ppl.model.scorer import TokenScorer

    scorer = TokenScorer(lm, chunk_size=1024)
    total = torch.zeros((), dtype=torch.float64)

    def scored(batch: tuple[torch.Tensor, ...]) -> None:
        total.add_(scorer(*batch).double().sum())

    sides: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
        "raw step (inference_mode)": (lambda b: raw_step(lm, b, total), torch.inference_mode),
        "TokenScorer (inference_mode)": (scored, torch.inference_mode),
        "TokenScorer (no_grad)": (scored, torch.no_grad),
    }
    clocks: dict[str, Clock] = defaultdict(Clock)
    names = list(sides)
    for _ in range(repeats):
        for i, batch in enumerate(batches):
            for name in names[i % 3 :] + names[: i % 3]:
                fn, context = sides[name]
                with context():
                    wall, cpu = time.perf_counter(), time.process_time()
                    fn(batch)
                    clocks[name].add(time.perf_counter() - wall, time.process_time() - cpu)
    return clocks


def instrumented(text: Path, work: Path, args: argparse.Namespace) -> tuple[dict[str, Clock], dict[str, Any], Usage]:
    """One lit-ppl run with timers in the step's parts: ``(clocks, results, loop usage)``."""
    from lightning.pytorch.strategies import Strategy
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

    from lit_ppl.data.datamodule import WindowCollator
    from lit_ppl.evaluation.module import PerplexityModule
    from lit_ppl.evaluation.resume import ResumeCallback
    from lit_ppl.metrics.perplexity import Perplexity
    from lit_ppl.report.loggers import TokensPerSecondLogger
    from lit_ppl.report.progress import TokensPerSecondBar

    timers = Timers()
    for owner, name, label in (
        (PerplexityModule, "validation_step", "validation_step"),
        (PerplexityModule, "score", "scorer"),  # not TokenScorer.forward: check_scorer calls that before the loop
        (Perplexity, "update", "metric update"),
        (_SingleProcessDataLoaderIter, "_next_data", "DataLoader"),
        (WindowCollator, "__call__", "collator"),
        (Strategy, "batch_to_device", "batch_to_device"),
        (TokensPerSecondBar, "on_validation_batch_end", "progress bar"),
        (ResumeCallback, "on_validation_batch_end", "resume checks"),
        (TokensPerSecondLogger, "on_validation_batch_end", "loggers callback"),
    ):
        timers.wrap(owner, name, label)
    try:
        res, usage = run_lit(text, work, args.seq_len, args.batch_size, "logger=csv")
    finally:
        timers.restore()
    usage.wall = res["seconds"]
    return timers.clocks, res, usage


def breakdown(paired: dict[str, Clock], clocks: dict[str, Clock], loop: Usage) -> list[dict]:
    """Milliseconds per step of every part (exclusive: nested timers subtracted), wall and CPU."""
    c = clocks
    steps = c["validation_step"].calls
    minus = lambda a, *b: (c[a].wall - sum(c[x].wall for x in b), c[a].cpu - sum(c[x].cpu for x in b))  # noqa: E731
    parts = {
        "scorer (TokenScorer)": minus("scorer"),
        "metric update (Perplexity.update)": minus("metric update"),
        "rest of validation_step (isfinite, first bad step, counters)": minus(
            "validation_step", "scorer", "metric update"
        ),
        "collator (WindowCollator)": minus("collator"),
        "DataLoader around the collator": minus("DataLoader", "collator"),
        "batch_to_device": minus("batch_to_device"),
        "progress bar (TokensPerSecondBar)": minus("progress bar"),
        "resume checks (ResumeCallback)": minus("resume checks"),
        "loggers callback (TokensPerSecondLogger)": minus("loggers callback"),
    }
    timed = sum(w for w, _ in parts.values()), sum(u for _, u in parts.values())
    parts["Lightning's loop (the rest)"] = (loop.wall - timed[0], loop.cpu - timed[1])
    raw = paired["raw step (inference_mode)"]
    ms = lambda seconds, calls: seconds / calls * 1e3  # noqa: E731
    rows = [
        {"part": name, "ms/step": ms(k.wall, k.calls), "CPU ms/step": ms(k.cpu, k.calls)} for name, k in paired.items()
    ]
    rows.append({"part": "lit-ppl step loop", "ms/step": ms(loop.wall, steps), "CPU ms/step": ms(loop.cpu, steps)})
    rows += [
        {"part": f"· {name}", "ms/step": ms(w, steps), "CPU ms/step": ms(u, steps)} for name, (w, u) in parts.items()
    ]
    outside = (loop.wall - parts["scorer (TokenScorer)"][0], loop.cpu - parts["scorer (TokenScorer)"][1])
    rows.append(
        {"part": "lit-ppl outside the scorer", "ms/step": ms(outside[0], steps), "CPU ms/step": ms(outside[1], steps)}
    )
    for r in rows:
        r["% of raw step (CPU)"] = 100 * r["CPU ms/step"] / ms(raw.cpu, raw.calls)
    return rows


def summary(rows: list[dict], threads: list[int]) -> str:
    lines = []
    for n in threads:
        mine = [r for r in rows if r["threads"] == n and isinstance(r["ratio"], float)]
        for key in ("ratio", "ratio (CPU time)"):
            values = [r[key] for r in mine]
            every = ", ".join(f"{v:.3f}" for v in values)
            lines.append(
                f"{n} thread(s), {key}: median {statistics.median(values):.3f}, min {min(values):.3f} ({every})"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2], help="e.g. 1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--text-bytes", type=int, default=0, help="cut WikiText-2 valid to this many bytes (0: whole)")
    p.add_argument("--paired-repeats", type=int, default=1, help="passes over the batches in the paired comparison")
    p.add_argument("--no-breakdown", action="store_true", help="only the interleaved rounds")
    p.add_argument("--no-fresh-raw", action="store_true", help="skip the raw loop in a fresh process")
    p.add_argument("--raw-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lit_ppl_bench")
    args = p.parse_args()
    require_shared()
    text = cut_text(WIKITEXT, args.text_bytes or None, args.work / f"wiki_{args.text_bytes}.txt")
    batches = raw_batches(STORIES, text, args.work, args.seq_len, args.batch_size)
    if args.raw_child:
        raw_child(args, batches)
        return
    lm = load_model(STORIES, torch.float32)
    tokens, steps = sum(len(b[2]) for b in batches), len(batches)
    fresh = {}
    if not args.no_fresh_raw:  # first, while nothing else of this script runs
        for n in args.threads:
            f = raw_in_fresh_process(args, n)
            fresh[n] = row(
                "fresh process", n, steps, f["tokens"], Usage(f["wall"], f["cpu"], f["sys"], f["faults"]), None, "—"
            )
    use_threads(args.threads[0])
    # Imports, the first Trainer and lit-ppl's allocator setting, on a short text (the whole text is one document).
    run_lit(cut_text(WIKITEXT, 20_000, args.work / "wiki_warm_up.txt"), args.work, args.seq_len, args.batch_size)
    rows = rounds(text, args.work, lm, batches, args)
    print(
        f"\nstories260K, rolling {args.seq_len}, batch {args.batch_size}, float32; WikiText-2 valid "
        f"({args.text_bytes or 'whole'} bytes: {tokens:,} tokens, {steps} steps); ratio = lit-ppl / raw tok/s"
    )
    columns = ["round", "threads", "raw tok/s", "lit-ppl tok/s", "ratio", "ratio (CPU time)"]
    columns += ["raw faults / sys ms per step", "lit-ppl faults / sys ms per step", "load avg"]
    print(table([*rows, *fresh.values()], columns))
    print()
    print(summary(rows, args.threads), flush=True)
    if args.no_breakdown:
        return
    for n in args.threads:  # each printed as soon as it is measured
        use_threads(n)
        load = load_average()
        paired = paired_steps(lm, batches, args.paired_repeats)
        clocks, _, loop = instrumented(text, args.work, args)
        print(f"\nper step, {n} thread(s) (load avg {load:.1f} → {load_average():.1f}):\n")
        print(table(breakdown(paired, clocks, loop), ["part", "ms/step", "CPU ms/step", "% of raw step (CPU)"]))
        print(
            f"instrumented lit-ppl loop: {loop.faults / steps:,.0f} page faults and "
            f"{loop.sys / steps * 1e3:.1f} ms of system time per step",
            flush=True,
        )


if __name__ == "__main__":
    main()
