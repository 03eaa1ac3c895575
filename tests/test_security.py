"""Overrides that would write files or run code: each refused with one line, before anything is instantiated, and
the file it aimed at is untouched (real ``python -m lit_ppl.validate`` processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_entry

pytestmark = pytest.mark.slow


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def _refused(proc, key: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-ppl: error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and key in errors[0] and "allow_any_target=true" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_logger_target_through_a_module_import_cannot_truncate_a_file(tmp_path):
    victim = _victim(tmp_path)
    # os.open(path, O_WRONLY | O_CREAT | O_TRUNC): the name starts with an allowed package, the object is os.open.
    args = [
        "logger=none",
        "+logger._target_=lightning.pytorch.loggers.csv_logs.os.open",
        f"+logger.path={victim}",
        "+logger.flags=577",
    ]
    proc, results = run_entry(args, tmp_path / "run")
    _refused(proc, "logger._target_='lightning.pytorch.loggers.csv_logs.os.open'")
    assert results is None and victim.read_text() == "precious\n"


def test_a_lit_ppl_function_as_logger_cannot_write_sitecustomize(tmp_path):
    target = tmp_path / "site" / "sitecustomize.py"
    args = [
        "logger=none",
        "+logger._target_=lit_ppl.runtime.files.write_text_atomic",
        f"+logger.path={target}",
        "+logger.text='import os'",
    ]
    proc, _ = run_entry(args, tmp_path / "run")
    _refused(proc, "logger._target_='lit_ppl.runtime.files.write_text_atomic'")
    assert not target.exists() and not target.parent.exists()


@pytest.mark.parametrize("target", ["lit_ppl.data.store.os.system", "os.system", "lit_ppl.data.sources.DataSpec"])
def test_model_target_must_be_the_model_spec_itself(tmp_path, target):
    marker = tmp_path / "ran"
    proc, _ = run_entry([f"model._target_={target}", f"model.path='touch {marker}'"], tmp_path / "run")
    _refused(proc, f"model._target_={target!r}")
    assert not marker.exists()


def test_data_target_must_be_the_data_spec_itself(tmp_path):
    proc, _ = run_entry(["data._target_=lit_ppl.data.store.shutil.rmtree", f"data.path={tmp_path}"], tmp_path / "run")
    _refused(proc, "data._target_='lit_ppl.data.store.shutil.rmtree'")
    assert tmp_path.is_dir()


def test_hydra_callback_target_is_refused_before_hydra_builds_it(tmp_path):
    victim = _victim(tmp_path)
    args = [
        "+hydra.callbacks.evil._target_=builtins.open",
        f"+hydra.callbacks.evil.file={victim}",
        "+hydra.callbacks.evil.mode=w",
    ]
    proc, _ = run_entry(args, tmp_path / "run")
    _refused(proc, "+hydra.callbacks.evil._target_=builtins.open")
    assert victim.read_text() == "precious\n"


def test_allowed_targets_still_run_under_any_import_path(tmp_path):
    """The allow-list compares resolved classes: the logger's defining module names the same class."""
    args = ["logger=csv", "logger._target_=lightning.pytorch.loggers.csv_logs.CSVLogger"]
    proc, results = run_entry(args, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results is not None and os.path.isdir(tmp_path / "run" / "out" / "csv")
