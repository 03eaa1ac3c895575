"""A Hydra callback for sweeps whose jobs report their own peak memory: ``VmHWM`` restarts at each job's start.

The ranks of a ``-m`` sweep under torchrun run every job in one interpreter: without the reset, a job's reported
peak RSS (``rank_peak_rss_mb``, from ``VmHWM``) would be the largest of every job before it. Whatever an earlier job
left resident only raises a later job's peak, so a bound on it is never easier to meet than in a fresh process.
Linux (``/proc``) only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class PeakPerJob(Callback):
    """At each job's start: the last job's cycles collected, free heap returned, then ``clear_refs`` ← 5."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        gc.collect()  # the finished job's trainer and model sit in reference cycles
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current resident size
