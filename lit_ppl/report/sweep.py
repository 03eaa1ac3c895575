"""Hydra sweeps: one summary table (Markdown and CSV) of all the runs of a ``-m`` sweep, and the quantization
frontier of the jobs that compared (:mod:`lit_ppl.report.frontier`).

::

    python -m lit_ppl.validate -m quant=none,int8 precision=32-true,bf16-mixed
    python -m lit_ppl.validate -m hydra/launcher=submitit_slurm quant=none,int8     # each run a Slurm job

:class:`SweepSummary` is registered under ``hydra.callbacks`` in ``conf/validate.yaml``. When the sweep ends it
reads each job's ``results.json`` and its ``.hydra/overrides.yaml`` and writes ``summary.md`` and ``summary.csv``
into the sweep directory: one row per job, a column per override that varies across the jobs, then the
headline numbers. Reading the files (rather than collecting return values in-process) works the same for the
basic launcher and for launchers whose jobs run elsewhere (submitit/Slurm), given a shared file system.

It also makes DDP work inside a local sweep: Lightning relaunches the other ranks of a run by re-running the
command line with ``hydra.run.dir`` set to the parent's run dir, which in a sweep would re-run the whole sweep
in a directory no job uses. While a job of an in-process sweep runs, the callback points ``hydra.run.dir`` at
the job's own directory and narrows ``sys.argv`` to the job's own overrides.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from lit_ppl.report.tables import markdown_table, to_csv
from lit_ppl.runtime.files import write_text_atomic

METRICS = ("ppl", "nll_stderr", "tokens", "precision", "quant", "world_size", "tokens_per_s")
MULTIRUN_FLAGS = ("-m", "--multirun")


def _natural_key(path: Path) -> list[Any]:
    """Sort job dirs 0, 1, ..., 10 (not 0, 1, 10, 2)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def _is_override(arg: str) -> bool:
    """Whether a command-line argument is a Hydra override (``key=value``, ``+key=v``, ``~key``), not a flag."""
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


def _split_override(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def find_jobs(sweep_dir: Path, output_subdir: str | None = ".hydra") -> list[Path]:
    """The job directories of a sweep: those holding Hydra's saved overrides or a ``results.json``."""
    dirs = {p.parent for p in sweep_dir.rglob("results.json")}
    if output_subdir:
        dirs |= {p.parent.parent for p in sweep_dir.rglob(f"{output_subdir}/overrides.yaml")}
    return sorted(dirs, key=lambda d: _natural_key(d.relative_to(sweep_dir)))


def _job_overrides(job_dir: Path, output_subdir: str | None) -> dict[str, str]:
    path = job_dir / output_subdir / "overrides.yaml" if output_subdir else None
    if path is None or not path.is_file():
        return {}
    return dict(_split_override(o) for o in OmegaConf.load(path))


def results_path(job_dir: Path, output_subdir: str | None) -> Path:
    """``results.json`` of a job: in its directory, or where its config's literal ``output_dir`` points."""
    path = job_dir / "results.json"
    saved = job_dir / output_subdir / "config.yaml" if output_subdir else None
    if not path.is_file() and saved is not None and saved.is_file():
        output_dir = OmegaConf.load(saved).get("output_dir")
        if isinstance(output_dir, str) and "${" not in output_dir:
            return Path(output_dir) / "results.json"
    return path


def summarize(sweep_dir: str | Path, output_subdir: str | None = ".hydra") -> list[dict[str, Any]]:
    """One row per job of the sweep in ``sweep_dir``: the overrides that vary, then the headline numbers.

    A job without ``results.json`` (it failed, or is still running) gets a row with empty numbers and its
    ``status``; a sweep with a comparison (``compare=...``) also gets the mean KL divergence.
    """
    sweep_dir = Path(sweep_dir)
    jobs = []
    for job_dir in find_jobs(sweep_dir, output_subdir):
        path = results_path(job_dir, output_subdir)
        results = json.loads(path.read_text()) if path.is_file() else None
        jobs.append((job_dir, _job_overrides(job_dir, output_subdir), results))
    keys = list(dict.fromkeys(k for _, overrides, _ in jobs for k in overrides))
    varying = [k for k in keys if len({overrides.get(k) for _, overrides, _ in jobs}) > 1] or keys
    with_kld = any(r and r.get("compare") for _, _, r in jobs)
    rows = []
    for job_dir, overrides, results in jobs:
        row: dict[str, Any] = {"job": job_dir.relative_to(sweep_dir).as_posix()}
        row.update({k: overrides.get(k, "") for k in varying})
        r = results or {}
        quant = r.get("quant")
        # A metric named like a varying override (quant, precision) is already in that override's column.
        row.update({m: r.get(m, "") for m in METRICS if m not in row})
        if "quant" not in varying:
            row["quant"] = (quant or {}).get("name", "none") if results else ""
        if with_kld:
            row["kld_mean"] = (r.get("compare") or {}).get("kld_mean", "")
        row["status"] = "ok" if results else "no results.json"
        rows.append(row)
    return rows


def _fmt(key: str, value: Any) -> str:
    """Markdown cell text: fixed decimals for the metrics, the rest as is."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:,.0f}" if key == "tokens_per_s" else f"{value:.6f}"
    if isinstance(value, int) and not isinstance(value, bool) and key == "tokens":
        return f"{value:,}"
    return str(value)


def sweep_markdown(rows: list[dict[str, Any]]) -> str:
    """A GitHub-flavoured Markdown table of ``rows``, headed by their keys (numbers right-aligned)."""
    if not rows:
        return "(no jobs)\n"
    cols = list(rows[0])
    numeric = {c for c in cols if all(isinstance(r[c], int | float) and not isinstance(r[c], bool) for r in rows)}
    return markdown_table([(c, c) for c in cols], [{c: _fmt(c, r[c]) for c in cols} for r in rows], numeric)


def write_summary(sweep_dir: str | Path, output_subdir: str | None = ".hydra") -> tuple[Path, Path, str]:
    """Write ``summary.md`` and ``summary.csv`` into ``sweep_dir``; return their paths and the Markdown."""
    sweep_dir = Path(sweep_dir)
    rows = summarize(sweep_dir, output_subdir)
    markdown = sweep_markdown(rows)
    md, csv_path = sweep_dir / "summary.md", sweep_dir / "summary.csv"
    write_text_atomic(md, markdown)
    # No jobs, no columns: an empty file rather than report's full column set.
    to_csv(rows, csv_path, fields=list(rows[0]) if rows else [])
    return md, csv_path, markdown


def launched_externally() -> bool:
    """Whether a launcher that keeps the ranks for every job (torchrun, srun, ...) started this process: the
    cluster environments Lightning's Trainer detects before falling back to launching ranks of its own."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    with warnings.catch_warnings():  # "srun is available but not used": the Trainer says so itself if it matters
        warnings.simplefilter("ignore")
        return any(env.detect() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment))


class SweepSummary(Callback):
    """Hydra callback: the sweep's summary table at the end of a multirun; DDP-safe job dirs during it."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._saved: tuple[dict[str, str], int, list[str], bool] | None = None

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        import torch

        hydra_cfg = HydraConfig.instance().cfg
        with read_write(hydra_cfg.hydra.run), open_dict(hydra_cfg.hydra.run):
            # What ${hydra:run.dir} and Lightning's relaunched ranks see: this job's directory.
            hydra_cfg.hydra.run.dir = config.hydra.runtime.output_dir
        # Lightning's launcher leaves LOCAL_RANK, WORLD_SIZE, MASTER_PORT, OMP_NUM_THREADS ... in os.environ and
        # the process group open; the next job of an in-process sweep would take them as its own (and, seeing
        # LOCAL_RANK, launch no ranks). Each job starts from the state the sweep started with.
        self._saved = (dict(os.environ), torch.get_num_threads(), list(sys.argv), launched_externally())
        # sys.argv is the sweep's only when the jobs run in this process (the basic launcher).
        if set(MULTIRUN_FLAGS) & set(sys.argv[1:]):
            flags = [a for a in sys.argv[1:] if a not in MULTIRUN_FLAGS and not _is_override(a)]
            sys.argv = [sys.argv[0], *flags, *config.hydra.overrides.task]

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        # The table so far after every job: a sweep that stops early (a failed job) still leaves one.
        if self.enabled:
            write_summary(config.hydra.sweep.dir, config.hydra.output_subdir)
        if self._saved is None:
            return
        import torch

        env, threads, argv, external = self._saved
        # Ranks started by torchrun or srun run every job: their process group serves them all (Lightning reuses
        # an initialized one). Re-initialising it hung: torchrun's store still held the first rendezvous' keys.
        # Ranks Lightning launched for this job exit with it: the next job needs a group of its own.
        if not external and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            # The finished job's trainer and module sit in reference cycles that still hold its process groups,
            # and through them its rendezvous store. With MASTER_PORT fixed by the user the next job's ranks then
            # met stale state on that port (measured: 3 sweeps in 3 failed to connect or hung); collected, none did.
            gc.collect()
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
        sys.argv, self._saved = argv, None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.enabled:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        md, csv_path, markdown = write_summary(sweep_dir, config.hydra.output_subdir)
        print(f"\nsweep summary ({sweep_dir}):\n\n{markdown}\nsummary: {md} · {csv_path}")
        from lit_ppl.report.frontier import FrontierError, write_frontier

        try:  # jobs that compared quantizations: the frontier of bytes against KLD
            svg, frontier_md, _ = write_frontier(sweep_dir, config.hydra.output_subdir)
            print(f"frontier: {svg} · {frontier_md}")
        except FrontierError:
            pass  # no job with a comparison: a sweep of something else
