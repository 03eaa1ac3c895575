"""Parity with lm-evaluation-harness 0.4.13 and the Hugging Face strided-window guide on a real model."""

import pytest

from lit_ppl.run import evaluate

REL = 2e-5


def test_rolling_matches_lm_eval(compose, stories):
    cfg = compose(
        f"model.path={stories}",
        "data.path=../shared/data/tinystories_sample.txt".replace("../shared/data", str(stories.parent)),
        "eval=rolling",
        "eval.seq_len=512",
    )
    r = evaluate(cfg)
    assert r["tokens"] == 1882 and r["words"] == 732 and r["bytes"] == 3794 and r["documents"] == 1
    assert r["ppl"] == pytest.approx(6.8972206, rel=REL)
    assert r["word_ppl"] == pytest.approx(143.30562, rel=REL)
    assert r["byte_ppl"] == pytest.approx(2.6062812, rel=REL)
    assert r["bits_per_byte"] == pytest.approx(1.3819927, rel=REL)
    assert r["nll_sum"] == pytest.approx(3634.365, rel=REL)


def test_sliding_matches_hf_guide_without_its_undercount(compose, stories):
    cfg = compose(
        f"model.path={stories}",
        f"data.path={stories.parent / 'tinystories_sample.txt'}",
        "eval=sliding",
        "eval.seq_len=512",
        "eval.stride=256",
    )
    r = evaluate(cfg)
    assert r["tokens"] == 1882
    assert r["ppl"] == pytest.approx(7.4373707, rel=REL)
