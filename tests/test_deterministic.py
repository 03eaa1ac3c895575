"""eval.deterministic=true: bit-identical numbers at every world size, strategy and balance (real gloo processes).

Windows of 77 tokens over five real documents give batches of unequal shapes, where the default mode's results
differ across world sizes in the last digits; here every statistic is compared with ``==``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import STORIES
from helpers.nodes import launch, slow_cgroup, wait
from helpers.runs import cases_sweep, evaluate_overrides, torchrun_cases

pytestmark = pytest.mark.slow
EXACT_KEYS = ("nll_sum", "ppl", "nll_stderr", "ppl_ci95", "word_ppl", "byte_ppl", "bits_per_byte", "tokens", "words")


def _args(docs: Path, *extra: str) -> list[str]:
    """Deterministic runs of the model on ``docs``; a case of a sweep below may set ``eval.deterministic=false``:
    given here, on the command line, it would override the case's."""
    return [f"model.path={STORIES}", f"data.path={docs}", "eval.seq_len=77", "trainer.accelerator=cpu", *extra]


DETERMINISTIC = "eval.deterministic=true"


@pytest.fixture(scope="module")
def reference(docs_file, tmp_path_factory):
    """One process, in-process, per (batch size, precision)."""
    return {
        (batch, precision): evaluate_overrides(
            _args(docs_file, DETERMINISTIC, f"batch_size={batch}", f"precision={precision}"),
            tmp_path_factory.mktemp(f"ref{batch}{precision}"),
        )
        for batch, precision in ((1, "32-true"), (5, "32-true"), (5, "bf16-true"))
    }


def _assert_identical(r: dict, ref: dict) -> None:
    for key in EXACT_KEYS:
        assert r[key] == ref[key], key
    assert r["nll_by_position"] == ref["nll_by_position"]


# Every multi-rank run of this file but the slowed node's: one launch per world size, whose ranks run each case as
# a job of one ``-m`` sweep (a launch's cost is its interpreters' start-up, not the tiny model's evaluation).
WEIGHTS = ("distributed.balance=weights",)
TWO_RANKS = {
    "fsdp-5-32-true": ["strategy=fsdp", "batch_size=5", "precision=32-true"],
    "fsdp-5-bf16-true": ["strategy=fsdp", "batch_size=5", "precision=bf16-true"],
    "weights": ["strategy=ddp", "batch_size=1", *WEIGHTS, "distributed.weights=[1.0,0.3]"],
    "fsdp-weights-default": [
        "strategy=fsdp",
        "batch_size=4",
        *WEIGHTS,
        "distributed.weights=[1.0,0.5]",
        "eval.deterministic=false",
    ],
}
THREE_RANKS = {
    "ddp-1-32-true": ["strategy=ddp", "batch_size=1", "precision=32-true"],
    "ddp-5-bf16-true": ["strategy=ddp", "batch_size=5", "precision=bf16-true"],
}
# Four ranks as two torchrun "nodes" of two: ddp and fsdp over all four, and hsdp (replicated across the nodes).
TWO_NODES = {
    "ddp-5-32-true": ["strategy=ddp", "batch_size=5", "precision=32-true"],
    "fsdp-1-32-true": ["strategy=fsdp", "batch_size=1", "precision=32-true"],
    "hsdp-5-32-true": ["strategy=hsdp", "batch_size=5", "precision=32-true"],
}


@pytest.fixture(scope="module")
def runs(docs_file, tmp_path_factory) -> dict[tuple[int, str], dict]:
    """(world size, case) -> results.json of every case above."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for world, cases in ((2, TWO_RANKS), (3, THREE_RANKS)):
        cases = {name: [DETERMINISTIC, *case] for name, case in cases.items()}  # a case's own setting comes last
        results = torchrun_cases(_args(docs_file, f"trainer.devices={world}"), cases, world, root / str(world))
        out |= {(world, name): r for name, r in results.items()}
    nodes = root / "nodes"
    args = ["-m", *_args(docs_file, DETERMINISTIC, "trainer.devices=2", "trainer.num_nodes=2")]
    args += cases_sweep(nodes, TWO_NODES)
    sweep_dirs = {node: [f"hydra.sweep.dir={nodes / f'sweep{node}'}"] for node in (0, 1)}
    results = wait(launch(args, nodes, nodes=2, per_node=2, node_args=sweep_dirs), timeout=400)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:]
    for name in TWO_NODES:
        out[4, name] = json.loads((nodes / name / "results.json").read_text())
    return out


@pytest.mark.parametrize(
    "world,case",
    [
        (3, "ddp-1-32-true"),
        (4, "ddp-5-32-true"),
        (2, "fsdp-5-32-true"),
        (4, "fsdp-1-32-true"),
        (3, "ddp-5-bf16-true"),
        (2, "fsdp-5-bf16-true"),
        (4, "hsdp-5-32-true"),  # over two torchrun nodes: replicated across them, sharded within each
    ],
)
def test_bit_identical_at_every_world_size(runs, reference, world, case):
    strategy, batch, precision = case.split("-", 2)
    r = runs[world, case]
    assert r["world_size"] == world and r["deterministic"] is True and r["strategy"] == strategy
    assert r["num_nodes"] == (2 if world == 4 else 1)
    _assert_identical(r, reference[int(batch), precision])


def test_given_weights_move_work_and_keep_the_result(runs, reference):
    r = runs[2, "weights"]
    assert r["balance"]["rank_weights"] == [1.0, 0.3]
    assert r["rank_tokens"][0] > 2 * r["rank_tokens"][1]
    _assert_identical(r, reference[1, "32-true"])


def test_measured_balance_favours_a_slow_nodes_fast_peer(docs_file, reference, tmp_path):
    """Node 1 runs under a CPU quota of 0.4 core: the probe sees it, its share shrinks, the numbers do not move."""
    group = slow_cgroup("lit_ppl_test_slow", 0.4)
    if group is None:
        pytest.skip("cgroup v1 CPU quotas cannot be set here (needs root and /sys/fs/cgroup/cpu)")
    out = tmp_path / "out"
    args = _args(docs_file, DETERMINISTIC, "strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2", "batch_size=1")
    args += ["distributed.balance=measured", f"output_dir={out}"]
    results = wait(launch(args, tmp_path, nodes=2, per_node=1, cgroups={1: group}), timeout=400)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:]
    r = json.loads((out / "results.json").read_text())
    speeds = r["balance"]["measured_tokens_per_s"]
    assert speeds[1] < 0.8 * speeds[0] and r["rank_tokens"][0] > r["rank_tokens"][1], r["balance"]
    _assert_identical(r, reference[1, "32-true"])


def test_fsdp_weights_in_the_default_mode_give_the_slow_rank_smaller_batches(runs, reference):
    """Under fsdp every step is a collective: the slower rank gets fewer tokens in smaller batches, same answer."""
    r = runs[2, "fsdp-weights-default"]
    assert r["deterministic"] is False
    assert r["rank_tokens"][0] > 1.5 * r["rank_tokens"][1] and r["rank_steps"][0] == r["rank_steps"][1]
    ref = reference[1, "32-true"]
    assert r["tokens"] == ref["tokens"] and r["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)
