import pytest
import torch
import torch.nn.functional as F

from lit_ppl.model.nll import chunked_nll


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_equals_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 97, bias=False)
    hidden, targets = torch.randn(53, 32, generator=g), torch.randint(0, 97, (53,), generator=g)
    full = F.cross_entropy(head(hidden), targets, reduction="none")
    out = chunked_nll(hidden, targets, head, chunk_size=chunk)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, full, rtol=1e-6, atol=0)


def test_low_precision_hidden_states_are_scored_in_float32():
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    hidden, targets = torch.randn(9, 16, dtype=torch.bfloat16), torch.randint(0, 40, (9,))
    out = chunked_nll(hidden, targets, head, chunk_size=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.cross_entropy(head(hidden).float(), targets, reduction="none"))


def test_float64_stays_float64():
    head = torch.nn.Linear(8, 11, bias=False).double()
    hidden, targets = torch.randn(5, 8, dtype=torch.float64), torch.randint(0, 11, (5,))
    out = chunked_nll(hidden, targets, head, chunk_size=2)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, F.cross_entropy(head(hidden), targets, reduction="none"), rtol=1e-14, atol=0)


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_nll(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), torch.nn.Linear(2, 3), chunk_size=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_loss_streamed_over_blocks_of_columns_equals_the_whole_rows(dtype):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(97, 32, generator=g, dtype=dtype)
    weight[40:] *= 8  # later blocks hold the larger logits: the running maximum rises and the sum is rescaled
    hidden, targets = torch.randn(53, 32, generator=g, dtype=dtype), torch.randint(0, 97, (53,), generator=g)
    starts = [0, 30, 31, 60]  # uneven, one of a single column
    blocks = [(a, lambda h, a=a, b=b: h @ weight[a:b].T) for a, b in zip(starts, [*starts[1:], 97], strict=True)]
    full = F.cross_entropy(hidden @ weight.T, targets, reduction="none")
    out = chunked_nll(hidden, targets, None, chunk_size=7, blocks=blocks)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-13  # absolute too: a target far above the rest has an NLL near 0
    torch.testing.assert_close(out, full, rtol=tol, atol=tol)
    assert chunked_nll(hidden[:0], targets[:0], None, blocks=blocks).shape == (0,)
