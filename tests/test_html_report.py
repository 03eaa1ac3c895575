"""report.html and the runs' page, loaded in a real headless Chromium: no console error, one shaded span per shown
token with its values, the comparison's top-1 buckets, a screenshot with content, and a bounded size."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import STORIES, TINYSTORIES, require_shared
from helpers.browser import chromium, report_data
from helpers.runs import evaluate_overrides

from lit_ppl.data.windows import build_windows, sample_pages, token_offsets
from lit_ppl.evaluation.pages import BUDGET, PAGE
from lit_ppl.metrics.sample import TokenSample
from lit_ppl.report.html import run_page
from lit_ppl.report.runs import main as report_main

DATA = ["model=hf", f"model.path={STORIES}", "data=text", f"data.path={TINYSTORIES}", "trainer=cpu"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """int8 against the unquantized model (with per-token NLLs to check the page by), and a plain run without a page."""
    require_shared()
    root = tmp_path_factory.mktemp("html")
    cache = f"data.cache_dir={root / 'cache'}"
    compared = [*DATA, cache, "quant=int8", "compare=unquantized", "report.per_token=true"]
    return {
        "root": root,
        "int8": evaluate_overrides(compared, root / "int8"),
        "plain": evaluate_overrides([*DATA, cache, "report.html=false"], root / "plain"),
    }


@pytest.fixture(scope="module")
def browser():
    return chromium()


def test_run_page_shades_every_token_and_shows_the_buckets(runs, browser, tmp_path):
    r, out = runs["int8"], runs["root"] / "int8"
    html = (out / "report.html").read_text(encoding="utf-8")
    assert not re.search(r"\b(src|href)\s*=", html)  # nothing fetched: no network on a cluster's nodes
    loaded = browser.load(out / "report.html")
    assert loaded.console_errors == []
    spans = re.findall(
        r'<span class="tok" title="[^"]*" data-nll="([^"]+)" data-kld="([^"]+)" style="([^"]*)"', loaded.dom
    )
    assert len(spans) == r["tokens"] == 1882  # a small corpus: every scored token, each its own span
    assert all(s.startswith("background-color: rgba(220, 38, 38,") for *_, s in spans)  # shaded by its KLD
    per_token = np.load(out / "per_token.npy")  # the run's own per-token NLLs, corpus order
    assert np.allclose([float(n) for n, *_ in spans], per_token, rtol=6e-4, atol=1e-6)
    assert 0 < max(float(k) for _, k, _ in spans) <= r["compare"]["kld_max"] * (1 + 1e-3)
    text = "".join(report_data(out / "report.html")["pages"][0]["text"])
    assert TINYSTORIES.read_text(encoding="utf-8").strip()[:200] in text  # the text as written, token by token
    buckets = re.search(r'<table class="buckets">(.*?)</table>', loaded.dom).group(1)
    rows = re.findall(r"<tr><td>(\[[^<]*)</td><td>([\d,]+)</td>", buckets)
    assert [int(n.replace(",", "")) for _, n in rows] == [b["tokens"] for b in r["compare"]["kld_by_top_p"]]
    shot = browser.screenshot(out / "report.html", tmp_path / "report.png")
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    drawn = (pixels < 0.95).any(-1).mean()  # anything but the white background
    shaded = ((pixels[..., 0] - pixels[..., 1]) > 0.15).sum()  # the red of shaded tokens and KL(Q‖ref) bars
    assert drawn > 0.05 and shaded > 2000, (drawn, shaded)


def test_the_browser_check_sees_a_script_error(browser, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text('<!DOCTYPE html><html><body><script>console.error("boom"); null.x;</script></body></html>')
    errors = browser.load(broken).console_errors
    assert len(errors) == 2 and '"boom"' in errors[0] and "Uncaught TypeError" in errors[1]


def test_runs_page_and_html_off(runs, browser, tmp_path):
    root = runs["root"]
    assert not (root / "plain" / "report.html").exists()  # report.html=false
    assert report_main([str(root / "int8"), str(root / "plain"), "--html", str(tmp_path / "runs.html")]) == 0
    loaded = browser.load(tmp_path / "runs.html")
    assert loaded.console_errors == []
    table = re.search(r'<table class="runs">(.*?)</table>', loaded.dom).group(1)
    assert table.count("<tr>") == 3 and "int8" in table  # the header and one row per run
    frontier = re.search(r"Frontier.*?</svg>", loaded.dom, re.S).group(0)
    assert frontier.count("<circle") == 1  # the one run with a comparison: its bytes against its KLD


def test_a_million_token_corpus_gives_a_page_of_bounded_size(runs):
    """The sampled windows of 1M tokens, filled with the real run's pieces and values, make a page under 5 MB."""
    lengths = np.full(2000, 500)
    windows = build_windows("rolling", lengths, seq_len=512)
    first = token_offsets(windows, lengths)
    assert first[-1] == 1_000_000
    pages = sample_pages(first, BUDGET, PAGE)
    assert pages[:, 2].sum() <= BUDGET and pages[0, 0] == 0 and pages[-1, 0] == len(windows) - 1  # spread over all
    real = report_data(runs["root"] / "int8" / "report.html")["pages"][0]
    cycle = lambda key, n: [real[key][i % len(real[key])] for i in range(n)]  # noqa: E731
    keys = ("text", "nll", "kld", "nll_base")
    text = {
        "pages": [{"document": 0, "position": 0, **{k: cycle(k, int(n)) for k in keys}} for n in pages[:, 2]],
        "shown": int(pages[:, 2].sum()),
        "scored": 1_000_000,
    }
    size = len(run_page(runs["int8"], text).encode())
    assert 100_000 < size < 5 * 2**20, size


def test_token_sample_keeps_exactly_the_sampled_tokens_at_any_world_size():
    """Batches of a 1M-token corpus dealt to 1 or 3 "ranks", merged as a sync sums: each sampled token's values."""
    first = np.arange(0, 1_000_001, 500)  # 2,000 windows of 500 scored tokens
    pages = sample_pages(first, BUDGET, PAGE)
    wanted = np.concatenate([np.arange(a, a + n) for a, n in pages[:, 1:]])
    merged = []
    for ranks in (1, 3):
        metrics = [TokenSample(pages[:, 1:], ("nll", "target")) for _ in range(ranks)]
        for step, start in enumerate(range(0, 1_000_000, 4096)):
            index = torch.arange(start, min(start + 4096, 1_000_000))
            metrics[step % ranks].update(index, nll=index.double() * 1e-3, target=index % 49_152)
        for other in metrics[1:]:
            metrics[0].merge_state(other)
        merged.append(metrics[0].compute())
    for values in merged:
        assert np.array_equal(values["target"].numpy(), wanted % 49_152)
        assert np.array_equal(values["nll"].numpy(), wanted * 1e-3)
