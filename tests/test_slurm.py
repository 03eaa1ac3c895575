"""The sbatch templates on a real, local two-node Slurm: same numbers as one process; preemption resumes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import ROOT, STORIES, WIKITEXT, require_shared
from helpers.runs import evaluate_overrides

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
TEMPLATE = ROOT / "slurm" / "validate_cpu.sbatch"


def _submit_and_wait(slurm, tmp_path: Path, sbatch_args: list[str], args: list[str], timeout: float = 180) -> dict:
    out = tmp_path / "out"
    job = slurm.submit(TEMPLATE, [*args, f"output_dir={out}"], sbatch_args, cwd=tmp_path)
    state = slurm.wait(job, timeout=timeout)
    assert state == "COMPLETED", slurm.diagnostics(job)
    return json.loads((out / "results.json").read_text())


def _template_args(docs: Path) -> list[str]:
    return [f"model.path={STORIES}", f"data.path={docs}", "eval.seq_len=64", "strategy=ddp"]


@pytest.fixture(scope="module")
def single_process(docs_file, tmp_path_factory) -> dict:
    """The one-process run both shapes are compared with: computed once, in this process (no interpreter to start)."""
    args = [a for a in _template_args(docs_file) if a != "strategy=ddp"] + ["trainer.accelerator=cpu"]
    return evaluate_overrides(args, tmp_path_factory.mktemp("local"))


@pytest.mark.parametrize("shape", [["--nodes=1", "--ntasks-per-node=2"], ["--nodes=2", "--ntasks-per-node=1"]])
def test_templates_give_the_single_process_numbers(slurm, docs_file, single_process, tmp_path, shape):
    args, ref = _template_args(docs_file), single_process
    r = _submit_and_wait(slurm, tmp_path, shape, args)
    assert r["world_size"] == 2 and r["num_nodes"] == int(shape[0].split("=")[1])
    assert r["tokens"] == ref["tokens"]
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)


def test_preempted_job_requeues_and_resumes_bit_identical(slurm, tmp_path):
    require_shared()
    text = tmp_path / "wiki.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    args = [
        f"data.path={text}",
        "eval.seq_len=256",
        "batch_size=4",
        "resume.save_every=5",
        "resume.check_every=1",
        # a wider built-in model, so that the run lasts seconds and the signal lands mid-run
        "model.hidden_size=256",
        "model.num_layers=4",
    ]
    ref = evaluate_overrides([*args, "trainer.accelerator=cpu"], tmp_path / "local")  # in this process: no start-up

    out = tmp_path / "out"
    job = slurm.submit(TEMPLATE, [*args, f"output_dir={out}"], ["--nodes=1", "--ntasks-per-node=1"], cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not list((out / "progress").glob("rank0-step*.pt")):  # mid-run: progress saved, not yet finished
        assert time.monotonic() < deadline, slurm.diagnostics(job)
        time.sleep(0.1)
    slurm.cancel(job, "USR1")  # what --signal=USR1@90 sends before the time limit
    state = slurm.wait(job, timeout=240)
    assert state == "COMPLETED", slurm.diagnostics(job)
    assert int(slurm.job_info(job)["Restarts"]) >= 1, "the job was not requeued"
    log = slurm.output(job)
    assert "stopped by a signal at step" in log and "resuming from step" in log, log[-3000:]
    r = json.loads((out / "results.json").read_text())
    for key in ("ppl", "nll_sum", "nll_stderr", "tokens", "bytes"):
        assert r[key] == ref[key], key
