"""The quantization frontier: a ``-m`` sweep's quant=auto jobs share one sensitivity table (lit_ppl.quant.auto.reuse),
and frontier.svg / frontier.md draw its jobs' bytes against their measured KLD (lit_ppl.report.frontier)."""

from __future__ import annotations

import itertools
import json
import logging
import re
import runpy
import sys

import pytest
from conftest import STORIES, TINYSTORIES, require_shared
from helpers.browser import chromium
from test_sweep import fake_job, sweep

from lit_ppl.config.quant import quant_config
from lit_ppl.quant.auto.reuse import same_fingerprint, sibling_table, with_sibling_table
from lit_ppl.report.frontier import main as frontier_main
from lit_ppl.report.frontier import write_frontier
from lit_ppl.report.svg import COLOURS, LABEL_H

FINGERPRINT = {
    "schemes": ["none", "int8", "int4"],
    "method": "awq",
    "group_size": 32,
    "layers": ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"],
    "tokens": 128,
    "nll": 2.5,
}
TABLE = {layer: {"int8": {"kld": 1e-4, "nll_delta": 0.0}} for layer in FINGERPRINT["layers"]}
MIB = 2**20


def auto(budget: float, kld: float, nbytes: int, fingerprint: dict | None = None, source: str | None = None) -> dict:
    """A quant=auto job's results.json, as much of it as the frontier and the table search read."""
    return {
        "ppl": 6.0 + kld,
        "config": {"quant": {"name": "auto", "method": "awq"}},
        "compare": {"kld_mean": kld, "kld_mean_unc": kld / 20},
        "quant": {
            "name": "auto",
            "weight_bytes_packed": nbytes,
            "auto": {
                "budget": {"kld": budget},
                "measured_calibration": budget * 0.9,
                "fingerprint": fingerprint or FINGERPRINT,
                "sensitivity": TABLE,
                "sensitivity_from": source,
                "measurement": {"seconds": 3.0 if source else 40.0},
            },
        },
    }


def uniform(name: str, method: str, kld: float, nbytes: int) -> dict:
    return {
        "ppl": 6.0 + kld,
        "config": {"quant": {"name": name, "method": method}},
        "compare": {"kld_mean": kld, "kld_mean_unc": kld / 20},
        "quant": {"name": name, "weight_bytes_packed": nbytes},
    }


def test_a_sweep_job_takes_the_first_measured_table_of_its_own_fingerprint(tmp_path, caplog):
    first = str(tmp_path / "0" / "results.json")
    fake_job(tmp_path, "0", ["frontier=auto_0.1"], auto(0.1, 0.05, 3 * MIB))
    fake_job(tmp_path, "1", ["frontier=auto_0.02"], auto(0.02, 0.01, 4 * MIB, source=first))  # a reuse
    fake_job(tmp_path, "2", ["frontier=auto_0.005"], auto(0.005, 0.004, 5 * MIB, FINGERPRINT | {"nll": 2.6}))
    fake_job(tmp_path, "3", ["frontier=int8"], uniform("int8", "rtn", 6e-4, 6 * MIB))
    fake_job(tmp_path, "10", ["frontier=auto_0.1"], auto(0.1, 0.05, 3 * MIB))  # measured too, later in job order
    fake_job(tmp_path, "4", ["frontier=auto_0.1"], None)
    (tmp_path / "4" / "results.json").write_text('{"quant": {"auto":')  # still being written

    assert sibling_table(tmp_path, FINGERPRINT) == tmp_path / "0" / "results.json"  # not job 10, nor a reuse
    assert sibling_table(tmp_path, FINGERPRINT | {"nll": 2.5 * (1 + 1e-12)}) == tmp_path / "0" / "results.json"
    assert sibling_table(tmp_path, FINGERPRINT | {"nll": 2.6}) == tmp_path / "2" / "results.json"
    assert sibling_table(tmp_path, FINGERPRINT | {"group_size": 64}) is None
    # The whole dict is compared: a key one fingerprint has and the other lacks is another measurement.
    assert sibling_table(tmp_path, FINGERPRINT | {"sensitivity_method": "fisher"}) is None
    assert not same_fingerprint(FINGERPRINT, {k: v for k, v in FINGERPRINT.items() if k != "tokens"})
    assert not same_fingerprint(FINGERPRINT, FINGERPRINT | {"nll": True}) and not same_fingerprint(FINGERPRINT, [])

    node = {"name": "auto", "budget": {"kld": 0.1}, "calibration": {"path": "calibration.txt"}}
    with caplog.at_level(logging.WARNING, logger="lit_ppl.quant.auto.reuse"):
        reused = with_sibling_table(quant_config(node | {"sweep_dir": str(tmp_path)}), FINGERPRINT)
    assert reused.sensitivity == first and reused.budget.kld == 0.1
    assert [r.getMessage() for r in caplog.records] == [
        f"quant=auto: reusing the sensitivity table of the sweep's job {tmp_path / '0'} (same fingerprint)"
    ]
    given = quant_config(node | {"sweep_dir": str(tmp_path), "sensitivity": "mine.json"})
    assert with_sibling_table(given, FINGERPRINT) is given  # a table the user named wins
    alone = quant_config(node)
    assert alone.sweep_dir is None and with_sibling_table(alone, FINGERPRINT) is alone  # not in a sweep
    gone = quant_config(node | {"sweep_dir": str(tmp_path / "absent")})
    assert with_sibling_table(gone, FINGERPRINT) is gone


@pytest.fixture
def frontier_sweep(tmp_path):
    """Seven jobs as a 'frontier=glob(*)' sweep leaves them (KLDs and bytes made up), and one that failed."""
    first = str(tmp_path / "0" / "results.json")
    jobs = [
        ("auto_0.005", auto(0.005, 0.0041, int(0.36 * MIB))),
        ("auto_0.02", auto(0.02, 0.023, int(0.34 * MIB), source=first)),  # over its budget on the evaluated text
        ("auto_0.1", auto(0.1, 0.051, int(0.32 * MIB), source=first)),
        ("int4_awq", uniform("int4", "awq", 0.110, int(0.29 * MIB))),
        ("int4_gptq", uniform("int4", "gptq", 0.094, int(0.29 * MIB))),  # same bytes, similar KLD: labels stack
        ("int4_rtn", uniform("int4", "rtn", 0.124, int(0.29 * MIB))),
        ("int8", uniform("int8", "rtn", 6e-4, int(0.37 * MIB))),
    ]
    for i, (name, results) in enumerate(jobs):
        fake_job(tmp_path, str(i), [f"frontier={name}"], results)
    fake_job(tmp_path, "7", ["frontier=int4_hqq"], None)
    return tmp_path


def test_the_frontier_picture_and_table(frontier_sweep, tmp_path):
    svg_path, md_path, table = write_frontier(frontier_sweep)
    svg = svg_path.read_text()
    assert svg.startswith("<?xml") and 'xmlns="http://www.w3.org/2000/svg"' in svg and "svg.chart .line" in svg
    assert svg.count("<circle") == 7
    texts = re.findall(r'<text x="[\d.]+" y="([\d.]+)" text-anchor="\w+" class="small">([^<]+)</text>', svg)
    shown = {name: float(y) for y, name in texts}
    assert {"auto@0.005", "auto@0.02", "auto@0.1", "int4 awq", "int4 gptq", "int4 rtn", "int8"} <= set(shown)
    stacked = sorted(shown[n] for n in ("int4 awq", "int4 gptq", "int4 rtn"))
    assert all(b - a >= LABEL_H for a, b in itertools.pairwise(stacked))  # none covers another
    assert [n for n in shown if n.startswith("budget")] == ["budget 0.005", "budget 0.02", "budget 0.1"]
    assert svg.count('class="level"') == 3
    # The auto points joined in the order of bytes: 0.32 (auto@0.1), 0.34, 0.36 MiB.
    (line,) = re.findall(r'<path d="([^"]+)" class="line"/>', svg)
    xs = [float(x) for x in re.findall(r"[ML]([\d.]+),", line)]
    assert len(xs) == 3 and xs == sorted(xs)

    rows = [r for r in md_path.read_text().splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == [
        "int4 awq",
        "int4 gptq",
        "int4 rtn",
        "auto@0.1",
        "auto@0.02",
        "auto@0.005",
        "int8",
        "",
    ]  # fmt: skip  (by bytes; the failed job last)
    cells = {r.split(" | ")[0].strip("| "): r.split(" | ") for r in rows}
    assert cells["auto@0.02"][8] == "NO" and cells["auto@0.1"][8] == "yes" and cells["auto@0.1"][9] == "0"
    assert cells["auto@0.005"][9] == "measured" and cells["int8"][3] == "0.0006" and "no results.json" in rows[-1]
    assert table in md_path.read_text() and "![frontier](frontier.svg)" in md_path.read_text()

    browser = chromium()
    loaded = browser.load(svg_path)
    assert loaded.console_errors == [] and loaded.dom.count("<circle") == 7
    shot = browser.screenshot(svg_path, tmp_path / "frontier.png", width=760, height=300)
    import matplotlib.image

    pixels = (matplotlib.image.imread(shot)[..., :3] * 255).round()
    for colour in COLOURS[:2]:  # the auto points and their line; the uniform points
        rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
        assert (abs(pixels - rgb).max(-1) <= 8).sum() > 120, colour  # a circle of radius 5: about 70 pixels


def test_the_frontier_command_and_its_one_line_errors(frontier_sweep, tmp_path, capsys, monkeypatch):
    assert frontier_main([str(frontier_sweep)]) == 0
    assert f"frontier: {frontier_sweep / 'frontier.svg'}" in capsys.readouterr().out
    fake_job(tmp_path / "plain", "0", ["eval.seq_len=64"], {"ppl": 9.0, "quant": None})
    cases = ((tmp_path / "plain", "none of its 1 finished jobs measured a KLD"), (tmp_path / "x", "no such"))
    for where, message in cases:
        monkeypatch.setattr(sys, "argv", ["lit_ppl.report", "frontier", str(where)])
        with pytest.raises(SystemExit) as exit_:  # python -m lit_ppl.report frontier DIR
            runpy.run_module("lit_ppl.report", run_name="__main__")
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_a_frontier_sweep_measures_one_table_and_draws_its_jobs(tmp_path):
    """Two auto jobs of a real sweep: the second reuses the first's table; the callback draws the frontier."""
    require_shared()
    calibration = {"path": STORIES.parent / "tinyshakespeare.txt", "cache_dir": tmp_path, "tokens": 128}
    calibration |= {"seq_len": 64, "batch_size": 1}
    args = ["model=hf", f"model.path={STORIES}", "data=text", f"data.path={TINYSTORIES}", "trainer=cpu"]
    args += ["data.document_separator='<|endoftext|>'", "data.limit=1"]  # one story of five
    args += ["eval.seq_len=128", "compare=unquantized", "report.plots=false", "report.html=false"]
    args += ["quant.group_size=32", *(f"quant.calibration.{k}={v}" for k, v in calibration.items())]
    args += ["quant.method=rtn", "quant.schemes=[none,int4]"]  # the cheapest table: no calibration statistics
    args.append("frontier=auto_0.1,auto_0.02")
    proc, sweep_dir = sweep(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (json.loads((sweep_dir / str(i) / "results.json").read_text()) for i in range(2))
    a, b = first["quant"]["auto"], second["quant"]["auto"]
    assert a["sensitivity_from"] is None and b["sensitivity_from"] == str(sweep_dir / "0" / "results.json")
    assert a["measurement"]["passes"] == 2 and b["measurement"]["passes"] == 0  # the estimate's 2 windows, then none
    assert b["sensitivity"] == a["sensitivity"] and b["fingerprint"] == a["fingerprint"]
    assert b["budget"] == {"kld": 0.02} and b["bytes"] > a["bytes"]  # a tighter budget: more bytes
    assert (proc.stdout + proc.stderr).count("reusing the sensitivity table") == 1
    for r in (first, second):  # packed bytes, counted twice: per weight by the quantizer, per layer by the search
        q = r["quant"]
        auto_ = q["auto"]
        assert q["weight_bytes_packed"] == q["weight_bytes_before"] - auto_["bytes_full_precision"] + auto_["bytes"]
    svg = (sweep_dir / "frontier.svg").read_text()
    assert svg.count("<circle") == 2 and svg.count('class="line"') == 1 and svg.count('class="level"') == 2
    md = (sweep_dir / "frontier.md").read_text()
    assert "| auto@0.1 | 0 |" in md and "| auto@0.02 | 1 |" in md and "frontier: " in proc.stdout
