import numpy as np
import pytest

from lit_ppl.sampler import PAD, ExactBatchSampler, plan_batches, shard_by_tokens


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_window_on_exactly_one_rank_and_tokens_balanced(world):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 512, size=101)
    shards = shard_by_tokens(lengths, world)
    assert sorted(np.concatenate(shards).tolist()) == list(range(101))
    loads = [int(lengths[s].sum()) for s in shards]
    assert max(loads) - min(loads) <= lengths.max()  # greedy longest-first bound


@pytest.mark.parametrize("world,batch", [(2, 1), (3, 3), (4, 8), (8, 2)])
def test_same_number_of_steps_on_every_rank_padding_scores_nothing(world, batch):
    lengths = np.array([512] * 5 + [7, 3])
    plan = plan_batches(lengths, world, batch)
    assert len({len(p) for p in plan}) == 1
    real = [i for p in plan for b in p for i in b if i != PAD]
    assert sorted(real) == list(range(len(lengths)))
    assert all(b == [PAD] for p in plan for b in p if PAD in b)


def test_deterministic_and_global_rank_based():
    lengths = np.array([5, 1, 4, 2, 3, 3])
    a = [list(ExactBatchSampler(lengths, r, 3, 2)) for r in range(3)]
    b = [list(ExactBatchSampler(lengths.copy(), r, 3, 2)) for r in range(3)]
    assert a == b
    with pytest.raises(ValueError, match="rank 3"):
        ExactBatchSampler(lengths, 3, 3, 2)


def test_fewer_windows_than_ranks():
    plan = plan_batches(np.array([10, 20]), 4, 8)
    assert plan == [[[1]], [[0]], [[PAD]], [[PAD]]]


def test_skip_resumes_after_done_batches():
    lengths = np.arange(1, 20)
    full = list(ExactBatchSampler(lengths, 1, 2, 3))
    assert list(ExactBatchSampler(lengths, 1, 2, 3, skip=2)) == full[2:]
