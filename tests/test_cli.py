"""`lit-ppl validate` (LightningCLI): the same config, the same numbers and results.json as the Hydra entry."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT, STORIES, TINYSTORIES, run
from omegaconf import OmegaConf

from lit_ppl.cli import PerplexityCLI, main, validate
from lit_ppl.run import evaluate
from lit_ppl.validate import conf_dir

STORIES_PPL = 6.8972206  # lm-evaluation-harness 0.4.13, rolling, seq_len 512 (see test_parity.py)


def cli_config(*args: str) -> dict:
    return OmegaConf.to_container(PerplexityCLI(list(args)).hydra_config)


def run_cli(args: list[str], tmp_path, cwd=None, timeout: float = 240):
    """``python -m lit_ppl.cli validate ARGS`` in a fresh process; return (completed process, results or None)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lit_ppl.cli", "validate", *args, "--output_dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run(cmd, timeout, cwd=cwd or tmp_path, env=env)
    results = out / "results.json"
    return proc, (json.loads(results.read_text()) if results.is_file() else None)


def test_flags_give_the_hydra_config(compose, tmp_path):
    """Each CLI group is its Hydra counterpart; unset keys take the Hydra group file's defaults."""
    cfg = cli_config(
        "--eval.mode=sliding",
        "--eval.seq_len=128",
        "--quant.name=int4",
        "--trainer.precision=bf16-mixed",
        "--batch_size=3",
        f"--data.cache_dir={tmp_path / 'cache'}",
        f"--output_dir={tmp_path / 'out'}",
    )
    ref = OmegaConf.to_container(
        compose("eval=sliding", "eval.seq_len=128", "quant=int4", "precision=bf16-mixed", "batch_size=3"), resolve=True
    )
    assert cfg.keys() == ref.keys()
    for key in ref.keys() - {"model", "data"}:  # every group and plain key of conf/validate.yaml
        assert cfg[key] == ref[key], key
    assert cfg["eval"]["stride"] == 256 and cfg["quant"]["group_size"] == 128  # from conf/eval|quant/*.yaml
    assert {k: v for k, v in cfg["model"].items() if k in ref["model"]} == ref["model"]
    assert {k: v for k, v in cfg["data"].items() if k in ref["data"]} == ref["data"]


@pytest.mark.parametrize(
    ("flags", "overrides"),
    [
        (["--logger=csv"], ["logger=csv"]),
        (["--logger=tensorboard", "--trainer.strategy=hsdp"], ["logger=tensorboard", "strategy=hsdp"]),
        (
            ["--trainer.strategy=fsdp_tp", "--trainer.devices=2", "--parallel.dp_shard=2", "--parallel.tp=1"],
            ["strategy=fsdp_tp", "trainer.devices=2", "parallel.dp_shard=2", "parallel.tp=1"],
        ),
        (
            ["--trainer.strategy=tp", "--parallel.tp_across_nodes=true"],
            ["strategy=tp", "parallel.tp_across_nodes=true"],
        ),
    ],
)
def test_logger_and_parallel_flags_give_the_hydra_config(compose, tmp_path, flags, overrides):
    """``--logger X`` is ``logger=X``; ``--trainer.strategy S`` takes ``strategy=S``'s layout, then ``--parallel.*``."""
    out, cache = f"--output_dir={tmp_path / 'out'}", f"--data.cache_dir={tmp_path / 'cache'}"
    cli = OmegaConf.to_container(PerplexityCLI([*flags, out, cache]).hydra_config, resolve=True)
    ref = OmegaConf.to_container(compose(*overrides), resolve=True)
    for key in ("logger", "strategy", "parallel", "trainer"):
        assert cli[key] == ref[key], key


@pytest.mark.parametrize(
    ("flags", "overrides"),
    [
        (["--quant.method=awq"], ["quant=awq"]),
        (
            ["--quant.method=awq", "--quant.name=int4", "--quant.calibration.grid=5"],
            ["quant=awq", "quant.name=int4", "quant.calibration.grid=5"],
        ),
        (["--quant.method=gptq", "--quant.calibration.tokens=4096"], ["quant=gptq", "quant.calibration.tokens=4096"]),
    ],
)
def test_calibrated_quant_flags_give_the_hydra_config(compose, tmp_path, flags, overrides):
    """``--quant.method=awq`` is ``quant=awq``: the method's file, calibration defaults included, under the flags."""
    cal = str(tmp_path / "calibration.txt")
    cache = f"{tmp_path / 'cache'}"
    cfg = cli_config(*flags, f"--quant.calibration.path={cal}", f"--data.cache_dir={cache}", "--output_dir=x")
    ref = compose(*overrides, f"quant.calibration.path={cal}", f"data.cache_dir={cache}")
    want = OmegaConf.to_container(ref, resolve=True)["quant"]
    got = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)["quant"]
    assert got == want


def test_calibration_options_are_the_quant_files_keys():
    """The CLI's ``--quant.calibration.*`` options are exactly the keys of ``conf/quant/awq.yaml``'s calibration."""
    from dataclasses import fields

    from lit_ppl.cli import CalibrationOptions
    from lit_ppl.config.quant import CalibrationConfig

    def calibration(preset: str) -> set[str]:
        return set(OmegaConf.load(Path(conf_dir()) / "quant" / f"{preset}.yaml").calibration)

    names = {f.name for f in fields(CalibrationOptions)}
    assert names == calibration("awq")
    assert names == {f.name for f in fields(CalibrationConfig)}
    assert calibration("gptq") == names - {"grid"}  # grid is AWQ's scale search


def test_config_file_then_flags(tmp_path):
    (tmp_path / "run.yaml").write_text("model:\n  path: builtin\n  seed: 3\neval:\n  seq_len: 64\nbatch_size: 2\n")
    cfg = cli_config("--config", str(tmp_path / "run.yaml"), "--eval.seq_len", "32", "--output_dir", "x")
    assert cfg["model"]["seed"] == 3 and cfg["eval"]["seq_len"] == 32 and cfg["batch_size"] == 2


def test_trainer_args_pass_through_and_owned_ones_refuse():
    cfg = cli_config("--trainer.log_every_n_steps=5", "--trainer.strategy=ddp", "--trainer.devices=2", "--output_dir=x")
    assert cfg["trainer"] == {"accelerator": "auto", "devices": 2, "num_nodes": 1, "log_every_n_steps": 5}
    # A partial evaluation is refused by the schema, as under python -m lit_ppl.validate (tests/test_hostile.py).
    with pytest.raises(ValueError, match=re.escape("trainer.limit_val_batches=2 would score part of the corpus")):
        cli_config("--trainer.limit_val_batches=2")
    assert cfg["strategy"] == {"name": "ddp"}
    with pytest.raises(ValueError, match=re.escape("--trainer.strategy='deepspeed' is not one of auto, ddp")):
        cli_config("--trainer.strategy=deepspeed")
    with pytest.raises(ValueError, match=re.escape("--trainer.use_distributed_sampler is set")):
        cli_config("--trainer.use_distributed_sampler=false")


def test_builtin_in_process_equals_hydra(compose, tmp_path):
    r = validate(["--eval.seq_len=64", f"--data.cache_dir={tmp_path / 'cache'}", f"--output_dir={tmp_path / 'cli'}"])
    ref = evaluate(compose("eval.seq_len=64"))
    saved = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert saved["ppl"] == r["ppl"] == pytest.approx(ref["ppl"], rel=1e-12, abs=0)
    assert r["tokens"] == ref["tokens"] and r["nll_sum"] == pytest.approx(ref["nll_sum"], rel=1e-12)
    assert saved.keys() == ref.keys()


def test_stories_in_process_equals_hydra(compose, stories, tmp_path):
    args = [f"--model.path={stories}", f"--data.path={TINYSTORIES}", "--eval.seq_len=512"]
    r = validate([*args, f"--data.cache_dir={tmp_path / 'cache'}", f"--output_dir={tmp_path / 'cli'}"])
    ref = evaluate(compose(f"model.path={stories}", f"data.path={TINYSTORIES}", "eval.seq_len=512"))
    assert r["ppl"] == pytest.approx(STORIES_PPL, rel=2e-5)
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=1e-9, abs=0) and r["tokens"] == ref["tokens"] == 1882


@pytest.mark.slow
def test_example_config_subprocess_equals_hydra(compose, stories, tmp_path):
    """The shipped example config, run from the repo root as the README says, as a separate process."""
    proc, r = run_cli(
        ["--config", "configs/cli/stories260k.yaml", f"--data.cache_dir={tmp_path / 'cache'}"], tmp_path, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = evaluate(compose(f"model.path={STORIES}", f"data.path={TINYSTORIES}", "eval.seq_len=512"))
    assert r["ppl"] == pytest.approx(STORIES_PPL, rel=2e-5)
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=1e-9, abs=0)
    assert r["config"]["model"]["path"] == "../shared/data/stories260K" and "token perplexity" in proc.stdout


@pytest.mark.slow
def test_builtin_subprocess_equals_hydra(compose, tmp_path):
    proc, r = run_cli(["--eval.seq_len=64", f"--data.cache_dir={tmp_path / 'cache'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["ppl"] == pytest.approx(evaluate(compose("eval.seq_len=64"))["ppl"], rel=1e-12, abs=0)


@pytest.mark.slow
def test_bad_input_is_one_line(tmp_path):
    proc, r = run_cli(["--eval.seq_len=64", "--eval.mode=block", "--model.path=/nonexistent/ckpt"], tmp_path)
    assert proc.returncode == 1 and r is None
    assert "lit-ppl: error: model.path='/nonexistent/ckpt' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc, r = run_cli(["--eval.mode=zigzag"], tmp_path)
    assert proc.returncode == 2 and r is None and "eval.mode" in proc.stderr


def test_usage_without_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2 and "usage: lit-ppl {validate}" in capsys.readouterr().out


@pytest.mark.slow
def test_ddp_ranks_relaunched_by_lightning_agree_on_the_default_output_dir(compose, tmp_path):
    """Lightning re-runs the command line for rank 1; without --output_dir both ranks must pick the same dir."""
    cmd = [sys.executable, "-m", "lit_ppl.cli", "validate", "--eval.seq_len=64", f"--data.cache_dir={tmp_path / 'c'}"]
    cmd += ["--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LIT_PPL_OUTPUT_DIR", None)
    proc = run(cmd, 240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs" / "cli").glob("*/*"))
    assert len(runs) == 1, runs
    r = json.loads((runs[0] / "results.json").read_text())
    assert r["world_size"] == 2 and r["ppl"] == pytest.approx(evaluate(compose("eval.seq_len=64"))["ppl"], rel=1e-6)
