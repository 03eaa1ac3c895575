"""Deterministic mode's exact sums: the same bits in any order, an error (never a wrap-around) past their range."""

from __future__ import annotations

import pytest
import torch

from lit_ppl.metrics.exact import HI_LIMIT, VALUE_LIMIT, FixedPointOverflow, limbs, value
from lit_ppl.metrics.perplexity import NLLBreakdown, Perplexity


def test_limbs_hold_the_value_rounded_to_2_pow_minus_40():
    x = torch.tensor([0.0, 1e-13, 3.25, -2.5, 2047.9, 1 / 3], dtype=torch.float64)
    hi, lo, bad = limbs(x)
    assert not bad.any() and (lo >= 0).all() and (lo < 2**32).all()
    assert value(hi, lo).tolist() == (torch.round(x * 2**40) / 2**40).tolist()
    assert limbs(torch.tensor([VALUE_LIMIT, float("nan"), -VALUE_LIMIT]))[2].tolist() == [True, True, True]


def test_perplexity_sums_are_the_same_in_any_order_and_any_split():
    nll = torch.rand(10_000, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 12
    one = Perplexity(exact=True)
    one.update(nll)
    shards = [Perplexity(exact=True) for _ in range(3)]
    for i, chunk in enumerate(torch.randperm(len(nll)).split(777)):  # other batches, other order, three "ranks"
        shards[i % 3].update(nll[chunk])
    for s in shards[1:]:
        shards[0].merge_state(s)  # what the all-reduce of sum states does
    a, b = one.compute(), shards[0].compute()
    assert a["nll_sum"].item() == b["nll_sum"].item() and a["nll_stderr"].item() == b["nll_stderr"].item()
    assert a["nll_sum"].item() == pytest.approx(nll.double().sum().item(), rel=1e-12)


def test_breakdown_is_exact_too():
    nll = torch.rand(500, generator=torch.Generator().manual_seed(1)) * 5
    docs, pos = torch.randint(0, 3, (500,)), torch.randint(0, 8, (500,))
    whole, parts = NLLBreakdown(3, 8, exact=True), NLLBreakdown(3, 8, exact=True)
    whole.update(nll, docs, pos)
    order = torch.randperm(500)
    for chunk in order.split(64):
        parts.update(nll[chunk], docs[chunk], pos[chunk])
    for key, v in whole.compute().items():
        assert torch.equal(v, parts.compute()[key]), key


def test_set_dtype_keeps_the_integer_limbs():
    m = Perplexity(exact=True)
    m.set_dtype(torch.float64)
    m.update(torch.tensor([1.5]))
    assert m.nll_sum_hi.dtype == m.nll_sum_lo.dtype == torch.int64
    assert m.compute()["nll_sum"].item() == 1.5


def test_overflow_is_an_error_not_a_wrap_around():
    m = Perplexity(exact=True)
    m.update(torch.tensor([1.0, 3000.0]))  # its square is past 2^22
    with pytest.raises(FixedPointOverflow, match=r"1 values or sums left the range of eval\.deterministic=true"):
        m.compute()
    big = Perplexity(exact=True)
    big.nll_sum_hi += HI_LIMIT - 1  # a rank that summed 2^44 nats
    big.update(torch.tensor([2000.0]))
    with pytest.raises(FixedPointOverflow):
        big.compute()
