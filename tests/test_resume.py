"""Preemption without Slurm: a signalled or killed run resumes and ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, WIKITEXT, require_shared
from helpers.browser import report_data

from lit_ppl.data import autobatch
from lit_ppl.errors import EXIT_PREEMPTED
from lit_ppl.report import runs as report

pytestmark = pytest.mark.slow
EXACT_KEYS = ("ppl", "nll_sum", "nll_mean", "nll_stderr", "tokens", "words", "bytes", "documents", "word_ppl")
DDP2 = ("strategy=ddp", "trainer.devices=2")


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    require_shared()
    path = tmp_path_factory.mktemp("text") / "wiki.txt"
    path.write_text(WIKITEXT.read_text(encoding="utf-8")[:36_000], encoding="utf-8")
    return path


def _cmd(text: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lit_ppl.validate",
        f"output_dir={out}",
        f"hydra.run.dir={out}",
        f"data.path={text}",
        "eval.seq_len=256",
        "batch_size=4",
        "trainer.accelerator=cpu",
        "resume.save_every=5",
        "resume.check_every=1",
        # a wider built-in model, so that a run lasts seconds and a test can act mid-run
        "model.hidden_size=256",
        "model.num_layers=4",
        *extra,
    ]


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(text: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(_cmd(text, out, *extra), cwd=out, env=ENV, capture_output=True, text=True, timeout=300)
    path = out / "results.json"
    return proc, json.loads(path.read_text()) if path.is_file() else None


def _saved_at_least(out: Path, step: int) -> bool:
    """Rank 0 has saved progress at ``step`` or later (older files are pruned as newer ones land)."""
    steps = [
        int(m.group(1)) for p in (out / "progress").glob("rank0-step*.pt") if (m := re.search(r"step(\d+)", p.name))
    ]
    return any(s >= step for s in steps)


def _start_and_wait(text: Path, out: Path, *extra: str, step: int = 5) -> subprocess.Popen:
    """Start a run and return once rank 0 has saved progress at ``step`` (it is then mid-run)."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        _cmd(text, out, *extra), cwd=out, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not _saved_at_least(out, step):
        assert proc.poll() is None, "the run ended before saving progress: " + proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "no progress saved within 120 s"
        time.sleep(0.05)
    return proc


@pytest.fixture(scope="module")
def uninterrupted(text, tmp_path_factory):
    results = {}
    for world, extra in ((1, ()), (2, DDP2)):
        proc, r = _run(text, tmp_path_factory.mktemp(f"full{world}"), *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[world] = r
    assert results[2]["ppl"] == pytest.approx(results[1]["ppl"], rel=1e-6)
    return results


def _assert_identical(r: dict, ref: dict) -> None:
    for key in EXACT_KEYS:
        assert r[key] == ref[key], key  # bit-identical, not approximately equal


@pytest.mark.parametrize("sig,world", [(signal.SIGUSR1, 1), (signal.SIGTERM, 2)])  # each signal, each world size
def test_signal_saves_then_rerun_is_bit_identical(text, uninterrupted, tmp_path, sig, world):
    extra = DDP2 if world == 2 else ()
    out = tmp_path / "run"
    proc = _start_and_wait(text, out, *extra)
    proc.send_signal(sig)  # to rank 0 only: the ranks agree through an all-reduce and stop at the same step
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = int(re.search(r"stopped by a signal at step (\d+)", err).group(1))
    assert not (out / "results.json").exists(), "results.json is never written before the run is complete"
    for rank in range(world):
        assert (out / "progress" / f"rank{rank}-step{stopped}.pt").exists()
    done, r = _run(text, out, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from step {stopped}" in done.stderr
    _assert_identical(r, uninterrupted[world])
    assert not list((out / "progress").glob("*.pt")), "a finished run leaves no progress behind"
    # report.html's sampled tokens (36K scored: evenly spread windows) are metric states: restored like the sums.
    page = report_data(out / "report.html")
    assert page == report_data(Path(uninterrupted[world]["config"]["output_dir"]) / "report.html")
    assert 0 < sum(len(p["text"]) for p in page["pages"]) < r["tokens"]


def test_crash_loses_at_most_the_work_since_the_last_save(text, uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc = _start_and_wait(text, out, step=10)
    proc.kill()  # SIGKILL: no handler runs, nothing is saved at the end
    proc.wait(timeout=30)
    saved = max(int(re.search(r"step(\d+)", p.name).group(1)) for p in (out / "progress").glob("rank0-step*.pt"))
    assert saved >= 10
    done, r = _run(text, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from step {saved}" in done.stderr
    _assert_identical(r, uninterrupted[1])


def test_progress_of_another_configuration_is_refused(text, tmp_path):
    out = tmp_path / "run"
    proc = _start_and_wait(text, out)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED
    done, r = _run(text, out, "eval.seq_len=128")
    assert done.returncode == 1 and r is None
    assert "holds progress of a different run" in done.stderr


def test_deterministic_resume_on_two_ranks_equals_one_process(text, tmp_path):
    """eval.deterministic=true: a signalled 2-rank run, resumed, gives one process's numbers, bit for bit, and the
    same per-token files (report.per_token, save_reference) as an uninterrupted one-process run."""
    det = ("eval.deterministic=true", "report.per_token=true")
    proc, one = _run(text, tmp_path / "one", *det, f"save_reference={tmp_path / 'one_store'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, store = tmp_path / "run", f"save_reference={tmp_path / 'run_store'}"
    proc = _start_and_wait(text, out, *DDP2, *det, store)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    done, r = _run(text, out, *DDP2, *det, store)
    assert done.returncode == 0 and "resuming from step" in done.stderr, done.stderr[-3000:]
    _assert_identical(r, one)
    assert r["nll_by_position"] == one["nll_by_position"]
    for a, b in (
        (tmp_path / "one" / "per_token.npy", out / "per_token.npy"),
        *((tmp_path / "one_store" / f, tmp_path / "run_store" / f) for f in ("hidden.npy", "nll.npy", "target.npy")),
    ):
        assert a.read_bytes() == b.read_bytes(), b.name


def _cache_says(cache: Path, size: int, max_batch: int) -> None:
    """Make the autobatch cache answer ``size`` when asked up to ``max_batch``: what another node's probe would find.

    The run's own entry (model, seq_len, precision, chunk size, device) is copied with ``max_batch`` replaced.
    """
    entries = json.loads(cache.read_text())
    for key in list(entries):
        entries[autobatch.cache_key(**{**json.loads(key), "max_batch": max_batch})] = size
    cache.write_text(json.dumps(entries))


def test_auto_batch_size_resumes_only_into_the_saved_plan(text, uninterrupted, tmp_path):
    """batch_size=auto: a requeue is refused where the saved size no longer fits, and exact where it does."""
    out, cache = tmp_path / "run", tmp_path / "autobatch.json"
    auto = ("batch_size=auto", f"autobatch.cache={cache}")
    proc = _start_and_wait(text, out, *auto, "autobatch.max_batch=4")  # resolves to 4 on this machine
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = int(re.search(r"stopped by a signal at step (\d+)", err).group(1))
    saved = torch.load(out / "progress" / f"rank0-step{stopped}.pt", weights_only=True)
    assert saved["plan"] == {"batch_size": 4, "rank_weights": None}

    _cache_says(cache, 2, max_batch=4)  # a node where only 2 windows fit: the saved batches of 4 cannot run
    done, r = _run(text, out, *auto, "autobatch.max_batch=4")
    assert done.returncode == 1 and r is None, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("lit-ppl: error:")]
    assert errors == [
        f"lit-ppl: error: {out / 'progress'} holds progress of batches of 4 windows, but this run makes batches of "
        f"2: its steps are other batches than this run's; set batch_size=4 if it fits, or delete {out / 'progress'} "
        "to start over"
    ]

    # A node whose probe picks 8: the saved 4 fits there, so the run goes on with batches of 4, bit for bit.
    _cache_says(cache, 4, max_batch=4)
    _cache_says(cache, 8, max_batch=8)
    done, r = _run(text, out, *auto, "autobatch.max_batch=8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from step {stopped}" in done.stderr
    _assert_identical(r, uninterrupted[1])
    assert r["batch_size"] == 4 and r["config"]["batch_size"] == "auto"
    assert report.describe(report.load_run(out)).endswith("· batch 4 · 1 node)")  # the resolved size, not "auto"
