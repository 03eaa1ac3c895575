"""The Hydra entry end to end: composed in-process, and as `python -m lit_ppl.validate`."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_entry

from lit_ppl.report.summary import per_rank
from lit_ppl.run import evaluate

REQUIRED_KEYS = {
    "ppl",
    "nll_mean",
    "nll_stderr",
    "ppl_ci95",
    "word_ppl",
    "byte_ppl",
    "bits_per_byte",
    "nll_sum",
    "tokens",
    "words",
    "bytes",
    "documents",
    "mode",
    "seq_len",
    "stride",
    "world_size",
    "precision",
    "seconds",
    "tokens_per_s",
    "config",
    "versions",
    "schema_version",
}


def test_offline_default_in_process(compose, tmp_path):
    r = evaluate(compose())
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved.keys() >= REQUIRED_KEYS
    assert saved["ppl"] == r["ppl"]
    # Random weights: perplexity near the byte vocabulary (258), every byte of the demo text scored.
    assert 150 < r["ppl"] < 400
    assert r["tokens"] == r["bytes"] and r["documents"] == 1
    assert saved["config"]["model"]["path"] == "builtin"
    # One peak RSS per rank (MB); no device figure on CPU.
    assert len(saved["rank_peak_rss_mb"]) == 1 and saved["rank_peak_rss_mb"][0] > 0
    assert saved["rank_peak_device_mb"] is None
    # Many ranks print as their max and min, naming the ranks.
    assert per_rank([500.0, 1200.4, 400.2, 700.0, 650.0]) == "max 1,200 (rank 1) · min 400 (rank 2)"
    assert per_rank([500.0, 1200.4]) == "500 · 1,200"


@pytest.mark.parametrize("precision", ["bf16-true", "64-true", "bf16-mixed"])
def test_precisions_keep_exact_counts(compose, precision):
    ref = evaluate(compose("eval.seq_len=64"))
    r = evaluate(compose("eval.seq_len=64", f"precision={precision}"))
    assert r["tokens"] == ref["tokens"] and r["precision"] == precision
    rel = 1e-6 if precision == "64-true" else 2e-2
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=rel)


def test_batch_size_and_mode_do_not_change_token_count(compose):
    counts = {
        evaluate(compose(f"batch_size={b}", f"eval={m}", "eval.seq_len=32"))["tokens"]
        for b in (1, 3)
        for m in ("rolling", "block")
    }
    counts.add(evaluate(compose("eval=sliding", "eval.seq_len=32", "eval.stride=8"))["tokens"])
    assert len(counts) == 1


def test_batch_size_does_not_change_perplexity(compose):
    a = evaluate(compose("batch_size=1", "eval.seq_len=48"))
    b = evaluate(compose("batch_size=7", "eval.seq_len=48"))
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6)


@pytest.mark.slow
def test_module_entry_subprocess(tmp_path):
    proc, results = run_entry([], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results is not None and results.keys() >= REQUIRED_KEYS
    assert "token perplexity" in proc.stdout and "random weights" in proc.stdout and "peak RSS per rank" in proc.stdout


def test_bad_override_fails_with_message(tmp_path):
    """Refused by the schema right after composition: one line, before torch is imported (so no longer slow)."""
    proc, results = run_entry(["eval.mode=zigzag"], tmp_path)
    assert proc.returncode == 2 and results is None
    assert proc.stderr.strip() == "lit-ppl: error: eval.mode='zigzag' is not one of rolling, sliding, block, llamacpp"


@pytest.mark.slow
def test_installed_package_finds_its_config(tmp_path):
    """After a non-editable `pip install .` (as .ci/run does), conf/ ships inside the package."""
    code = "import lit_ppl, lit_ppl.validate as v; print(lit_ppl.__file__); print(v.conf_dir())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or proc.stdout.splitlines()[0] == str(ROOT / "lit_ppl" / "__init__.py"):
        pytest.skip("lit-ppl is not installed as a package in this environment (source checkout only)")
    pkg_file, conf = proc.stdout.split()
    assert conf.startswith(os.path.dirname(pkg_file)) and conf.endswith("conf")
    assert os.path.isfile(os.path.join(conf, "validate.yaml"))


def test_auto_batch_size_resolves_and_agrees(compose, tmp_path):
    ref = evaluate(compose("eval.seq_len=128"))
    r = evaluate(
        compose(
            "eval.seq_len=128", "batch_size=auto", "autobatch.max_memory_gb=0.05", f"autobatch.cache={tmp_path}/ab.json"
        )
    )
    assert isinstance(r["batch_size"], int) and r["batch_size"] >= 1
    assert (tmp_path / "ab.json").is_file()
    assert r["tokens"] == ref["tokens"] and r["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)
