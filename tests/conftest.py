"""Shared fixtures: the real test data, composed Hydra configs, and subprocess runs of the entry point."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.slurm_cluster import slurm  # noqa: F401  (the session fixture of the Slurm tests)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
STORIES = SHARED / "stories260K"
TINYSTORIES = SHARED / "tinystories_sample.txt"
WIKITEXT = SHARED / "wikitext-2" / "valid.tokens.txt"

# Tests never reach a hub: everything is local files or built from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _restore_environ():
    """Each test starts from the same ``os.environ``: Lightning writes ``MASTER_PORT`` into it, and a port left
    behind fixes the rendezvous port of every later subprocess run."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own, killed whole on timeout.

    The ranks Lightning launches are grandchildren: ``subprocess.run`` would kill only the first one and leave the
    others waiting on its port, to break later tests.
    """
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as err:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from err
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever it left behind, even when it exited in time
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def require_shared() -> None:
    if not STORIES.is_dir() or not TINYSTORIES.is_file():
        pytest.skip(f"the shared test data is absent (expected {SHARED})")


@pytest.fixture
def stories() -> Path:
    require_shared()
    return STORIES


@pytest.fixture
def compose(tmp_path):
    """Compose the real config tree with overrides; output and caches go to the test's tmp dir."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lit_ppl.validate import conf_dir

    def _compose(*overrides: str):
        defaults = [f"output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'cache'}"]
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            return hydra_compose("validate", overrides=[*defaults, *overrides])

    return _compose


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory) -> Path:
    """Five real TinyStories documents (5 does not divide 2, 3 or 4) as JSON lines."""
    require_shared()
    texts = [t.strip() for t in TINYSTORIES.read_text(encoding="utf-8").split("<|endoftext|>") if t.strip()]
    assert len(texts) == 5
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def run_entry(
    args: list[str], tmp_path: Path, timeout: float = 240, env: dict | None = None, module: str = "lit_ppl.validate"
):
    """Run ``python -m lit_ppl.validate ARGS`` in a fresh process; return (completed process, results or None)."""
    out = tmp_path / "out"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", module, f"output_dir={out}", f"hydra.run.dir={out}", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = run(cmd, timeout, cwd=tmp_path, env=full_env)
    results = out / "results.json"
    return proc, (json.loads(results.read_text()) if results.is_file() else None)
