"""The stop signals of a preemptible run: caught from process start, acted on at the next step check.

Slurm sends SIGUSR1 (``--signal=USR1@90``) before a job's time limit and SIGTERM when it preempts it; a plain ``kill``
reaches one rank. The handler only sets a flag (saving inside a handler could interrupt a half-written tensor);
:class:`lit_ppl.evaluation.resume.ResumeCallback` reads it on every rank, saves and stops with
:class:`lit_ppl.errors.Preempted`, and the entry requeues the job under Slurm (:func:`requeue_if_slurm`). Kept apart
from the callback so that an entry installs the handlers before it imports Lightning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_signalled = False


def _on_signal(signum: int, frame: Any) -> None:
    global _signalled
    _signalled = True


def install_signal_handlers() -> None:
    """Catch SIGUSR1/SIGTERM from process start: one that arrives before the handler would kill the job."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def signalled() -> bool:
    """Whether this process got a stop signal."""
    return _signalled


def requeue_if_slurm() -> None:
    """Under Slurm, rank 0 puts the job back in the queue; the rerun resumes from the saved progress."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and int(os.environ.get("SLURM_PROCID", "0")) == 0:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"lit-ppl: scontrol requeue {job} failed: {done.stderr.strip()}", file=sys.stderr)
