"""Hydra sweeps: per-job results.json, the sweep's summary table, DDP inside a sweep, submitit on a real Slurm."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run
from helpers.nodes import free_port
from omegaconf import OmegaConf

from lit_ppl.report.sweep import summarize, sweep_markdown, write_summary
from lit_ppl.run import evaluate


def fake_job(sweep, name: str, overrides: list[str], results: dict | None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    if results is not None:
        (job / "results.json").write_text(json.dumps(results))


def result(ppl: float, precision: str = "32-true", quant: str | None = None, **extra) -> dict:
    return {
        "ppl": ppl,
        "nll_stderr": 0.01,
        "tokens": 1000,
        "precision": precision,
        "quant": {"name": quant} if quant else None,
        "world_size": 1,
        "tokens_per_s": 5000.0,
        **extra,
    }


def test_summary_columns_rows_and_missing_jobs(tmp_path):
    fake_job(tmp_path, "0", ["quant=none", "precision=32-true", "eval.seq_len=64"], result(10.0))
    fake_job(tmp_path, "1", ["quant=int8", "precision=32-true", "eval.seq_len=64"], result(10.5, quant="int8"))
    fake_job(tmp_path, "2", ["quant=none", "precision=bf16-mixed", "eval.seq_len=64"], None)  # failed
    fake_job(tmp_path, "10", ["quant=int8", "precision=bf16-mixed", "eval.seq_len=64"], result(11.0, "bf16-mixed"))
    rows = summarize(tmp_path)
    # Only the overrides that vary; metrics named like them are not repeated; jobs in numeric order.
    assert list(rows[0]) == [
        "job", "quant", "precision", "ppl", "nll_stderr", "tokens", "world_size", "tokens_per_s", "status",
    ]  # fmt: skip
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]
    assert [r["ppl"] for r in rows] == [10.0, 10.5, "", 11.0]
    assert rows[2]["status"] == "no results.json" and rows[2]["quant"] == "none"
    md = sweep_markdown(rows)
    assert md.count("\n") == 2 + 4 and "| 1 | int8 | 32-true | 10.500000 |" in md


def test_summary_has_kld_when_comparing(tmp_path):
    fake_job(tmp_path, "0", ["quant=int8"], result(10.0, quant="int8", compare={"kld_mean": 0.002}))
    fake_job(tmp_path, "1", ["quant=int4"], result(12.0, quant="int4", compare={"kld_mean": 0.05}))
    md_path, csv_path, _ = write_summary(tmp_path)
    table = list(csv.DictReader(csv_path.open()))
    assert [r["kld_mean"] for r in table] == ["0.002", "0.05"] and "kld_mean" in md_path.read_text()
    # A single job: nothing varies, so its overrides are all shown.
    single = tmp_path / "single"
    fake_job(single, "0", ["quant=int8"], result(10.0, quant="int8"))
    assert summarize(single)[0]["quant"] == "int8"


def test_config_registers_callback_and_composes_submitit(compose):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lit_ppl.validate import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        for launcher in ("submitit_slurm", "slurm"):
            cfg = hydra_compose("validate", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
            assert cfg.hydra.launcher._target_.endswith("submitit_launcher.SlurmLauncher")
            assert cfg.hydra.callbacks.sweep_summary._target_ == "lit_ppl.report.sweep.SweepSummary"
        overrides = ["hydra/launcher=slurm", "trainer.devices=4"]
        cfg = hydra_compose("validate", overrides=overrides, return_hydra_config=True)
        assert cfg.hydra.launcher.tasks_per_node == 4 and cfg.hydra.launcher.nodes == 1


@pytest.mark.slow
def test_submitit_launcher_cfg_subprocess(tmp_path):
    # Hydra 1.3 refuses -m together with --cfg ("Only one of --run, --multirun, --cfg ..."); the launcher
    # config composes the same without -m.
    cmd = [sys.executable, "-m", "lit_ppl.validate", "hydra/launcher=submitit_slurm", "--cfg", "hydra"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher = OmegaConf.create(proc.stdout).hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def sweep(args: list[str], tmp_path, env: dict | None = None, timeout: float = 300):
    """``python -m lit_ppl.validate -m ARGS`` into ``tmp_path/sweep``; return (process, sweep dir)."""
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "lit_ppl.validate", "-m", *args, f"hydra.sweep.dir={sweep_dir}"]
    cmd.append(f"data.cache_dir={tmp_path / 'cache'}")
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = run(cmd, timeout, cwd=tmp_path, env=full_env)
    return proc, sweep_dir


def check_sweep(sweep_dir, rows: int) -> list[dict]:
    results = [json.loads((sweep_dir / str(i) / "results.json").read_text()) for i in range(rows)]
    table = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert len(table) == rows and all(r["status"] == "ok" for r in table)
    assert [float(r["ppl"]) for r in table] == [r["ppl"] for r in results]
    assert (sweep_dir / "summary.md").read_text().count("\n") == 2 + rows
    return results


@pytest.mark.slow
def test_sweep_writes_each_results_and_summary(compose, tmp_path):
    proc, sweep_dir = sweep(["quant=none,int8", "precision=32-true", "eval.seq_len=32"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    none, int8 = check_sweep(sweep_dir, 2)
    assert none["quant"] is None and int8["quant"]["name"] == "int8"
    assert none["ppl"] == pytest.approx(evaluate(compose("eval.seq_len=32"))["ppl"], rel=1e-12, abs=0)
    assert "sweep summary" in proc.stdout and "| job | quant | ppl |" in proc.stdout
    assert not (tmp_path / "outputs").exists()  # nothing went to the single-run directory


@pytest.mark.slow
def test_sweep_with_ddp_ranks_relaunched_by_lightning(compose, tmp_path):
    """Each job's second rank is re-run by Lightning from the command line: it must run that job, in its dir.

    With ``MASTER_PORT`` fixed, as on a cluster: every job rendezvouses on the same port, so nothing of the
    previous job (its ranks, its store) may be left when the next starts."""
    args = ["eval.seq_len=32,48", "strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu"]
    proc, sweep_dir = sweep(args, tmp_path, env={"MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_sweep(sweep_dir, 2)
    for r, seq_len in zip(results, (32, 48), strict=True):
        assert r["world_size"] == 2 and r["seq_len"] == seq_len
        single = evaluate(compose(f"eval.seq_len={seq_len}"))
        assert r["ppl"] == pytest.approx(single["ppl"], rel=1e-6) and r["tokens"] == single["tokens"]
    assert all((sweep_dir / str(i) / "train_ddp_process_1.log").is_file() for i in range(2))


@pytest.mark.slow
@pytest.mark.slurm
def test_submitit_sweep_on_local_slurm(slurm, compose, tmp_path):
    """hydra/launcher=slurm: each run is a Slurm job whose 2 tasks are Lightning's DDP ranks (SLURMEnvironment)."""
    args = ["hydra/launcher=slurm", "hydra.launcher.timeout_min=5", "quant=none,int8", "eval.seq_len=32"]
    args += ["strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu"]
    proc, sweep_dir = sweep(args, tmp_path, env=slurm.env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:] + slurm.diagnostics()
    none, _ = check_sweep(sweep_dir, 2)
    assert none["world_size"] == 2
    assert none["ppl"] == pytest.approx(evaluate(compose("eval.seq_len=32"))["ppl"], rel=1e-6)
