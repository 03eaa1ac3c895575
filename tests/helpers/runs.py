"""In-process runs of the Hydra config: compose the overrides as ``python -m lit_ppl.validate`` would, evaluate;
and sweeps of several jobs on one torchrun launch of ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def stories_overrides(docs: Path, cache: Path, *extra: str) -> list[str]:
    """The real tiny model (stories260K) on the text file ``docs`` at seq_len 64, on the CPU, without plots."""
    from conftest import STORIES

    return [
        "model=hf",
        f"model.path={STORIES}",
        "data=text",
        f"data.path={docs}",
        f"data.cache_dir={cache}",
        "eval.seq_len=64",
        "batch_size=3",
        "report.plots=false",
        "trainer.accelerator=cpu",
        *extra,
    ]


def evaluate_overrides(overrides: list[str], output_dir: Path) -> dict[str, Any]:
    """``results.json``'s content of one run in this process (the single-process reference of a multi-rank test)."""
    from hydra import compose, initialize_config_dir

    from lit_ppl.run import evaluate
    from lit_ppl.validate import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose("validate", overrides=[*overrides, f"output_dir={output_dir}"])
    return evaluate(cfg)


def torchrun_sweep(args: list[str], ranks: int, sweep: Path, timeout: float = 900) -> list[dict]:
    """``python -m lit_ppl.validate -m ARGS`` under ``torchrun --nproc_per_node ranks``: the same ranks run every
    job, which costs its evaluation, not ``ranks`` interpreters' start-up. Each job's results, in sweep order."""
    from conftest import ROOT, run

    from helpers.nodes import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "-m", "lit_ppl.validate", "-m", *args, f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    sweep.parent.mkdir(parents=True, exist_ok=True)
    proc = run(cmd, timeout, cwd=sweep.parent, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"), key=lambda p: int(p.parent.name))]
