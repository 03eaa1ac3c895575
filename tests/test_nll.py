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
