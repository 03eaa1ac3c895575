"""Candidate-vs-reference comparison (llama.cpp's KL-divergence report) on the real stories260K."""

from __future__ import annotations

import pytest
import torch
from conftest import STORIES, TINYSTORIES, require_shared

from lit_ppl import quantize
from lit_ppl.compare import KLDivergence, percentile, token_stats
from lit_ppl.data import DataSpec, PerplexityDataModule
from lit_ppl.models import ModelSpec
from lit_ppl.validate import evaluate

DATA = ["model=hf", f"model.path={STORIES}", "data=text", f"data.path={TINYSTORIES}", "trainer=cpu"]


def test_model_against_itself(compose):
    require_shared()
    r = evaluate(compose(*DATA, "compare=unquantized"))
    c = r["compare"]
    assert c["tokens"] == r["tokens"] == 1882
    assert c["kld_mean"] == 0.0 and c["kld_max"] == 0.0 and c["p_diff_rms"] == 0.0
    assert c["same_top"] == 1.0 and c["same_top_unc"] == 0.0
    assert c["ppl_ratio"] == 1.0 and c["ppl"] == c["ppl_base"] == r["ppl"]
    assert c["ppl_base"] == pytest.approx(6.8972206, rel=2e-5)
    assert r["quant"] is None and r["reference_quant"] is None


def direct_float64(quantized: bool) -> dict[str, torch.Tensor]:
    """Per-token KLD / Δp / top-1 of int4-g32 vs the original, from each model's *full* logits, in float64."""
    spec = ModelSpec(path=str(STORIES))
    base, cand = spec.build(), spec.build()
    if quantized:
        quantize.build({"name": "int4", "group_size": 32})(cand)
    dm = PerplexityDataModule(DataSpec(path=str(TINYSTORIES)), spec.tokenizer(), mode="rolling", seq_len=512)
    dm.setup()
    kld, p_diff, same = [], [], []
    for batch in dm.val_dataloader():
        ids, idx, tgt = batch["input_ids"], batch["score_index"], batch["targets"]
        with torch.no_grad():
            lq = cand(ids).logits.reshape(-1, 512).index_select(0, idx).double().log_softmax(-1)
            lp = base(ids).logits.reshape(-1, 512).index_select(0, idx).double().log_softmax(-1)
        kld.append((lp.exp() * (lp - lq)).sum(-1))
        p_diff.append(lq.gather(1, tgt[:, None])[:, 0].exp() - lp.gather(1, tgt[:, None])[:, 0].exp())
        same.append(lq.argmax(-1) == lp.argmax(-1))
    return {"kld": torch.cat(kld), "p_diff": torch.cat(p_diff), "same": torch.cat(same)}


def test_int4_against_unquantized_matches_a_direct_float64_computation(compose):
    require_shared()
    r = evaluate(compose(*DATA, "quant=int4", "quant.group_size=32", "compare=unquantized", "eval.chunk_size=100"))
    c, direct = r["compare"], direct_float64(quantized=True)
    assert c["tokens"] == direct["kld"].numel() == 1882
    assert c["kld_mean"] > 0.01 and c["same_top"] < 0.95 and c["ppl_ratio"] > 1.0
    assert c["ppl"] == pytest.approx(r["ppl"], rel=1e-12) and c["ppl_base"] == pytest.approx(6.8972206, rel=2e-5)
    assert c["kld_mean"] == pytest.approx(direct["kld"].mean().item(), rel=1e-6)
    assert c["kld_p99"] == pytest.approx(torch.quantile(direct["kld"], 0.99).item(), rel=1e-5)
    assert c["kld_max"] == pytest.approx(direct["kld"].max().item(), rel=1e-5)
    assert c["p_diff_mean"] == pytest.approx(direct["p_diff"].mean().item(), rel=1e-5)
    assert c["same_top"] == pytest.approx(direct["same"].double().mean().item(), abs=1.5 / 1882)
    assert r["quant"]["name"] == "int4" and r["reference_quant"] is None


def test_reference_in_float64_against_a_float32_run(compose):
    require_shared()
    r = evaluate(compose(*DATA, "compare=unquantized", "compare.reference.dtype=float64", "eval.seq_len=128"))
    c = r["compare"]
    assert 0.0 < c["kld_mean"] < 1e-9 and c["same_top"] > 0.999
    assert c["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_reference_dtype_that_a_true_precision_would_cast_is_refused(compose):
    require_shared()
    with pytest.raises(ValueError, match="cannot hold under precision=64-true"):
        evaluate(compose(*DATA, "compare=unquantized", "compare.reference.dtype=float32", "precision=64-true"))


def test_token_stats_do_not_depend_on_the_chunk_size():
    torch.manual_seed(0)
    # float64 throughout, so a chunk's matmul cannot round differently from the full one's.
    h, hb = torch.randn(37, 8, dtype=torch.float64), torch.randn(37, 8, dtype=torch.float64)
    head, head_b = (torch.nn.Linear(8, 50, bias=False).double().requires_grad_(False) for _ in range(2))
    targets = torch.randint(0, 50, (37,))
    full = token_stats(h, hb, targets, head, head_b, chunk_size=37)
    for chunk in (1, 7):
        part = token_stats(h, hb, targets, head, head_b, chunk_size=chunk)
        for key, value in full.items():
            assert torch.allclose(part[key].double(), value.double(), rtol=1e-12, atol=1e-15), (chunk, key)
    lq, lp = head(h).double().log_softmax(-1), head_b(hb).double().log_softmax(-1)
    ref = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(full["kld"], ref, rtol=1e-10)


def test_percentiles_are_llama_cpp_linear_interpolation():
    values = torch.rand(1001, dtype=torch.float64).sort().values
    for p in (0.1, 1.0, 5.0, 50.0, 90.0, 99.9):
        assert percentile(values, p) == pytest.approx(torch.quantile(values, p / 100).item(), rel=1e-12)
    metric = KLDivergence()
    z = torch.zeros(4, dtype=torch.float64)
    metric.update(z, z, z, z, torch.ones(4, dtype=torch.bool))
    metric.update(z[:0], z[:0], z[:0], z[:0], torch.ones(0, dtype=torch.bool))  # an empty padding batch
    out = metric.compute()
    assert out["tokens"] == 4 and out["kld_mean"] == 0.0 and out["same_top"] == 1.0
