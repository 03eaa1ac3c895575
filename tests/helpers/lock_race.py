"""Processes racing for one ``output_dir`` lock (spawned by ``multiprocessing``: this module imports nothing heavy).

Each worker, every trial: wait for all (a barrier), try to take the lock, say whether it did, and hold what it took
until the parent has looked at every answer, so that two holders at once are seen, not one after another.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any


def race(directory: str, module: str, barrier: Any, answers: Any, trials: int) -> None:
    run_lock = importlib.import_module(module).run_lock  # the module under test (its run_lock)
    for trial in range(trials):
        barrier.wait()
        try:
            with run_lock(Path(directory), True):
                answers.put((trial, os.getpid(), True))
                barrier.wait()  # every worker has tried
                barrier.wait()  # the parent has counted
        except ValueError:  # refused: the lock is someone else's
            answers.put((trial, os.getpid(), False))
            barrier.wait()
            barrier.wait()
        barrier.wait()  # released: only now may the parent write the next trial's stale lock
