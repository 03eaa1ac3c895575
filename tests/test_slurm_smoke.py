"""Smoke tests for the local two-node Slurm cluster (.ci/slurm.sh + tests/helpers/slurm_cluster.py)."""

from __future__ import annotations

import re
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def _write_script(path, body: str):
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body).lstrip())
    return path


def test_two_nodes_four_tasks(slurm, tmp_path):
    script = _write_script(
        tmp_path / "ranks.sbatch",
        """
        #SBATCH --job-name=smoke-ranks
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=2
        #SBATCH --output=ranks-%j.out
        srun -N2 -n4 bash -c 'echo "RANK node=$SLURM_NODEID proc=$SLURM_PROCID host=$SLURMD_NODENAME"'
        """,
    )
    job = slurm.submit(script, cwd=tmp_path)
    state = slurm.wait(job, timeout=60)
    assert state == "COMPLETED", slurm.diagnostics(job)
    out = (tmp_path / f"ranks-{job}.out").read_text()
    lines = re.findall(r"^RANK node=(\d+) proc=(\d+) host=(\S+)$", out, flags=re.M)
    assert len(lines) == 4, out
    assert {n for n, _, _ in lines} == {"0", "1"}, out
    assert {p for _, p, _ in lines} == {"0", "1", "2", "3"}, out
    assert {h for _, _, h in lines} == {"n1", "n2"}, out


def test_sigusr1_reaches_python_task(slurm, tmp_path):
    """`scancel --signal=USR1` (what --signal=USR1@T does at T s before the time limit)
    reaches a python task started by srun, which handles it and exits cleanly."""
    ready, got = tmp_path / "ready", tmp_path / "got_usr1"
    prog = tmp_path / "sig.py"
    prog.write_text(
        textwrap.dedent(
            f"""
            import signal, sys, time, pathlib
            def handler(signum, frame):
                pathlib.Path({str(got)!r}).write_text(str(signum))
                sys.exit(0)
            signal.signal(signal.SIGUSR1, handler)
            # only now is it safe to signal us (default SIGUSR1 action kills the task)
            pathlib.Path({str(ready)!r}).write_text("ok")
            for _ in range(600):
                time.sleep(0.1)
            sys.exit(3)  # no signal came
            """
        )
    )
    script = _write_script(
        tmp_path / "sig.sbatch",
        f"""
        #SBATCH --job-name=smoke-signal
        #SBATCH --nodes=1
        #SBATCH --ntasks-per-node=1
        #SBATCH --output=sig-%j.out
        srun {sys.executable} {prog}
        echo "srun exit=$?"
        """,
    )
    job = slurm.submit(script, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "task never got ready\n" + slurm.diagnostics(job)
        assert slurm.state(job) not in {"COMPLETED", "FAILED", "CANCELLED"}, slurm.diagnostics(job)
        time.sleep(0.2)
    slurm.cancel(job, signal="USR1")
    state = slurm.wait(job, timeout=60)
    assert got.exists(), "SIGUSR1 did not reach the task\n" + slurm.diagnostics(job)
    assert got.read_text() == "10"
    assert state == "COMPLETED", slurm.diagnostics(job)
    assert "srun exit=0" in (tmp_path / f"sig-{job}.out").read_text()


def test_requeue_restarts_job(slurm, tmp_path):
    """A job that requeues itself (what lit_ppl does on SIGUSR1) runs again, with the
    same job id and SLURM_RESTART_COUNT=1, within a few seconds."""
    script = _write_script(
        tmp_path / "requeue.sbatch",
        """
        #SBATCH --job-name=smoke-requeue
        #SBATCH --nodes=1
        #SBATCH --ntasks-per-node=1
        #SBATCH --requeue
        #SBATCH --open-mode=append
        #SBATCH --output=requeue-%j.out
        echo "run job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-0}"
        if [[ ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
            scontrol requeue "$SLURM_JOB_ID"
            sleep 60
        fi
        echo finished
        """,
    )
    t0 = time.monotonic()
    job = slurm.submit(script, cwd=tmp_path)
    state = slurm.wait(job, timeout=90)
    assert state == "COMPLETED", slurm.diagnostics(job)
    assert slurm.job_info(job)["Restarts"] == "1"
    out = (tmp_path / f"requeue-{job}.out").read_text()
    assert f"run job={job} restart=0" in out and f"run job={job} restart=1" in out, out
    assert out.rstrip().endswith("finished"), out
    assert time.monotonic() - t0 < 60
