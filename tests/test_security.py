"""Overrides that would write files or run code: each refused with one line before anything is instantiated, and
the file it aimed at is untouched. The entry point end to end for two of them; the rest through the same check
in-process (``evaluate`` on a composed config runs it first)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_entry

from lit_ppl.config import ConfigError
from lit_ppl.run import evaluate


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def _refused_by_the_entry(proc, key: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-ppl: error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and key in errors[0] and "allow_any_target=true" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_logger_target_through_a_module_import_cannot_truncate_a_file(tmp_path):
    """``os.open(path, O_WRONLY | O_CREAT | O_TRUNC)``: the name starts with an allowed package, the object is
    ``os.open``; before, it truncated the file."""
    victim = _victim(tmp_path)
    args = ["logger=none", "+logger._target_=lightning.pytorch.loggers.csv_logs.os.open"]
    proc, results = run_entry([*args, f"+logger.path={victim}", "+logger.flags=577"], tmp_path / "run")
    _refused_by_the_entry(proc, "logger._target_='lightning.pytorch.loggers.csv_logs.os.open'")
    assert results is None and victim.read_text() == "precious\n"


@pytest.mark.slow
def test_hydra_callback_target_is_refused_before_hydra_builds_it(tmp_path):
    victim = _victim(tmp_path)
    evil = "+hydra.callbacks.evil"
    args = [f"{evil}._target_=builtins.open", f"{evil}.file={victim}", f"{evil}.mode=w"]
    proc, _ = run_entry(args, tmp_path / "run")
    _refused_by_the_entry(proc, "+hydra.callbacks.evil._target_=builtins.open")
    assert victim.read_text() == "precious\n"


def test_a_lit_ppl_function_as_logger_cannot_write_sitecustomize(compose, tmp_path):
    target = tmp_path / "site" / "sitecustomize.py"
    args = ["logger=none", "+logger._target_=lit_ppl.runtime.files.write_text_atomic", f"+logger.path={target}"]
    with pytest.raises(ConfigError, match=r"logger._target_='lit_ppl.runtime.files.write_text_atomic' is not a"):
        evaluate(compose(*args, "+logger.text='import os'"))
    assert not target.exists() and not target.parent.exists()


@pytest.mark.parametrize("target", ["lit_ppl.data.store.os.system", "os.system", "lit_ppl.data.sources.DataSpec"])
def test_model_target_must_be_the_model_spec_itself(compose, tmp_path, target):
    marker = tmp_path / "ran"
    with pytest.raises(ConfigError, match=rf"model._target_='{target}' is not a lit_ppl class"):
        evaluate(compose(f"model._target_={target}", f"model.path='touch {marker}'"))
    assert not marker.exists()


def test_data_target_must_be_the_data_spec_itself(compose, tmp_path):
    keep = tmp_path / "keep"
    keep.mkdir()
    with pytest.raises(ConfigError, match=r"data._target_='lit_ppl.data.store.shutil.rmtree' is not a lit_ppl"):
        evaluate(compose("data._target_=lit_ppl.data.store.shutil.rmtree", f"data.path={keep}"))
    assert keep.is_dir()


def test_a_target_nested_anywhere_is_refused(compose):
    with pytest.raises(ConfigError, match=r"logger.save_dir._target_='os.system' is not a"):
        evaluate(compose("logger=csv", "+logger.save_dir._target_=os.system"))


def test_allowed_targets_still_build_under_any_import_path(compose, tmp_path):
    """The allow-list compares resolved classes: the logger's defining module names the same class."""
    r = evaluate(compose("logger=csv", "logger._target_=lightning.pytorch.loggers.csv_logs.CSVLogger"))
    assert r["ppl"] > 0 and (Path(r["config"]["output_dir"]) / "csv").is_dir()


def test_the_entry_check_reads_only_hydra_target_overrides():
    from lit_ppl.validate import hydra_target_override

    assert hydra_target_override(["hydra.run.dir=x", "model._target_=y", "hydra/launcher=slurm"]) is None
    assert hydra_target_override(["++hydra.launcher._target_=x"]) == "++hydra.launcher._target_=x"
    assert hydra_target_override(["+hydra.callbacks.a._target_=x", "allow_any_target=true"]) is None
