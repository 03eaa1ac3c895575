"""Candidate-vs-reference comparison (llama.cpp's KL-divergence report) on the real stories260K."""

from __future__ import annotations

import contextlib
import doctest
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import STORIES, TINYSTORIES, require_shared

from lit_ppl.data.datamodule import PerplexityDataModule, WindowCollator
from lit_ppl.data.sources import DataSpec
from lit_ppl.errors import LitPplError
from lit_ppl.evaluation import noise_floor
from lit_ppl.evaluation.compare import CompareModule
from lit_ppl.metrics import histogram
from lit_ppl.metrics.kl import HISTOGRAMS, PERCENTILES, KLDivergence, token_stats
from lit_ppl.model.scorer import TokenScorer
from lit_ppl.model.spec import ModelSpec
from lit_ppl.quant import quantizer as quantize
from lit_ppl.run import evaluate

ALPHA = 1e-3  # the histograms' relative error bound (lit_ppl.metrics.histogram)
DATA = ["model=hf", f"model.path={STORIES}", "data=text", f"data.path={TINYSTORIES}", "trainer=cpu"]


def test_model_against_itself(compose):
    require_shared()
    r = evaluate(compose(*DATA, "compare=unquantized", "compare.noise_floor=0"))
    c = r["compare"]
    assert c["noise_floor"] is None  # 0 windows: not measured, no float64 copy built
    assert c["tokens"] == r["tokens"] == 1882
    assert c["kld_mean"] == 0.0 and c["kld_max"] == 0.0 and c["p_diff_rms"] == 0.0
    assert c["kld_rev_mean"] == 0.0 and c["kld_rev_max"] == 0.0
    assert all(b["kld_mean"] in (0.0, None) and b["same_top"] in (1.0, None) for b in c["kld_by_top_p"])
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
    kld, kld_rev, top_p, p_diff, same = [], [], [], [], []
    for batch in dm.val_dataloader():
        ids, idx, tgt = batch["input_ids"], batch["score_index"], batch["targets"]
        with torch.no_grad():
            lq = cand(ids).logits.reshape(-1, 512).index_select(0, idx).double().log_softmax(-1)
            lp = base(ids).logits.reshape(-1, 512).index_select(0, idx).double().log_softmax(-1)
        kld.append((lp.exp() * (lp - lq)).sum(-1))
        kld_rev.append((lq.exp() * (lq - lp)).sum(-1))
        top_p.append(lp.exp().max(-1).values)
        p_diff.append(lq.gather(1, tgt[:, None])[:, 0].exp() - lp.gather(1, tgt[:, None])[:, 0].exp())
        same.append(lq.argmax(-1) == lp.argmax(-1))
    return {
        "kld": torch.cat(kld),
        "kld_rev": torch.cat(kld_rev),
        "top_p": torch.cat(top_p),
        "p_diff": torch.cat(p_diff),
        "same": torch.cat(same),
    }


def test_int4_against_unquantized_matches_a_direct_float64_computation(compose):
    require_shared()
    r = evaluate(compose(*DATA, "quant=int4", "quant.group_size=32", "compare=unquantized", "eval.chunk_size=100"))
    c, direct = r["compare"], direct_float64(quantized=True)
    assert c["tokens"] == direct["kld"].numel() == 1882
    assert c["kld_mean"] > 0.01 and c["same_top"] < 0.95 and c["ppl_ratio"] > 1.0
    assert c["ppl"] == pytest.approx(r["ppl"], rel=1e-12) and c["ppl_base"] == pytest.approx(6.8972206, rel=2e-5)
    assert c["kld_mean"] == pytest.approx(direct["kld"].mean().item(), rel=1e-6)
    # A histogram percentile (bound 0.1%, below) on top of the float32 run's own 1e-5.
    assert c["kld_p99"] == pytest.approx(torch.quantile(direct["kld"], 0.99).item(), rel=ALPHA + 1e-5)
    assert c["kld_max"] == pytest.approx(direct["kld"].max().item(), rel=1e-5)
    assert c["p_diff_mean"] == pytest.approx(direct["p_diff"].mean().item(), rel=1e-5)
    assert c["same_top"] == pytest.approx(direct["same"].double().mean().item(), abs=1.5 / 1882)
    assert r["quant"]["name"] == "int4" and r["reference_quant"] is None
    floor = c["noise_floor"]  # 1882 tokens in 4 windows: the sample is all of them
    assert floor["windows"] == 4 and floor["tokens"] == 1882 and floor["precision"] == "32-true"
    assert 0 < floor["kld_mean"] < 1e-9 and floor["same_top"] == 1.0
    rev = direct["kld_rev"]
    assert c["kld_rev_mean"] == pytest.approx(rev.mean().item(), rel=1e-6) and c["kld_rev_mean"] != c["kld_mean"]
    assert c["kld_rev_p99"] == pytest.approx(torch.quantile(rev, 0.99).item(), rel=ALPHA + 1e-5)
    assert c["kld_rev_max"] == pytest.approx(rev.max().item(), rel=1e-5)
    # Buckets of the reference's top-1 probability, from the full float64 distributions.
    edges = torch.tensor([0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    bucket = torch.bucketize(direct["top_p"], edges, right=True)
    assert [b["tokens"] for b in c["kld_by_top_p"]] == torch.bincount(bucket, minlength=5).tolist()
    assert min(b["tokens"] for b in c["kld_by_top_p"]) > 0  # stories260K is unsure and sure in every bucket
    for i, b in enumerate(c["kld_by_top_p"]):
        mine = bucket == i
        assert b["kld_mean"] == pytest.approx(direct["kld"][mine].mean().item(), rel=1e-5)
        assert b["kld_rev_mean"] == pytest.approx(rev[mine].mean().item(), rel=1e-5)
        assert b["same_top"] == pytest.approx(direct["same"][mine].double().mean().item(), abs=1.5 / int(mine.sum()))
    hist = c["kld_histogram"]
    assert sum(hist["counts"]) + hist["below"] + hist["above"] == 1882
    assert len(hist["edges"]) == len(hist["counts"]) + 1 and hist["edges"][0] <= direct["kld"].max()


def test_reference_in_float64_against_a_float32_run(compose):
    require_shared()
    r = evaluate(compose(*DATA, "compare=unquantized", "compare.reference.dtype=float64", "eval.seq_len=128"))
    c = r["compare"]
    assert 0.0 < c["kld_mean"] < 1e-9 and c["same_top"] > 0.999
    assert c["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    # A float64 reference re-scored in float64: the same operations on the same windows, so no noise at all.
    floor = c["noise_floor"]
    assert floor["kld_mean"] == floor["kld_max"] == 0.0 and floor["precision"] == "32-true, reference float64"


def test_noise_floor_in_bf16_is_the_references_rounding(compose, tmp_path, capsys):
    """bf16-true: the noise floor is KL(float64 ‖ bf16) of the sampled windows, as the models' own forwards give it,
    well above 0 and below an int4 candidate's KLD."""
    require_shared()
    bf16 = ("precision=bf16-true", "quant=int4", "quant.group_size=32", "eval.seq_len=128")
    c = evaluate(compose(*DATA, *bf16, "compare=unquantized", "compare.noise_floor=3"))["compare"]
    floor = c["noise_floor"]
    assert floor["windows"] == 3 and floor["precision"] == "bf16-true" and floor["source"] == "live"
    assert 1e-4 < floor["kld_mean"] < c["kld_mean"] / 5 and floor["same_top"] < 1.0
    shown = f"{floor['kld_mean']:.3g} ± {floor['kld_mean_unc']:.2g}"  # the summary's row and report.html's
    assert shown in capsys.readouterr().out and f"{shown} · 3 windows" in (tmp_path / "out" / "report.html").read_text()
    spec = ModelSpec(path=str(STORIES))
    dm = PerplexityDataModule(DataSpec(path=str(TINYSTORIES)), spec.tokenizer(), mode="rolling", seq_len=128)
    dm.setup()
    ids = noise_floor.sample_windows(dm.first_token, 3)
    assert len(ids) == 3 and ids[0] == 0 and ids[-1] == len(dm.windows) - 1  # spread over the whole corpus
    batch = WindowCollator(dm.corpus, dm.windows, first_token=dm.first_token)(ids.tolist())
    inputs, index = batch["input_ids"], batch["score_index"]
    with torch.no_grad():  # bf16-true's plugin casts the whole module: RoPE's inv_freq buffer too (+10% KLD here)
        models = (spec.build(torch.float64), spec.build(torch.bfloat16).to(torch.bfloat16))
        lp, lq = (m(inputs).logits.flatten(0, 1)[index].double().log_softmax(-1) for m in models)
    kld = (lp.exp() * (lp - lq)).sum(-1)
    assert floor["tokens"] == kld.numel()
    assert floor["kld_mean"] == pytest.approx(kld.mean().item(), rel=1e-9)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_statistics_streamed_over_two_heads_blocks_equal_the_whole_rows(dtype):
    g = torch.Generator().manual_seed(3)
    vocab, n = 97, 41
    w, v = torch.randn(vocab, 16, generator=g, dtype=dtype), torch.randn(vocab, 12, generator=g, dtype=dtype)
    w[60:] *= 6  # the running maxima rise in later blocks: the sums are rescaled
    v[50:52] = v[90:92] = 3 * v[50:52]  # tied largest logits: the first column must win, as argmax's
    h, hb = torch.randn(n, 16, generator=g, dtype=dtype), torch.randn(n, 12, generator=g, dtype=dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    # Misaligned blocks, one of a single column: every piece where one block of each overlaps.
    cuts = ([0, 30, 31, 64], [0, 11, 50, 90])
    blocks = tuple(
        [(a, lambda x, a=a, b=b, m=m: x @ m[a:b].T) for a, b in zip(c, [*c[1:], vocab], strict=True)]
        for c, m in zip(cuts, (w, v), strict=True)
    )
    full = token_stats(h, hb, targets, lambda x: x @ w.T, lambda x: x @ v.T, chunk_size=n)
    got = token_stats(h, hb, targets, None, None, chunk_size=9, blocks=blocks)
    tol = 1e-9 if dtype == torch.float64 else 1e-5  # a block's float32 matmul rounds apart from the whole one's
    for key, value in full.items():
        assert torch.allclose(got[key].double(), value.double(), rtol=tol, atol=tol * 1e-3), key
    assert torch.equal(got["same_top"], full["same_top"]) and not got["same_top"].all()
    # Against itself: KL exactly 0, both ways; one head's blocks given for both (each called once for both sides).
    same = token_stats(h, h, targets, None, None, chunk_size=9, blocks=(blocks[0], list(blocks[0])))
    assert not same["kld"].any() and not same["kld_rev"].any() and same["same_top"].all()
    other = torch.randn(n, 16, generator=g, dtype=dtype)
    shared = token_stats(h, other, targets, None, None, chunk_size=9, blocks=(blocks[0], blocks[0]))
    apart = token_stats(h, other, targets, None, None, chunk_size=9, blocks=(blocks[0], list(blocks[0])))
    for key, value in apart.items():
        assert torch.allclose(shared[key].double(), value.double(), rtol=tol, atol=tol * 1e-3), key
    short = (blocks[0], blocks[1][:-1])
    with pytest.raises(LitPplError, match="vocabulary"):
        token_stats(h, hb, targets, None, None, chunk_size=9, blocks=short)


def test_each_head_runs_inside_its_own_models_forward():
    """FSDP2 gathers a root's head in its pre-forward hook and frees it in its post-forward hook: a comparison step
    must run both heads inside their models' forwards (forward hooks like FSDP's show where they ran)."""
    spec = ModelSpec()  # the built-in model: no files needed
    module = CompareModule(spec, spec, chunk_size=5)
    module.scorer, module.reference = (TokenScorer(spec.build(), 5) for _ in range(2))
    inside: dict[str, bool] = {}
    heads_ran_inside: list[tuple[str, bool]] = []
    for name, scorer in (("candidate", module.scorer), ("reference", module.reference)):
        scorer.register_forward_pre_hook(lambda mod, args, name=name: inside.__setitem__(name, True))
        scorer.register_forward_hook(lambda mod, args, out, name=name: inside.__setitem__(name, False))
        head = scorer.head

        def watched(hidden: torch.Tensor, head=head, name=name) -> torch.Tensor:
            heads_ran_inside.append((name, inside.get(name, False)))
            return head(hidden)

        scorer.head = watched
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (2, 16), generator=g)
    index, targets = torch.arange(3, 32), torch.randint(0, 258, (29,), generator=g)
    with torch.no_grad():
        nll = module.score({"input_ids": ids, "score_index": index, "targets": targets})
        plain = module.scorer(ids, index, targets)  # the NLL path of a run without a reference
    assert {name for name, _ in heads_ran_inside} == {"candidate", "reference"}
    assert all(ran_inside for _, ran_inside in heads_ran_inside), heads_ran_inside
    assert not any(inside.values())  # both forwards have returned: FSDP would have resharded both roots
    assert int(module.kl.count) == 29 and torch.allclose(nll.float(), plain, rtol=1e-5)


def feed(metrics: list[KLDivergence], kld: torch.Tensor, p_diff: torch.Tensor, batch: int) -> None:
    """Deal batches of ``batch`` tokens round-robin to ``metrics`` (the "ranks"), as the sampler would."""
    for i, start in enumerate(range(0, kld.numel(), batch)):
        part = slice(start, start + batch)
        nll = -torch.log1p(kld[part])  # any finite NLLs: the percentiles do not read them
        k, same = kld[part], torch.ones_like(nll, dtype=torch.bool)
        top_p = torch.exp(-k)  # in (0, 1]: every bucket of the reference's top-1 probability gets tokens
        metrics[i % len(metrics)].update(nll, nll, k, 2 * k, p_diff[part], same, top_p)


def merged(kld: torch.Tensor, p_diff: torch.Tensor, ranks: int, batch: int, exact: bool = False) -> KLDivergence:
    """The metric of ``ranks`` instances fed round-robin and merged as a sync would (sum, min, max per state)."""
    metrics = [KLDivergence(exact=exact) for _ in range(ranks)]
    feed(metrics, kld, p_diff, batch)
    for other in metrics[1:]:
        metrics[0].merge_state(other)
    return metrics[0]


def sample(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Lognormal KLDs (with exact zeros) and uniform Δp in [-1, 1] (with exact zeros), float64."""
    g = torch.Generator().manual_seed(seed)
    kld = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 3.0 - 5.0)
    kld[torch.randperm(n, generator=g)[: n // 100]] = 0.0  # a model that agrees exactly on 1% of tokens
    p_diff = torch.rand(n, generator=g, dtype=torch.float64) * 2.0 - 1.0
    p_diff[torch.randperm(n, generator=g)[: n // 50]] = 0.0
    return kld, p_diff


def test_histogram_percentiles_are_within_the_stated_bound():
    kld, p_diff = sample(300_001)
    out = merged(kld, p_diff, ranks=2, batch=4096).compute()
    assert out["tokens"] == kld.numel()
    assert out["kld_mean"] == pytest.approx(kld.mean().item(), rel=1e-12)  # the sums stay exact
    for name, values in (("kld", kld), ("kld_rev", 2 * kld), ("p_diff", p_diff)):
        v = np.sort(values.numpy())
        assert out[f"{name}_min"] == v[0] and out[f"{name}_max"] == v[-1]  # exact endpoints
        pcts = [float(k.removeprefix(f"{name}_p")) for k in out if k.startswith(f"{name}_p") and k[-1].isdigit()]
        assert len(pcts) >= 9
        for p in pcts:
            exact = np.percentile(v, p, method="linear")  # llama.cpp's: linear at p/100·(n−1)
            pos = p / 100 * (v.size - 1)
            neighbours = max(abs(v[math.floor(pos)]), abs(v[math.ceil(pos)]))
            # α of the neighbouring sorted values (relative to the percentile when they share a sign), or the
            # underflow threshold below it; 1e-9 for rounding at a bin edge.
            bound = ALPHA * (1 + 1e-9) * neighbours + HISTOGRAMS[name].low
            assert abs(out[f"{name}_p{p:g}"] - exact) <= bound, (name, p, out[f"{name}_p{p:g}"], exact)
            if name != "p_diff" and v[math.floor(pos)] > 0:
                assert out[f"{name}_p{p:g}"] == pytest.approx(exact, rel=ALPHA * (1 + 1e-9))


def test_histogram_state_does_not_grow_with_the_tokens():
    metric = KLDivergence()
    size = metric.state_bytes()
    assert size == 626_696  # about 630 KB per rank, whatever the corpus
    kld, p_diff = sample(200_000, seed=1)
    feed([metric], kld, p_diff, batch=10_000)
    assert metric.state_bytes() == size
    assert all(isinstance(v, torch.Tensor) for v in metric.metric_state.values())  # no per-token lists


@pytest.mark.parametrize("exact", [False, True])
def test_histogram_counts_are_the_same_at_any_world_size(exact):
    kld, p_diff = sample(50_000, seed=2)
    one = merged(kld, p_diff, ranks=1, batch=50_000, exact=exact)
    for ranks, batch in ((2, 1000), (3, 777), (8, 64)):
        many = merged(kld, p_diff, ranks=ranks, batch=batch, exact=exact)
        for name in HISTOGRAMS:
            for state in ("counts", "lowest", "highest"):
                assert torch.equal(getattr(many, f"{name}_{state}"), getattr(one, f"{name}_{state}")), (ranks, state)
            assert getattr(many, f"{name}_counts").dtype == torch.int64
        a, b = many.compute(), one.compute()
        read_back = [k for k in a if k.startswith(("kld_p", "kld_rev_p", "p_diff_p")) or k.endswith(("_min", "_max"))]
        assert len(read_back) == 35 and {k: a[k] for k in read_back} == {k: b[k] for k in read_back}
        assert a["kld_by_top_p"] == b["kld_by_top_p"] if exact else _close(a["kld_by_top_p"], b["kld_by_top_p"])
        assert a["kld_histogram"] == b["kld_histogram"]  # integer counts
        if exact:  # deterministic mode: the whole report is bit-identical
            assert a == b


def _close(a: list[dict], b: list[dict]) -> bool:
    """Two ``kld_by_top_p`` lists equal in counts and within float64 rounding in means."""
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in ("top_p", "tokens", "share")} == {k: y[k] for k in ("top_p", "tokens", "share")}
        for k in ("kld_mean", "kld_rev_mean", "same_top"):
            assert x[k] == pytest.approx(y[k], rel=1e-12)
    return True


def test_buckets_of_the_reference_top_1_probability():
    """Tokens in [0, .25), [.25, .5), [.5, .75), [.75, .95), [.95, 1]: counts, means both ways, top-1 agreement."""
    metric = KLDivergence()
    top_p = torch.tensor([0.1, 0.25, 0.3, 0.6, 0.8, 0.94, 0.95, 1.0], dtype=torch.float64)
    kld = torch.arange(1, 9, dtype=torch.float64) / 10
    same = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    z = torch.zeros(8, dtype=torch.float64)
    metric.update(z, z, kld, 3 * kld, z, same, top_p)
    got = metric.compute()["kld_by_top_p"]
    assert [b["top_p"] for b in got] == [[0.0, 0.25], [0.25, 0.5], [0.5, 0.75], [0.75, 0.95], [0.95, 1.0]]
    assert [b["tokens"] for b in got] == [1, 2, 1, 2, 2] and sum(b["share"] for b in got) == 1.0
    for b, want in zip(got, ([0.1], [0.2, 0.3], [0.4], [0.5, 0.6], [0.7, 0.8]), strict=True):
        assert b["kld_mean"] == pytest.approx(np.mean(want), rel=1e-15)
        assert b["kld_rev_mean"] == pytest.approx(3 * np.mean(want), rel=1e-15)
    assert [b["same_top"] for b in got] == [1.0, 0.5, 1.0, 0.5, 1.0]


def test_counts_stay_int64_through_set_dtype():
    metric = KLDivergence()
    metric.set_dtype(torch.float64)  # what the module does after a precision plugin's cast
    assert metric.kld_counts.dtype == metric.p_diff_counts.dtype == torch.int64
    assert metric.kld_lowest.dtype == torch.float64


def test_percentiles_of_few_values_and_an_empty_batch():
    metric = KLDivergence()
    z = torch.zeros(4, dtype=torch.float64)
    metric.update(z, z, z, z, z, torch.ones(4, dtype=torch.bool), z + 1)
    metric.update(z[:0], z[:0], z[:0], z[:0], z[:0], torch.ones(0, dtype=torch.bool), z[:0])  # an empty padding batch
    out = metric.compute()
    assert out["tokens"] == 4 and out["kld_mean"] == 0.0 and out["same_top"] == 1.0
    assert out["kld_max"] == out["kld_p99.9"] == out["p_diff_p50"] == out["p_diff_min"] == 0.0
    one = KLDivergence()
    x = torch.tensor([0.25], dtype=torch.float64)
    one.update(x, x, x, x, -x, torch.ones(1, dtype=torch.bool), x)
    out = one.compute()
    assert out["kld_p50"] == out["kld_min"] == 0.25 and out["p_diff_p99"] == -0.25  # one value: exact


def test_histogram_bins_and_doctests():
    bins = HISTOGRAMS["p_diff"]
    values = [-2.0, -1.0, -0.5, -1e-16, 0.0, 1e-16, 1e-15, 0.5, 1.0, 2.0, float("inf"), float("nan")]
    idx = bins.index(torch.tensor(values, dtype=torch.float64))
    assert idx.tolist() == sorted(idx.tolist())
    assert idx[0] == 0 and idx[1] > 0 and idx[8] < idx[9] == idx[10] == idx[11] == bins.size - 1  # ±1 has a bin
    assert idx[3] == idx[4] == idx[5] == bins.per_side + 1  # |Δp| < 1e-15: the underflow bin
    points = bins.points()
    assert torch.all(points[1:] > points[:-1])
    assert doctest.testmod(histogram).failed == 0
    with pytest.raises(ValueError, match="needs 0 < low < high"):
        histogram.LogBins(low=1.0, high=0.5)


def exact_range_sample() -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample`'s KLDs within what exact sums hold: a reverse KLD (fed as twice the KLD) squared stays below
    2^22 (KLDs of a thousand nats and more are a broken model, which the exact sums refuse in one line)."""
    kld, p_diff = sample(40_000, seed=3)
    return kld.clamp(max=1000.0), p_diff


def _sync_worker(rank: int, store: str, out: str) -> None:
    """One gloo rank: its round-robin share of the batches, then the metric's own sync in compute()."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    kld, p_diff = exact_range_sample()
    results = {}
    for exact in (False, True):
        both = [KLDivergence(exact=exact), KLDivergence(exact=exact)]
        feed(both, kld, p_diff, batch=999)  # this rank keeps its share only
        mine = both[rank]
        counts = mine.kld_counts.clone()
        results[exact] = (mine.compute(), counts)
        assert torch.equal(mine.kld_counts, counts)  # unsync() restored the local state
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_histograms_sync_across_two_gloo_ranks(tmp_path):
    """A real all-reduce sync (sum, min, max) gives what one process gets from all the tokens."""
    import torch.multiprocessing as mp

    out = tmp_path / "result"
    mp.start_processes(_sync_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1))
    kld, p_diff = exact_range_sample()
    for exact in (False, True):
        single = merged(kld, p_diff, ranks=1, batch=999, exact=exact).compute()
        assert r0[exact][0] == r1[exact][0]  # every rank reports the same
        got = r0[exact][0]
        read_back = [k for k in got if k.startswith(("kld_p", "kld_rev_p", "p_diff_p")) or k.endswith(("_min", "_max"))]
        expected = sum(len(p) + 2 for p in PERCENTILES.values())  # each name's percentiles, min and max
        assert len(read_back) == expected and {k: got[k] for k in read_back} == {k: single[k] for k in read_back}
        assert got["tokens"] == 40_000 and got["kld_mean"] == pytest.approx(single["kld_mean"], rel=1e-12)
        if exact:
            assert got == single
        assert int(r0[exact][1].sum()) + int(r1[exact][1].sum()) == 40_000  # each rank held only its share


def test_a_float64_copy_that_does_not_fit_is_not_built(monkeypatch):
    """The noise floor's float64 copy past the memory budget: not measured, and the note says why (nothing built)."""
    scorer = TokenScorer(ModelSpec().build(), 5)  # the built-in model: no files needed
    strategy = SimpleNamespace(reduce_boolean_decision=lambda fits, all: fits)
    module = SimpleNamespace(device=torch.device("cpu"), global_rank=0, trainer=SimpleNamespace(strategy=strategy))
    reference = noise_floor.Reference(ModelSpec(), scorer, contextlib.nullcontext, "32-true")
    monkeypatch.setattr(noise_floor, "default_budget", lambda device: 1000)
    got = noise_floor.measure(module, reference, 4)
    needed = sum(p.numel() for p in scorer.parameters()) * 8 / 2**30
    assert got["kld_mean"] is None and f"{needed:.3g} GiB needed, {1000 / 2**30:.3g} GiB free" in got["note"]
    assert noise_floor.measure(module, reference, 0) is None
