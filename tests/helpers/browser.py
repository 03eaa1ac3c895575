"""Pytest helper: a real headless Chromium (Debian's package, installed by ``.ci/chromium.sh`` as the Slurm tests
install Slurm) that loads a page and reports its DOM after the scripts ran, its console errors and a screenshot.

Skipped where the browser cannot be had (not root, no apt) — unless ``CI=true``, where it must run.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.slurm_cluster import _in_ci

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL = REPO_ROOT / ".ci" / "chromium.sh"
# Isolated and offline: no sandbox (root in a container), no GPU, no network services, a profile of its own.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--enable-logging=stderr",
    "--v=0",
)
# What Chromium logs for any console message of the page (it does not say which level) and for an uncaught
# exception; report.js writes none, so every such line is a fault.
CONSOLE = re.compile(r":CONSOLE[:(]|Uncaught")


@dataclass
class Loaded:
    dom: str  # the document after its scripts ran
    console_errors: list[str]  # every console line and uncaught exception


class Chromium:
    def __init__(self, binary: str) -> None:
        self.binary = binary

    def _run(self, url: str, *flags: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as profile:
            cmd = [self.binary, *FLAGS, f"--user-data-dir={profile}", *flags, url]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    def load(self, page: Path) -> Loaded:
        proc = self._run(page.resolve().as_uri(), "--dump-dom")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return Loaded(proc.stdout, [line for line in proc.stderr.splitlines() if CONSOLE.search(line)])

    def screenshot(self, page: Path, out: Path, width: int = 1280, height: int = 2400) -> Path:
        proc = self._run(page.resolve().as_uri(), f"--screenshot={out}", f"--window-size={width},{height}")
        assert proc.returncode == 0 and out.is_file(), proc.stderr[-2000:]
        return out


def report_data(page: Path) -> dict:
    """The data a ``report.html`` embeds for its script (the sampled tokens' text and values)."""
    html = page.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="lit-ppl-data">(.*?)</script>', html).group(1))


def chromium() -> Chromium:
    """The browser, installed if missing; skips (fails in CI) where it cannot be."""
    try:
        proc = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as err:
        proc = subprocess.CompletedProcess([], 1, "", repr(err))
    if proc.returncode != 0:
        reason = f"headless Chromium unavailable: {proc.stderr.strip()[-500:]}"
        if _in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return Chromium(proc.stdout.strip().splitlines()[-1])
