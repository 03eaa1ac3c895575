"""In-process runs of the Hydra config: compose the overrides as ``python -m lit_ppl.validate`` would, evaluate;
and sweeps of several jobs on one torchrun launch of ranks."""

from __future__ import annotations

import json
import os
import subprocess
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
    _torchrun([*args, f"hydra.sweep.dir={sweep}"], ranks, sweep.parent, timeout)
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"), key=lambda p: int(p.parent.name))]


# Config groups of conf/: ``strategy=fsdp`` in a case is a defaults override, ``eval.seq_len=77`` a value.
GROUPS = ("model", "data", "eval", "trainer", "strategy", "quant", "compare", "logger")


def cases_sweep(root: Path, cases: dict[str, list[str]]) -> list[str]:
    """Overrides that make one ``-m`` sweep run ``cases`` (name -> that job's own overrides), each writing its
    ``results.json`` to ``root/NAME``: a Hydra sweep is a cartesian product, so each case becomes a config of a
    group ``case`` on a search path of its own (Hydra's "experiment" pattern) and the sweep is ``+case=A,B,...``.
    A key given on the command line beside them wins over every case's: a key that varies goes in the cases only."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()  # values as the command line would read them: 32-true, [1.0,0.3], {store:'d'}
    for name, overrides in cases.items():
        defaults, values = [], {"output_dir": str(root / name)}
        for override in parser.parse_overrides(overrides):
            key, value = override.key_or_group, override.value()
            if key in GROUPS:
                defaults.append({f"override /{key}": value})
                continue
            *parents, leaf = key.split(".")
            node = values
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        path = root / "conf" / "case" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# @package _global_\n" + yaml.safe_dump({"defaults": [*defaults, "_self_"], **values}))
    return [f"hydra.searchpath=[file://{root / 'conf'}]", f"+case={','.join(cases)}"]


def torchrun_cases(
    args: list[str], cases: dict[str, list[str]], ranks: int, root: Path, timeout: float = 900
) -> dict[str, dict]:
    """:func:`torchrun_sweep` of different jobs (``cases``: name -> its overrides beside ``args``) on one launch of
    ``ranks`` processes; each job's results by name."""
    proc = _torchrun([*args, *cases_sweep(root, cases), f"hydra.sweep.dir={root / 'sweep'}"], ranks, root, timeout)
    missing = [name for name in cases if not (root / name / "results.json").is_file()]
    assert not missing, (missing, proc.stderr[-3000:])  # a failed job fails alone: the sweep goes on
    return {name: json.loads((root / name / "results.json").read_text()) for name in cases}


def _torchrun(args: list[str], ranks: int, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    from conftest import ROOT, run

    from helpers.nodes import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "-m", "lit_ppl.validate", "-m", *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    cwd.mkdir(parents=True, exist_ok=True)
    proc = run(cmd, timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
