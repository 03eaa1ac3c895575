import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lit_ppl.metrics.perplexity import Perplexity, perplexity


def _reference_nll(seed: int = 0, n: int = 300, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (n,), generator=g)
    return F.cross_entropy(logits, targets, reduction="none")


def test_metric_matches_float64_cross_entropy_over_uneven_batches():
    nll = _reference_nll()
    metric = Perplexity()
    for chunk in torch.split(nll, [1, 7, 100, 192]):
        metric.update(chunk.float())  # float32 inputs, as the module feeds them
    out = metric.compute()
    expected = math.exp(nll.float().double().mean().item())
    assert out["ppl"].dtype == torch.float64
    assert out["ppl"].item() == pytest.approx(expected, rel=1e-12)
    assert int(out["tokens"]) == 300


def test_token_weighted_not_mean_of_batch_means():
    metric = Perplexity()
    metric.update(torch.tensor([1.0]))
    metric.update(torch.tensor([3.0, 3.0, 3.0]))
    assert metric.compute()["nll_mean"].item() == pytest.approx(2.5)  # a mean of batch means would say 2.0


def test_stderr_interval_and_normalisations_follow_llama_cpp_and_lm_eval():
    nll = _reference_nll(1).numpy()
    out = perplexity(torch.from_numpy(nll), words=40, bytes_=900, documents=2)
    n = len(nll)
    se = math.sqrt((np.mean(nll**2) - np.mean(nll) ** 2) / (n - 1))
    ppl = math.exp(nll.mean())
    assert out["nll_stderr"].item() == pytest.approx(se, rel=1e-10)
    assert out["ppl_ci95_low"].item() == pytest.approx(ppl - 1.959963984540054 * ppl * se, rel=1e-10)
    assert out["word_ppl"].item() == pytest.approx(math.exp(nll.sum() / 40), rel=1e-10)
    assert out["byte_ppl"].item() == pytest.approx(math.exp(nll.sum() / 900), rel=1e-10)
    assert out["bits_per_byte"].item() == pytest.approx(nll.sum() / 900 / math.log(2), rel=1e-10)


def test_functional_twin_agrees_with_class():
    nll = _reference_nll(2)
    metric = Perplexity()
    metric.update(nll[:100], words=5, bytes_=20, documents=1)
    metric.update(nll[100:], words=7, bytes_=30, documents=1)
    cls_out, fn_out = metric.compute(), perplexity(nll, words=12, bytes_=50, documents=2)
    for key in ("ppl", "nll_mean", "nll_stderr", "word_ppl", "byte_ppl", "bits_per_byte"):
        assert cls_out[key].item() == pytest.approx(fn_out[key].item(), rel=1e-13), key


def test_states_float64_after_module_cast_and_set_dtype():
    metric = Perplexity()
    metric.update(torch.tensor([0.123456789]))
    metric.to(torch.bfloat16)  # what a "*-true" precision plugin does to the whole LightningModule
    assert metric.nll_sum.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"expected torch\.float64"):
        metric.compute()
    metric.set_dtype(torch.float64)
    metric.reset()
    metric.update(torch.tensor([0.123456789], dtype=torch.float64))
    assert metric.nll_sum.dtype == torch.float64
    assert metric.compute()["nll_mean"].item() == pytest.approx(0.123456789, rel=1e-15)


def test_nonfinite_values_are_counted_not_summed():
    metric = Perplexity()
    metric.update(torch.tensor([1.0, float("nan"), float("inf"), 2.0]))
    out = metric.compute()
    assert int(out["nonfinite"]) == 2 and int(out["tokens"]) == 2
    with pytest.raises(ValueError, match="non-finite"):
        perplexity(torch.tensor([float("nan")]))


def test_sync_on_step_is_refused():
    with pytest.raises(ValueError, match="dist_sync_on_step"):
        Perplexity(dist_sync_on_step=True)


def test_a_finite_mask_from_the_caller_gives_the_same_states():
    """The module passes its own ``isfinite`` (one pass per step): the metric must count exactly as without it."""
    nll = torch.tensor([1.0, float("nan"), 2.5, float("inf"), -float("inf"), 0.5], dtype=torch.bfloat16)
    plain, given = Perplexity(), Perplexity()
    plain.update(nll, words=3, bytes_=9, documents=1)
    given.update(nll, words=3, bytes_=9, documents=1, finite=torch.isfinite(nll))
    for key, value in plain.metric_state.items():
        assert torch.equal(getattr(given, key), value), key
    assert int(given.nonfinite) == 3 and int(given.tokens) == 3
    assert given.compute()["nll_sum"].item() == 4.0
