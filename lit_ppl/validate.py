"""Evaluate a causal LM's perplexity: compose the Hydra config, build the objects, validate, report.

Single process (the offline default: a built-in random model on a text shipped with the package)::

    python -m lit_ppl.validate
    python -m lit_ppl.validate model.path=/ckpt/llama-3-8b data=wikitext2 precision=bf16-true

Several processes on one machine (Lightning launches them)::

    python -m lit_ppl.validate strategy=ddp trainer.devices=4

Several nodes (torchrun on each node, or srun: see slurm/)::

    torchrun --nnodes 2 --node_rank K --nproc_per_node 8 --master_addr HOST --master_port 29500 \\
        --rdzv-conf timeout=120 -m lit_ppl.validate strategy=fsdp trainer.num_nodes=2 trainer.devices=8
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig

from lit_ppl import config  # registers the schema (base_validate) that conf/validate.yaml starts from
from lit_ppl.config.guard import guarded_composition
from lit_ppl.errors import EXIT_CONFIG, Preempted, input_error
from lit_ppl.report.results import DEFER_HYDRA_FILES
from lit_ppl.runtime.signals import install_signal_handlers, requeue_if_slurm

# entry() sets HYDRA_FULL_ERROR so that composition errors reach it as exceptions; this marks that it did (ranks
# that Lightning relaunches inherit both), as opposed to a user asking for Hydra's full traces.
_OWN_FULL_ERROR = "LIT_PPL_OWNS_HYDRA_FULL_ERROR"
# Hydra's flag that unpickles a saved job: a pickle is code, whoever wrote the file.
REFUSED_FLAGS = ("--experimental-rerun",)


def conf_dir() -> str:
    """The Hydra config tree: ``conf/`` in a source checkout, ``lit_ppl/conf`` once installed."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "validate.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no conf/validate.yaml next to {here}; reinstall lit-ppl")


def _fail(message: str, code: int) -> None:
    print(message, file=sys.stderr)
    # In a -m sweep, sys.exit would end the whole sweep: fail this job only (the summary marks it).
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise RuntimeError(message)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="validate")
def main(cfg: DictConfig) -> None:
    try:
        config.check(cfg)  # what composition could not check, before anything is imported or loaded
    except config.ConfigError as err:
        _fail(f"lit-ppl: error: {err}", EXIT_CONFIG)
    if HydraConfig.initialized():  # (lit_ppl.cli calls this function with a config of its own)
        # Relative paths (data.path, output_dir, ...) mean what they meant where the run was started, whether or
        # not hydra.job.chdir=true moved into the run directory.
        os.chdir(HydraConfig.get().runtime.cwd)
        _with_sweep_dir(cfg)
    install_signal_handlers()
    # Imported here: composing the config (--help, --cfg job) needs neither torch nor Lightning, and the checks
    # before any weight loads need no Lightning: a bad input is one line in seconds, not after Lightning's import.
    from lit_ppl.preflight import preflight

    try:
        plan = preflight(cfg)
        from lit_ppl.run import evaluate

        evaluate(cfg, plan)
    except Exception as err:
        if isinstance(err, Preempted):
            requeue_if_slurm()
        found = input_error(err)
        if found is None:  # a failed peer or a bug: its line (and a bug's traceback) from the run's own rules
            from lit_ppl.run import exit_for

            found = exit_for(err)
        _fail(*found)


def _with_sweep_dir(cfg: DictConfig) -> None:
    """A job of a ``-m`` sweep: ``quant.sweep_dir`` (unless given), where ``quant=auto`` looks for a sibling job's
    sensitivity table (:mod:`lit_ppl.quant.auto.reuse`). Ranks Lightning relaunches run a single job: rank 0's
    choice reaches them."""
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN and cfg.quant.get("sweep_dir") is None:
        cfg.quant.sweep_dir = str(Path(hydra.runtime.cwd, hydra.sweep.dir).absolute())


def _reraise(err: BaseException) -> NoReturn:
    raise err


def with_run_dir(argv: list[str]) -> list[str]:
    """``output_dir=X`` given without ``hydra.run.dir``: Hydra's own files go to X too, not to ``outputs/DATE/TIME``
    under the working directory (which may be read-only, or shared by many jobs). In a single run, Hydra's copies of
    the config wait until the run holds the directory's lock (:data:`DEFER_HYDRA_FILES`)."""
    keys = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    if "-m" in argv or "--multirun" in argv:
        return argv
    deferred = [] if "hydra.output_subdir" in keys else [DEFER_HYDRA_FILES]
    given = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+") == "output_dir"]
    run_dir = [f"hydra.run.dir={given[-1]}"] if given and "hydra.run.dir" not in keys else []
    # Beside the given overrides: argparse takes the overrides as one run of arguments, before or after the flags.
    at = next((i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), len(argv))
    return [*argv[:at], *run_dir, *deferred, *argv[at:]]


def entry(hydra_main: Callable[[], Any] = main) -> None:
    """``python -m lit_ppl.validate`` (and ``lit_ppl.fetch``): ``hydra_main``, with every config Hydra composes checked
    first (:mod:`lit_ppl.config.guard`), and composition errors (an unknown key, a value of the wrong type, a missing
    group option) on one line instead of Hydra's several lines and traceback hint."""
    if any(a.split("=", 1)[0] in REFUSED_FLAGS for a in sys.argv[1:]):
        print(
            f"lit-ppl: error: {', '.join(REFUSED_FLAGS)} unpickles a file (code, not a config): not supported",
            file=sys.stderr,
        )
        sys.exit(EXIT_CONFIG)
    sys.argv[1:] = with_run_dir(sys.argv[1:])
    if os.environ.get("HYDRA_FULL_ERROR") and not os.environ.get(_OWN_FULL_ERROR):
        with guarded_composition():
            hydra_main()  # the user asked for Hydra's full traces
        return
    os.environ["HYDRA_FULL_ERROR"] = os.environ[_OWN_FULL_ERROR] = "1"
    try:
        with guarded_composition():
            hydra_main()
    except config.ConfigError as err:
        print(f"lit-ppl: error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except (ConfigCompositionException, OverrideParseException, yaml.YAMLError) as err:  # YAML: a file's syntax
        print(f"lit-ppl: error: {config.error_line(err)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except OSError as err:  # the task reports its own errors: this is Hydra creating or writing the run directory
        where = f"{err.filename}: " if err.filename else ""
        print(
            f"lit-ppl: error: {where}{err.strerror or err} (Hydra's run directory: give a writable output_dir)",
            file=sys.stderr,
        )
        sys.exit(1)
    except Exception as err:
        _hydra_report(err)


def _hydra_report(err: Exception) -> NoReturn:
    """Report ``err`` (raised by the task) as Hydra does without HYDRA_FULL_ERROR: its traceback from the task
    function down, then exit 1."""
    from hydra._internal.utils import run_and_report

    # Hydra prints from the frame after its run_job, searching the first 10 frames of the traceback: start the
    # traceback where Hydra's own run_and_report called into the run, as if this wrapper were not there.
    tb, start = err.__traceback__, None
    while tb is not None and tb.tb_frame.f_code.co_name != "run_job":
        if tb.tb_frame.f_code.co_name == "run_and_report":
            start = tb.tb_next
        tb = tb.tb_next
    del os.environ["HYDRA_FULL_ERROR"]
    run_and_report(lambda: _reraise(err.with_traceback(start) if start is not None else err))
    sys.exit(1)  # run_and_report exits itself; this line only tells type checkers so


if __name__ == "__main__":
    entry()
