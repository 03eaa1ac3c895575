"""batch_size=auto: the search, the CPU probe under a real memory budget, and the cache."""

import json

import pytest
import torch

from lit_ppl.data.autobatch import auto_batch_size, largest_fitting, probe_peak_bytes
from lit_ppl.model.scorer import TokenScorer
from lit_ppl.model.spec import ModelSpec

SEQ = 256


@pytest.mark.parametrize("limit", [1, 2, 3, 37, 64, 100])
def test_search_finds_the_largest_fitting_batch(limit):
    asked = []

    def fits(b):
        asked.append(b)
        return b <= limit

    assert largest_fitting(fits, max_batch=100) == limit
    assert len(asked) <= 16  # doubling then bisection, not a scan


def test_nothing_fits():
    assert largest_fitting(lambda b: False, 64) == 0


@pytest.fixture(scope="module")
def scorer():
    # The built-in model with a wide head: one window's float32 logits are SEQ × 32000 × 4 B = 31 MiB.
    lm = ModelSpec(hidden_size=64, num_layers=1, num_heads=2, max_positions=SEQ).build()
    lm.resize_token_embeddings(32000)
    return TokenScorer(lm, chunk_size=4096)


def test_cpu_peak_is_measured_for_real(scorer):
    big = torch.zeros(64, 2**20)  # noqa: F841 - resident before the probe: not counted
    one = probe_peak_bytes(lambda: torch.ones(2**22).sum(), torch.device("cpu"))  # 16 MiB
    assert 12 * 2**20 < one < 40 * 2**20


def test_cpu_budget_forces_a_small_batch_and_is_cached(scorer, tmp_path):
    cache = tmp_path / "autobatch.json"
    kw = dict(model="builtin-32k", precision="32-true", chunk_size=4096, cache=cache, max_batch=64)
    # Each window needs ~31 MiB of logits (the loss works in place): a 0.2 GiB budget fits at most 6.
    b = auto_batch_size(scorer, SEQ, max_memory_gb=0.2, **kw)
    assert 1 <= b <= 6
    roomy = auto_batch_size(scorer, SEQ, max_memory_gb=2.0, **kw)
    assert roomy > b
    entries = json.loads(cache.read_text())
    assert sorted(entries.values()) == sorted([b, roomy])
    key = next(k for k, v in entries.items() if v == b)
    assert json.loads(key)["seq_len"] == SEQ and json.loads(key)["device"] == "cpu"
    # A cache hit does not probe: a scorer that would fail is never called.
    broken = torch.nn.Linear(1, 1)  # has a parameter (for the device) but cannot score
    assert auto_batch_size(broken, SEQ, max_memory_gb=0.2, **kw) == b


def test_budget_below_one_window_is_a_clear_error(scorer, tmp_path):
    with pytest.raises(ValueError, match="does not fit"):
        auto_batch_size(scorer, SEQ, model="m", precision="32-true", chunk_size=4096, max_memory_gb=0.001, cache=None)
