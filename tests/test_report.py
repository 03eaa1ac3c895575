"""``python -m lit_ppl.report`` and its plots, on results.json files written by the real pipeline."""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from lit_ppl.report import plots
from lit_ppl.report import runs as report
from lit_ppl.report import tables as report_table
from lit_ppl.run import evaluate
from lit_ppl.runtime.files import write_json_atomic

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    """The built-in model at world size 1 with batch sizes 1 and 3 (must agree), and an int8 run compared to it."""
    from hydra import compose, initialize_config_dir

    from lit_ppl.validate import conf_dir

    base = tmp_path_factory.mktemp("runs")
    runs = {"b1": ["batch_size=1"], "b3": ["batch_size=3"], "int8": ["quant=int8", "compare=unquantized"]}
    out = {}
    for name, overrides in runs.items():
        run_dir = base / name
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            cfg = compose(
                "validate",
                overrides=[f"output_dir={run_dir}", f"data.cache_dir={base / 'cache'}", "eval.seq_len=128", *overrides],
            )
        evaluate(cfg)
        out[name] = run_dir
    return out


def doctored(src: Path, dst: Path, **changes) -> Path:
    """A copy of the run ``src`` at ``dst`` with some top-level results changed."""
    results = json.loads((src / "results.json").read_text())
    results.update(changes)
    write_json_atomic(dst / "results.json", results)
    return dst


def run_report(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "lit_ppl.report", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_batch_sizes_agree(run_dirs):
    runs = [report.load_run(run_dirs["b1"]), report.load_run(run_dirs["b3"])]
    assert report.agreement_groups(runs) == [[0, 1]]
    assert report.consistency(runs) == []
    rows = report.compare_runs(runs)
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert rows[0]["delta_ppl"] is None and rows[0]["ci_overlap"] is None
    assert abs(rows[1]["delta_pct"]) < 1e-4 and rows[1]["ci_overlap"] is True
    assert rows[1]["tokens"] == rows[0]["tokens"] > 0


def test_doctored_ppl_is_flagged(run_dirs, tmp_path):
    b1 = report.load_run(run_dirs["b1"])
    bad = copy.deepcopy(b1)
    bad.update(ppl=b1["ppl"] * (1 + 1e-3), run="bad")
    problems = report.consistency([b1, bad])
    assert len(problems) == 1
    assert problems[0].startswith("MISMATCH ") and "relative difference 1.00e-03 > 1e-06" in problems[0]
    fewer = {**b1, "tokens": b1["tokens"] - 1, "run": "fewer"}
    (problem,) = report.consistency([b1, fewer])
    assert f"tokens {b1['tokens']:,} vs {b1['tokens'] - 1:,}" in problem
    # Just inside the tolerance is agreement.
    assert report.consistency([b1, {**b1, "ppl": b1["ppl"] * (1 + 5e-7)}]) == []


def test_runs_that_need_not_agree_are_not_checked(run_dirs):
    b1, q = report.load_run(run_dirs["b1"]), report.load_run(run_dirs["int8"])
    assert report.agreement_groups([b1, q]) == []
    assert report.consistency([b1, q]) == []
    longer = copy.deepcopy(b1)
    longer["seq_len"] = longer["config"]["eval"]["seq_len"] = 256
    longer["ppl"] *= 2
    assert report.consistency([b1, longer]) == []


def test_parallel_layout_and_cache_do_not_split_groups(run_dirs):
    b1 = report.load_run(run_dirs["b1"])
    other = copy.deepcopy(b1)
    other.update(world_size=4, num_nodes=2, strategy="fsdp")
    other["config"]["data"]["cache_dir"] = "/elsewhere"
    other["config"]["quant"]["source"] = "rank0"
    assert report.agreement_key(b1) == report.agreement_key(other)
    assert "world 4 · fsdp · batch 1 · 2 nodes" in report.describe(other)


def test_compare_section_and_quant_name(run_dirs):
    rows = report.compare_runs([report.load_run(run_dirs["b3"]), report.load_run(run_dirs["int8"])])
    assert rows[0]["quant"] == "none" and rows[0]["kld_mean"] is None
    assert rows[1]["quant"] == "int8"
    assert rows[1]["kld_mean"] >= 0 and 0.9 <= rows[1]["same_top"] <= 1


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d.mkdir(), "no results.json (a run directory holds one once its run finished)"),
        (lambda d: None, "no results.json (no such directory)"),
        (lambda d: (d.mkdir(), (d / "results.json").write_text("{not json")), "not valid JSON"),
        (lambda d: (d.mkdir(), (d / "results.json").write_text("[1, 2]")), "expected a JSON object, found list"),
        (
            lambda d: (d.mkdir(), (d / "results.json").write_text('{"schema_version": 99}')),
            "schema_version 99, but this lit-ppl reads version 1",
        ),
        (
            lambda d: (d.mkdir(), (d / "results.json").write_text('{"ppl": 1.0}')),
            "schema_version None, but this lit-ppl reads version 1",
        ),
        (
            lambda d: (d.mkdir(), (d / "results.json").write_text('{"schema_version": 1, "ppl": 1.0}')),
            "lacks ppl_ci95, tokens",
        ),
    ],
)
def test_load_errors_name_the_file(tmp_path, setup, message):
    run_dir = tmp_path / "run"
    setup(run_dir)
    with pytest.raises(report.ReportError) as err:
        report.load_run(run_dir)
    text = str(err.value)
    assert text.startswith(str(run_dir / "results.json")) and message in text and "\n" not in text


def test_load_run_accepts_the_file(run_dirs):
    run = report.load_run(run_dirs["b1"] / "results.json")
    assert run["run"] == str(run_dirs["b1"]) and run["results_path"] == str(run_dirs["b1"] / "results.json")


def test_markdown_and_csv(run_dirs, tmp_path):
    runs = [report.load_run(run_dirs[n]) for n in ("b1", "b3", "int8")]
    rows = report.compare_runs(runs)
    md = report_table.runs_markdown(rows).splitlines()
    assert md[0].startswith("| run | PPL | 95% CI | ΔPPL | ΔPPL % | CI overlap | tokens | world | batch |")
    assert "mean KLD" in md[0] and "top-1 agree" in md[0]
    assert md[1].startswith("|:---|---:|") and len(md) == 2 + len(runs)
    assert md[2].startswith(f"| {run_dirs['b1']} | {runs[0]['ppl']:.6f} |") and "| — | — | — |" in md[2]
    assert "| int8 |" in md[4] and md[4].count("|") == md[0].count("|")
    # Without a comparison the KLD columns are left out rather than filled with dashes.
    assert "mean KLD" not in report_table.runs_markdown(rows[:2])

    path = report_table.to_csv(rows, tmp_path / "sub" / "report.csv")
    with path.open() as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == [str(run_dirs[n]) for n in ("b1", "b3", "int8")]
    assert float(table[1]["ppl"]) == runs[1]["ppl"]  # raw numbers, full precision
    assert table[0]["delta_ppl"] == "" and table[1]["ci_overlap"] == "True"
    assert float(table[2]["kld_mean"]) == runs[2]["compare"]["kld_mean"]


def synthetic_positions(seq_len: int = 128, seed: int = 0) -> dict[str, list[float]]:
    """Per-position NLL sums of a model whose loss falls with context: 5 nats at position 0 down to about 3."""
    rng = np.random.default_rng(seed)
    count = np.full(seq_len, 40.0)
    count[-10:] = [30, 20, 10, 5, 3, 2, 1, 1, 0, 0]  # short last windows: the tail has few or no tokens
    sums, sums_sq = [], []
    for p, n in enumerate(count.astype(int)):
        nll = rng.gamma(4.0, (3 + 2 * np.exp(-p / 15)) / 4.0, size=n)
        sums.append(float(nll.sum()))
        sums_sq.append(float((nll**2).sum()))
    return {"sum": sums, "sum_sq": sums_sq, "count": count.tolist()}


def test_position_stats():
    count, mean, stderr = plots.position_stats({"sum": [6.0, 2.0, 0.0], "sum_sq": [14.0, 4.0, 0.0], "count": [3, 1, 0]})
    assert count.tolist() == [3, 1, 0]
    assert mean[0] == pytest.approx(2.0) and mean[1] == pytest.approx(2.0) and np.isnan(mean[2])
    # values 1, 2, 3: sample variance 1, standard error sqrt(1/3)
    assert stderr[0] == pytest.approx(np.sqrt(1 / 3)) and np.isnan(stderr[1]) and np.isnan(stderr[2])
    with pytest.raises(ValueError, match="differ in length"):
        plots.position_stats({"sum": [1.0], "sum_sq": [1.0, 2.0], "count": [1]})


def test_plots_are_pngs(run_dirs, tmp_path):
    path = plots.plot_nll_by_position(synthetic_positions(), tmp_path / "nll.png", title="synthetic")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    runs = [report.load_run(run_dirs[n]) for n in ("b1", "b3", "int8")]
    assert plots.sweep_labels(runs) == ["quant none\nbatch 1", "quant none\nbatch 3", "quant int8\nbatch 8"]
    for name, subset in (("sweep.png", runs), ("sweep_no_kld.png", runs[:2])):
        data = plots.plot_sweep(subset, tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_reports_show_the_resolved_batch_size(run_dirs, tmp_path):
    """Under batch_size=auto the config says "auto"; results.json's ``batch_size`` is what ran, and reports show it."""
    b1 = json.loads((run_dirs["b1"] / "results.json").read_text())
    auto = report.load_run(
        doctored(run_dirs["b1"], tmp_path / "auto", batch_size=5, config={**b1["config"], "batch_size": "auto"})
    )
    assert report.compare_runs([auto])[0]["batch_size"] == 5
    assert "· batch 5 ·" in report.describe(auto)
    assert plots.sweep_labels([report.load_run(run_dirs["b1"]), auto]) == ["batch 1", "batch 5"]


def test_breakdown_only_when_a_report_reads_it(run_dirs, compose, tmp_path):
    """Per-position and per-document sums cost work every step: kept only for report.plots, report.html or
    report.per_document."""
    assert sum(json.loads((run_dirs["b1"] / "results.json").read_text())["nll_by_position"]["count"]) > 0
    off = evaluate(
        compose("eval.seq_len=128", "report.plots=false", "report.html=false", f"output_dir={tmp_path / 'off'}")
    )
    assert off["nll_by_position"] is None
    assert sorted(p.name for p in (tmp_path / "off").iterdir()) == ["results.json"]
    on = evaluate(
        compose(
            "eval.seq_len=128",
            "report.plots=false",
            "report.html=false",
            "report.per_document=csv",
            f"output_dir={tmp_path / 'on'}",
        )
    )
    assert sum(on["nll_by_position"]["count"]) == on["tokens"]
    with (tmp_path / "on" / "per_document.csv").open() as f:
        assert sum(int(row["tokens"]) for row in csv.DictReader(f)) == on["tokens"]
    assert off["nll_sum"] == on["nll_sum"] and off["tokens"] == on["tokens"]  # the numbers never depend on it


def test_cli_agreeing_runs(run_dirs, tmp_path):
    with_positions = doctored(run_dirs["b3"], tmp_path / "runs" / "b3", nll_by_position=synthetic_positions())
    first = doctored(run_dirs["b1"], tmp_path / "runs" / "b1", nll_by_position=None)
    proc = run_report(
        first, with_positions, "--markdown", tmp_path / "r.md", "--csv", tmp_path / "r.csv", "--plots", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "lit-ppl report · 2 runs" in proc.stdout and "MISMATCH" not in proc.stdout
    assert "consistency: OK, 2 runs in 1 group" in proc.stdout
    assert (tmp_path / "r.md").read_text().startswith("| run | PPL |")
    assert len((tmp_path / "r.csv").read_text().splitlines()) == 3
    for png in (with_positions / "nll_by_position.png", tmp_path / "runs" / "sweep.png"):
        assert png.read_bytes().startswith(PNG_MAGIC), png
    assert not (first / "nll_by_position.png").exists()  # that copy has no per-position statistics


def test_cli_mismatch_exits_1(run_dirs, tmp_path):
    b1 = json.loads((run_dirs["b1"] / "results.json").read_text())
    bad = doctored(run_dirs["b1"], tmp_path / "bad", ppl=b1["ppl"] * (1 + 1e-3))
    proc = run_report(run_dirs["b1"], run_dirs["b3"], bad, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("MISMATCH")]
    assert f"{run_dirs['b1']} (world 1 · auto · batch 1 · 1 node) vs {bad}" in line
    assert "relative difference 1.00e-03" in line


def test_cli_missing_results(run_dirs, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_report(run_dirs["b1"], tmp_path / "empty", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"lit-ppl report: error: {tmp_path / 'empty' / 'results.json'}: no results.json "
        "(a run directory holds one once its run finished)"
    )
    assert proc.stdout == ""
