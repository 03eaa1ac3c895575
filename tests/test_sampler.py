import numpy as np
import pytest

from lit_ppl.data.sampler import PAD, ExactBatchSampler, global_batches, plan_batches


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_window_on_exactly_one_rank_and_tokens_balanced(world):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 512, size=101)
    shards = [[i for b in batches for i in b if i != PAD] for batches in plan_batches(lengths, world, 4)]
    assert sorted(i for s in shards for i in s) == list(range(101))
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


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_deterministic_plan_hands_out_the_same_batches_at_every_world_size(world):
    lengths = np.random.default_rng(1).integers(1, 512, size=53)
    plan = plan_batches(lengths, world, 5, deterministic=True)
    assert len({len(p) for p in plan}) == 1
    batches = sorted(b for p in plan for b in p if b != [PAD])
    assert batches == sorted(global_batches(lengths, 5))  # whole batches, formed without the world size


def test_weights_move_the_shares_and_spread_the_padding():
    lengths = np.full(40, 100)
    for deterministic in (False, True):
        plan = plan_batches(lengths, 2, 2, weights=[1.0, 0.25], deterministic=deterministic)
        real = [sum(len(b) for b in p if b != [PAD]) for p in plan]
        assert sorted(i for p in plan for b in p for i in b if i != PAD) == list(range(40))
        assert real[0] == pytest.approx(4 * real[1], rel=0.15)
        slow = [b != [PAD] for b in plan[1]]
        assert slow[0] and not all(slow[: len(slow) // 2]), "the slow rank's padding is spread, not all at the end"
    # Without deterministic mode the slow rank also gets smaller batches: every step costs both ranks alike.
    plan = plan_batches(lengths, 2, 4, weights=[1.0, 0.25])
    assert {len(b) for b in plan[0]} == {4} and {len(b) for b in plan[1] if b != [PAD]} == {1}


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match=r"rank weights \[1.0\] must be 2 positive numbers"):
        plan_batches(np.array([3, 4]), 2, 1, weights=[1.0])
