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
    """Exit 2 with one line naming ``key`` and the command-line switch, before anything ran."""
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
    _refused_by_the_entry(proc, "hydra.callbacks.evil._target_='builtins.open' is not a Hydra callback class")
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


# --- The composed config, the hydra node included: every route by which a config reaches a callable, a file or the
# environment, checked where Hydra's composer returns (lit_ppl.config.guard), as the entry runs it.

SITE = "sitecustomize.py"


@pytest.fixture
def guarded(tmp_path):
    """Compose like the entry (the guard in Hydra's composer), the hydra node included, with a search path in
    ``tmp_path/sp`` for the files a test writes there."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lit_ppl.config.guard import guarded_composition
    from lit_ppl.validate import conf_dir

    searchpath = tmp_path / "sp"
    searchpath.mkdir()

    def _compose(*overrides: str, files: dict[str, str] | None = None):
        for name, text in (files or {}).items():
            (searchpath / name).parent.mkdir(parents=True, exist_ok=True)
            (searchpath / name).write_text(text)
        args = [f"hydra.searchpath=[file://{searchpath}]", f"output_dir={tmp_path / 'out'}", *overrides]
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"), guarded_composition():
            return hydra_compose("validate", overrides=args, return_hydra_config=True)

    return _compose


EVIL = "{_target_:lit_ppl.runtime.files.write_text_atomic,path:/tmp/x/" + SITE + ",text:'import os'}"
# (overrides, files on the search path, what the one line says)
ROUTES = {
    "callback as a dict value": ([f"+hydra.callbacks.pwn={EVIL}"], {}, "hydra.callbacks.pwn._target_="),
    "callback as a key": (["+hydra.callbacks.pwn._target_=builtins.open"], {}, "not a Hydra callback class"),
    "callback interpolating a node": (["+hydra.callbacks.pwn=${model}"], {}, "'lit_ppl.model.spec.ModelSpec' is not"),
    "callback from oc.create": (
        ["+hydra=pwn"],
        {"hydra/pwn.yaml": "# @package hydra\ncallbacks:\n  pwn: \"${oc.create:'{_target_: os.system}'}\"\n"},
        "hydra.callbacks.pwn._target_='os.system'",
    ),
    "callback target unresolvable": (["+hydra.callbacks.pwn._target_=${oc.env:LIT_PPL_NO_SUCH}"], {}, "pwn._target_"),
    "a target nested in an allowed callback": (
        ["+hydra.callbacks.sweep_summary.enabled={_target_:os.system,command:id}"],
        {},
        "hydra.callbacks.sweep_summary.enabled._target_='os.system'",
    ),
    "a target in a list": (["+hydra.callbacks.pwn.args=[{_target_:os.system}]"], {}, "pwn.args[0]._target_"),
    "launcher": (["hydra.launcher._target_=os.system"], {}, "not a Hydra launcher class"),
    "launcher from a file": (
        ["hydra/launcher=pwn"],
        {"hydra/launcher/pwn.yaml": "_target_: lit_ppl.runtime.files.write_text_atomic\n"},
        "hydra.launcher._target_=",
    ),
    "sweeper": (["hydra.sweeper._target_=builtins.exec"], {}, "not a Hydra sweeper class"),
    "job_logging file with a factory (the issue's)": (
        ["hydra/job_logging=pwn"],
        {
            "hydra/job_logging/pwn.yaml": "version: 1\nhandlers:\n  h:\n"
            f"    (): lit_ppl.runtime.files.write_text_atomic\n    path: /tmp/x/{SITE}\n    text: import os\n"
            "root:\n  handlers: [h]\n"
        },
        "hydra.job_logging.handlers.h.()=",
    ),
    "a handler's class": (["hydra.job_logging.handlers.console.class=os.system"], {}, "allowed: logging.StreamHandler"),
    "a formatter's class": (["+hydra.job_logging.formatters.simple.class=os.system"], {}, "allowed: logging.Formatter"),
    "a filter's factory": (
        ["hydra/job_logging=pwn"],
        {"hydra/job_logging/pwn.yaml": "version: 1\nfilters:\n  f:\n    (): os.system\n"},
        "hydra.job_logging.filters.f.()='os.system'",
    ),
    "an attribute setter": (
        ["hydra/job_logging=pwn"],
        {"hydra/job_logging/pwn.yaml": "version: 1\nhandlers:\n  h:\n    class: logging.NullHandler\n    .: {a: 1}\n"},
        "hydra.job_logging.handlers.h..=",
    ),
    "an ext:// object": (["hydra.job_logging.handlers.console.stream=ext://os.system"], {}, "ext://sys.stdout"),
    "a log file outside the run directory": (
        ["hydra.job_logging.handlers.file.filename=/tmp/x/evil.pth"],
        {},
        "a log file must be a *.log file directly in the run directory",
    ),
    "a log file through a job name": (["hydra.job.name=../../x"], {}, "handlers.file.filename="),
    "hydra_logging": (["hydra/hydra_logging=hydra_debug"], {}, "hydra.hydra_logging.handlers.file.filename="),
    "a loader variable": (["+hydra.job.env_set.LD_PRELOAD=/tmp/x.so"], {}, "LD_PRELOAD makes the run"),
    "an interpreter path": (["+hydra.job.env_set.PYTHONPATH=/tmp/x"], {}, "hydra.job.env_set.PYTHONPATH="),
    "Hydra's files outside the run directory": (["hydra.output_subdir=/tmp/x"], {}, "hydra.output_subdir='/tmp/x'"),
    "Hydra's files above it": (["hydra.output_subdir=../../x"], {}, "without '..'"),
    "a sweep job above the sweep": (["hydra.sweep.subdir=../x"], {}, "hydra.sweep.subdir='../x'"),
    "the filesystem root": (["hydra.run.dir=/"], {}, "is a filesystem root"),
    "a system directory": (["hydra.sweep.dir=/etc/lit"], {}, "is a system directory"),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_to_a_callable_file_or_variable_is_refused(guarded, route):
    overrides, files, message = ROUTES[route]
    with pytest.raises(ConfigError) as err:
        guarded(*overrides, files=files)
    line = str(err.value)
    assert "\n" not in line and (message is None or message in line), line


def test_what_lit_ppl_and_hydra_ship_passes(guarded):
    """Hydra's own logging presets, lit-ppl's launcher preset and its sweep callback, a harmless variable."""
    for overrides in (
        [],
        ["hydra/launcher=slurm"],
        ["hydra/job_logging=stdout", "hydra/hydra_logging=none"],
        ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"],
        ["+hydra.job.env_set.TOKENIZERS_PARALLELISM=false", "hydra.job_logging.root.level=DEBUG"],
        ["hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/mine.log"],
    ):
        cfg = guarded(*overrides)
        assert cfg.hydra.callbacks.sweep_summary._target_ == "lit_ppl.report.sweep.SweepSummary"


def test_allow_any_target_counts_on_the_command_line_only(guarded, tmp_path):
    from omegaconf import OmegaConf

    from lit_ppl.config.guard import check_composed

    cfg = guarded("+hydra.callbacks.mine._target_=helpers.peak.PeakPerJob", "allow_any_target=true")
    assert cfg.hydra.callbacks.mine._target_ == "helpers.peak.PeakPerJob"
    # The same config with the switch from a file (a primary config of the user's, say) is refused.
    with pytest.raises(ConfigError, match="allow_any_target=true comes from a config file, not the command line"):
        check_composed(cfg, [o for o in OmegaConf.to_container(cfg.hydra.overrides.task) if "allow_any" not in o])
    # What it never lifts: where the results go.
    with pytest.raises(ConfigError, match="is a filesystem root"):
        guarded("hydra.run.dir=/", "allow_any_target=true")


def test_each_sweep_job_is_checked_before_hydra_uses_its_logging(guarded):
    """A sweep job composes its own config (a group option from the search path may bring hydra.job_logging)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from lit_ppl.config.guard import guarded_composition
    from lit_ppl.validate import conf_dir

    bad = "# @package _global_\nhydra:\n  job_logging:\n    handlers:\n      console:\n        (): os.system\n"
    master = guarded("quant=none", files={"quant/pwn.yaml": bad})
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"), guarded_composition():
        loader = GlobalHydra.instance().config_loader()
        hydra_overrides = list(master.hydra.overrides.hydra)
        assert loader.load_configuration("validate", [*hydra_overrides, "quant=int8"], RunMode.RUN)
        master.hydra.job.config_name = "validate"
        with pytest.raises(ConfigError, match=r"hydra.job_logging.handlers.console.\(\)='os.system'"):
            loader.load_sweep_config(master, ["quant=pwn"])


def _untouched(tmp_path: Path) -> tuple[Path, Path]:
    victim = tmp_path / "site" / SITE
    return victim, tmp_path / "run"


def test_the_issues_reproductions_end_to_end(tmp_path):
    """The two reproductions of issue 34 (also through ``lit_ppl.fetch``), and Hydra's pickle flag: one line, exit 2,
    no file written."""
    searchpath = tmp_path / "sp" / "hydra" / "job_logging"
    searchpath.mkdir(parents=True)
    victim = tmp_path / "site" / SITE
    factory = f"    (): lit_ppl.runtime.files.write_text_atomic\n    path: {victim}\n    text: import os\n"
    (searchpath / "pwn.yaml").write_text(f"version: 1\nhandlers:\n  h:\n{factory}root:\n  handlers: [h]\n")
    value = "{_target_:lit_ppl.runtime.files.write_text_atomic,path:" + str(victim) + ",text:'import os'}"
    for args, key in (
        ([f"+hydra.callbacks.pwn={value}"], "hydra.callbacks.pwn._target_='lit_ppl.runtime.files.write_text_atomic'"),
        ([f"hydra.searchpath=[file://{tmp_path / 'sp'}]", "hydra/job_logging=pwn"], "hydra.job_logging.handlers.h.()"),
    ):
        proc, results = run_entry(["model=builtin", *args], tmp_path / "run")
        _refused_by_the_entry(proc, key)
        assert results is None and not victim.exists() and not (tmp_path / "run" / "out").exists()
    proc, _ = run_entry([f"+hydra.callbacks.pwn={value}"], tmp_path / "fetch", module="lit_ppl.fetch")
    _refused_by_the_entry(proc, "hydra.callbacks.pwn._target_=")  # the other Hydra entry, the same guard
    assert not victim.exists()
    proc, _ = run_entry(["--experimental-rerun", str(tmp_path / "x.pickle")], tmp_path / "rerun")
    assert proc.returncode == 2 and "--experimental-rerun unpickles a file" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_refused_run_leaves_the_directory_as_it_was(tmp_path):
    """A second run into a busy output_dir once had Hydra rewrite the first run's .hydra/ files before lit-ppl's
    lock refused it; now Hydra's copies are written once the run holds the lock. hydra.job.chdir=true no longer
    nests the results of a relative output_dir."""
    from lit_ppl.runtime.lock import run_lock

    proc, _ = run_entry(["hydra.job.chdir=true", "output_dir=rel", "hydra.run.dir=rel"], tmp_path)
    assert proc.returncode == 0 and (tmp_path / "rel" / "results.json").is_file(), proc.stderr[-2000:]
    assert not (tmp_path / "rel" / "rel").exists()
    out = tmp_path / "out"
    proc, first = run_entry(["seed=1"], tmp_path)
    assert proc.returncode == 0 and first is not None, proc.stderr[-2000:]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    assert {p.name for p in before} >= {"config.yaml", "hydra.yaml", "overrides.yaml", "results.json"}
    with run_lock(out, True):  # a live run (this test) holds it
        proc, _ = run_entry(["seed=2"], tmp_path)
    assert proc.returncode == 1 and "is in use by another run" in proc.stderr, proc.stderr[-2000:]
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert "seed=1" in (out / ".hydra" / "overrides.yaml").read_text()
