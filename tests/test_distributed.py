"""Exact distributed evaluation on real gloo processes: the same numbers at every world size and strategy.

Lightning launches the extra ranks itself (``strategy=ddp|fsdp trainer.devices=N``); the two-"node" runs use
two ``torchrun`` launches on 127.0.0.1. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, STORIES, WIKITEXT, require_shared, run_entry
from helpers.nodes import free_port
from helpers.runs import evaluate_overrides

pytestmark = pytest.mark.slow


def _args(docs: Path, *extra: str) -> list[str]:
    return [f"model.path={STORIES}", f"data.path={docs}", "eval.seq_len=64", "trainer.accelerator=cpu", *extra]


@pytest.fixture(scope="module")
def reference(docs_file, tmp_path_factory):
    """Single-process values in 32-true and 64-true, computed in-process."""
    return {
        precision: evaluate_overrides(_args(docs_file, f"precision={precision}"), tmp_path_factory.mktemp(precision))
        for precision in ("32-true", "64-true")
    }


@pytest.mark.parametrize(
    "strategy,world,batch,precision",
    [
        ("ddp", 3, 3, "32-true"),
        ("ddp", 4, 8, "32-true"),
        ("fsdp", 4, 1, "32-true"),
        ("ddp", 3, 8, "64-true"),
        ("fsdp", 2, 1, "64-true"),
    ],
)
def test_same_perplexity_at_every_world_size(docs_file, reference, tmp_path, strategy, world, batch, precision):
    proc, r = run_entry(
        _args(
            docs_file,
            f"strategy={strategy}",
            f"trainer.devices={world}",
            f"batch_size={batch}",
            f"precision={precision}",
        ),
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = reference[precision]
    assert r["world_size"] == world and r["strategy"] == strategy
    assert (r["tokens"], r["documents"]) == (ref["tokens"], ref["documents"]), (r, ref)
    assert r["words"] == ref["words"] and r["bytes"] == ref["bytes"]
    rel = 1e-6 if precision == "32-true" else 1e-12
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=rel)
    # Exact sharding: per-rank token counts add up, and every rank ran the same number of steps.
    assert sum(r["rank_tokens"]) == ref["tokens"] and len(set(r["rank_steps"])) == 1
    # Every rank reports its own peak memory (gathered like the token counts); no device figure on CPU.
    assert len(r["rank_peak_rss_mb"]) == world and min(r["rank_peak_rss_mb"]) > 0
    assert r["rank_peak_device_mb"] is None


def test_fewer_windows_than_ranks(tmp_path, reference):
    """One short document on 3 ranks (ddp) and 2 ranks (fsdp): two ranks only run padding steps."""
    require_shared()
    doc = tmp_path / "one.txt"
    doc.write_text("Once upon a time there was a cat.", encoding="utf-8")
    single, _ = run_entry([f"model.path={STORIES}", f"data.path={doc}", "trainer.accelerator=cpu"], tmp_path / "a")
    results = [json.loads((tmp_path / "a" / "out" / "results.json").read_text())]
    for strategy, world in (("ddp", 3), ("fsdp", 2)):
        proc, r = run_entry(
            [
                f"model.path={STORIES}",
                f"data.path={doc}",
                "trainer.accelerator=cpu",
                f"strategy={strategy}",
                f"trainer.devices={world}",
            ],
            tmp_path / strategy,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(r)
    assert single.returncode == 0
    for r in results[1:]:
        assert r["tokens"] == results[0]["tokens"] and r["ppl"] == pytest.approx(results[0]["ppl"], rel=1e-6)
        assert r["rank_tokens"].count(0) == r["world_size"] - 1


@pytest.mark.parametrize("strategy", ["ddp"])  # hsdp over two nodes: test_deterministic, bit for bit
def test_two_nodes_by_torchrun(docs_file, reference, tmp_path, strategy):
    """Two torchrun launches (node_rank 0 and 1) of two processes each, on 127.0.0.1."""
    port, out = free_port(), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "-m",
                "lit_ppl.validate",
                *_args(docs_file, f"strategy={strategy}", "trainer.devices=2", "trainer.num_nodes=2", "batch_size=2"),
                f"output_dir={out}",
                f"hydra.run.dir={tmp_path / f'node{node}'}",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    r = json.loads((out / "results.json").read_text())
    assert r["world_size"] == 4 and r["num_nodes"] == 2
    assert r["tokens"] == reference["32-true"]["tokens"]
    assert r["ppl"] == pytest.approx(reference["32-true"]["ppl"], rel=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_killed_rank_fails_the_job_within_the_timeout(tmp_path, strategy):
    """SIGKILL rank 1 mid-run: rank 0 must exit non-zero within the timeout, naming the problem in one line — no hang,
    and under every layout (under fsdp and tp the step's own collectives fail first: gloo's plain RuntimeError)."""
    require_shared()
    timeout_s, out = 20, tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "lit_ppl.validate",
        f"data.path={WIKITEXT}",
        "eval.seq_len=256",
        "batch_size=1",
        "trainer.accelerator=cpu",
        f"strategy={strategy}",
        "trainer.devices=2",
        f"distributed.timeout_s={timeout_s}",
        "resume.save_every=5",
        # a wider built-in model: rank 1 is still mid-run when the test kills it
        "model.hidden_size=256",
        "model.num_layers=4",
        f"output_dir={out}",
        f"hydra.run.dir={out}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((out / "progress").glob("rank1-step*.pt")):  # rank 1 is mid-run once it has saved progress
        assert parent.poll() is None and time.monotonic() < deadline, "rank 1 never got going"
        time.sleep(0.05)
    children = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()
    assert children, "Lightning did not launch a second rank"
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        _, err = parent.communicate(timeout=timeout_s + 120)
    except subprocess.TimeoutExpired:
        parent.kill()
        pytest.fail("rank 0 hung after rank 1 was killed")
    elapsed = time.monotonic() - killed_at
    assert parent.returncode != 0 and not (out / "results.json").exists()
    # Whichever notices first reports it, in one message: lit-ppl's failed collective on rank 0, or Lightning's
    # launcher, which watches the ranks it started and ends the job when one dies.
    ours = any(
        f"lit-ppl: error: rank 0: {what}" in err
        for what in ("lost contact with another rank", "a collective failed, another rank probably died")
    )
    lightnings = "[rank: 1] Child process with PID" in err and "terminated with code -9" in err
    assert ours or lightnings, err[-3000:]
    assert err.count("lit-ppl: error") <= 1, "one clear message, not one per layer"
    assert "internal error" not in err and "Traceback" not in err, err[-3000:]
    assert elapsed < timeout_s + 120
