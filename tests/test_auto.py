"""quant=auto on the real stories260K: per-layer measurements, the cheapest assignment within a budget, held-out text.

Calibration (and measurement) text is Shakespeare; the evaluated text is TinyStories, never measured on.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import STORIES, TINYSTORIES, require_shared, run_entry

from lit_ppl.config.quant import quant_config
from lit_ppl.config.values import ConfigError, check_calibration
from lit_ppl.errors import LitPplError
from lit_ppl.quant.assign import assign
from lit_ppl.quant.auto.budget import BINS, Budget, Option, cheapest, least_cost, t_quantile
from lit_ppl.quant.auto.candidates import kind_rules
from lit_ppl.quant.auto.policy import POLICY_FILE
from lit_ppl.quant.auto.search import ROUNDS, SLACK, _search
from lit_ppl.quant.calibrated.text import Calibration, CalibrationSpec, prepare_calibration
from lit_ppl.quant.schemes import Scheme

SHAKESPEARE = STORIES.parent / "tinyshakespeare.txt"
SMALL = {"tokens": 1024, "seq_len": 256, "batch_size": 2, "grid": 5}


def auto_args(cache, *extra: str) -> list[str]:
    """An auto run of stories260K on TinyStories, measured on Shakespeare (int4 by AWQ, g32: 64 and 256 divide)."""
    return [
        "model=hf",
        f"model.path={STORIES}",
        "data=text",
        f"data.path={TINYSTORIES}",
        "trainer=cpu",
        "eval.seq_len=256",
        "compare=unquantized",
        "report.plots=false",
        "quant=auto",
        "quant.group_size=32",
        f"quant.calibration.path={SHAKESPEARE}",
        f"quant.calibration.cache_dir={cache}",
        *(f"quant.calibration.{k}={v}" for k, v in SMALL.items()),
        *extra,
    ]


def test_auto_meets_its_budget_on_held_out_text_with_fewer_bytes_than_uniform_int8(compose, tmp_path):
    """A budget above uniform int8's KLD: fewer packed bytes than int8 everywhere, the budget met on the calibration
    text and on TinyStories, the prediction within it; the written policy and the reused measurements reproduce it."""
    from lit_ppl.run import evaluate

    require_shared()
    int8 = evaluate(
        compose(*auto_args(tmp_path, "quant.schemes=[int8]", "quant.budget.kld=100", f"output_dir={tmp_path / 'int8'}"))
    )
    uniform = int8["quant"]["auto"]
    # 35 linear layers and the tied head/embedding table, one candidate counted once (512 × 64 float32).
    assert uniform["by_scheme"] == {"int8": {"layers": 36, "bytes": uniform["bytes_uniform"]["int8"]}}
    linear = [m.weight for n, m in stories_lm(tied=True).named_modules() if ".layers." in n and hasattr(m, "weight")]
    assert uniform["bytes_full_precision"] == 4 * (sum(w.numel() for w in linear if w.ndim == 2) + 512 * 64)
    assert uniform["measurement"]["passes"] == 0 and uniform["predicted"] is None  # nothing to choose

    budget = 3 * uniform["measured_calibration"]
    args = auto_args(tmp_path, f"quant.budget.kld={budget}", f"output_dir={tmp_path / 'auto'}")
    r = evaluate(compose(*args))
    auto = r["quant"]["auto"]
    assert auto["bytes"] < uniform["bytes"] == auto["bytes_uniform"]["int8"]
    assert auto["predicted"] <= budget and auto["measured_calibration"] <= auto["bound"] <= budget
    assert r["compare"]["kld_mean"] == auto["measured_evaluated"] <= budget  # text it was not measured on
    assert auto["met"] == {"predicted": True, "bound": True, "calibration": True, "evaluated": True}
    chosen = auto["rounds"][auto["chosen_round"] - 1]  # the cheapest round that met the budget
    assert (chosen["bytes"], chosen["bound"]) == (auto["bytes"], auto["bound"])
    assert all(r["bound"] > budget for r in auto["rounds"] if r["bytes"] < auto["bytes"])
    assert auto["by_scheme"]["int4-g32"]["layers"] > 0
    assert sum(v["layers"] for v in auto["by_scheme"].values()) == 36 and auto["calibration_tokens"] == SMALL["tokens"]
    assert auto["measurement"]["passes"] == SMALL["tokens"] // 256  # the estimate: one window a pass
    assert auto["fingerprint"]["sensitivity_method"] == "fisher"
    rules = auto["policy"]["rules"]
    tied = auto["choice"]["model.embed_tokens"] != "none"  # the head's module quantized with it
    assert (
        r["quant"]["quantized_modules"] - tied
        == len(rules)
        == 36 - auto["by_scheme"].get("none", {"layers": 0})["layers"]
    )
    for name, entry in r["quant"]["modules"].items():  # what was applied is what was chosen
        chosen = auto["choice"].get(entry.get("tied_to", name))
        assert (entry["config"] or "none") == {"int8": "int8", "int4": "int4-g32"}.get(chosen, "none"), name
    assert_page_shows_the_choice(tmp_path / "auto" / "report.html", auto)

    # The policy file, as a config group option of its own: the same weights, no measurement.
    conf = tmp_path / "conf" / "quant"
    conf.mkdir(parents=True)
    shutil.copy(tmp_path / "auto" / POLICY_FILE, conf / "chosen.yaml")
    again = [a for a in args if not a.startswith(("quant.", "quant=", "output_dir"))]
    proc, reused = run_entry([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", *again, "quant=chosen"], tmp_path / "p")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert reused["quant"]["name"] == "policy" and "auto" not in reused["quant"]
    assert reused["quant"]["consistency"]["digest"] == r["quant"]["consistency"]["digest"]
    assert reused["ppl"] == r["ppl"]

    # Another budget from the same measurements: no layer measured again, a cheaper choice.
    reuse = [f"quant.sensitivity={tmp_path / 'auto'}", f"output_dir={tmp_path / 'looser'}"]
    looser = evaluate(compose(*auto_args(tmp_path, f"quant.budget.kld={4 * budget}", *reuse)))
    assert looser["quant"]["auto"]["measurement"]["passes"] == 0
    assert looser["quant"]["auto"]["sensitivity"] == auto["sensitivity"]
    assert looser["quant"]["auto"]["bytes"] < auto["bytes"]
    # A size budget: the choice's own bits per weight give no more bytes and no more predicted KLD (to the
    # knapsack's resolution, as test_a_size_budget_finds_the_least_cost_within_its_bytes bounds it).
    assert auto["bits"] == 8 * auto["bytes"] / (sum(w.numel() for w in linear if w.ndim == 2) + 512 * 64)
    sized = evaluate(
        compose(*auto_args(tmp_path, f"quant.budget.bits={auto['bits']!r}", reuse[0], f"output_dir={tmp_path / 's'}"))
    )
    fit = sized["quant"]["auto"]
    assert fit["bytes"] <= auto["bytes"]
    assert fit["predicted"] <= auto["predicted"] * BINS**2 / ((BINS - 36) * (BINS - 1))
    assert fit["budget"] == {"bits": auto["bits"]} and fit["measurement"]["passes"] == 0 and len(fit["rounds"]) == 1
    assert fit["measured_evaluated"] == sized["compare"]["kld_mean"] and fit["measured_calibration"] <= fit["bound"]
    assert fit["met"] == dict.fromkeys(("predicted", "bound", "calibration", "evaluated"))  # no loss to be within
    for bits, message in [
        (1, r"quant\.budget\.bits=1 is below the fewest bits per weight quant\.schemes=\['none', 'int8', 'int4'\] "
         r"reach: [\d.]+ \([\d,]+ bytes for [\d,]+ weights\); raise the budget$"),
        (32, r"quant\.budget\.bits=32 holds every layer in full precision \(32 bits per weight\): give fewer bits, "
         r"or use quant=none$"),
    ]:  # fmt: skip
        with pytest.raises(LitPplError, match=message):
            evaluate(compose(*auto_args(tmp_path, f"quant.budget.bits={bits}", reuse[0], f"output_dir={tmp_path}/b")))
    # Measurements of another int4 group size are refused in one line.
    with pytest.raises(LitPplError, match=r"was measured with group_size=32, this run has 64: measure again"):
        evaluate(
            compose(
                *auto_args(
                    tmp_path, "quant.budget.kld=0.1", reuse[0], "quant.group_size=64", f"output_dir={tmp_path / 'g64'}"
                )
            )
        )


def assert_page_shows_the_choice(page: Path, auto: dict) -> None:
    """report.html: one cell per layer in its chosen scheme, and the frontier's points (full precision, each uniform
    scheme, each round, the evaluated choice)."""
    html = page.read_text(encoding="utf-8")
    cells = re.findall(r'<td class="s-(\w+)" title="([^:"]+):', html)
    assert sorted(cells) == sorted((kind, name) for name, kind in auto["choice"].items())
    frontier = re.search(r"quant=auto frontier.*?</svg>", html, re.S).group(0)
    assert frontier.count("<circle") == 1 + len(auto["bytes_uniform"]) + len(auto["rounds"]) + 1


def test_a_budget_nothing_quantized_meets_says_the_best_reachable_value(compose, tmp_path):
    from lit_ppl.run import evaluate

    require_shared()
    with pytest.raises(LitPplError) as err:  # every layer int4: one assignment, measured above the budget
        evaluate(
            compose(
                *auto_args(tmp_path, "quant.schemes=[int4]", "quant.budget.kld=1e-6", f"output_dir={tmp_path / 'a'}")
            )
        )
    line = str(err.value)
    assert "\n" not in line
    assert re.match(
        r"quant\.budget\.kld=1e-06 is not met with 95% confidence on text like the calibration text: the best "
        r"reachable with quant\.schemes=\['int4'\] is 0\.\d+ \(prediction bound, 1 assignments tried\); raise the "
        r"budget$",
        line,
    ), line
    with pytest.raises(LitPplError) as err:  # smaller than any one layer's change: full precision is all it allows
        evaluate(compose(*auto_args(tmp_path, "quant.budget.ppl_increase=1e-12", f"output_dir={tmp_path / 'b'}")))
    assert re.match(
        r"quant\.budget\.ppl_increase=1e-12 leaves every layer in full precision: the smallest change one "
        r"quantized layer makes on the calibration text is \d",
        str(err.value),
    ), str(err.value)


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({}, "quant=auto needs exactly one budget: quant.budget.kld=X"),
        ({"budget": {"kld": 0.1, "ppl_increase": 0.01}}, "quant=auto needs exactly one budget"),
        ({"budget": {"kld": -0.1}}, "quant.budget.kld=-0.1 must be a positive number"),
        ({"budget": {"kld": 0.1}, "schemes": ["int8", "int3"]}, "quant.schemes=['int8', 'int3'] must list distinct"),
        ({"budget": {"kld": 0.1}, "schemes": ["none"]}, "at least one of them quantized"),
        ({"budget": {"kld": 0.1}, "calibration": {"path": None}}, "quant=auto measures each layer on calibration text"),
        (
            {"budget": {"kld": 0.1}, "calibration": {"tokens": 512}},
            "quant.calibration.tokens=512 with quant.calibration.seq_len=512 is one calibration window",
        ),
    ],
)
def test_bad_auto_configs_are_one_line(node, message):
    calibration = {"path": "x.txt"} | node.pop("calibration", {})
    with pytest.raises(ConfigError, match=re.escape(message)):
        node = quant_config({"name": "auto", "calibration": calibration, **node})
        check_calibration("quant", dataclasses.asdict(node))


def test_the_bound_is_over_windows_with_students_t():
    """The bound's units are calibration windows of unequal length (the ratio estimator's standard error), a
    prediction for another text as long (√2 that error), its quantile Student's t on windows − 1 degrees of freedom
    (published: 6.314, 2.353, 1.895, 1.697; the normal's 1.645 for many); one window is one line, not a bound
    without a variance."""
    import statistics

    for dof, published in [(1, 6.314), (3, 2.353), (7, 1.895), (30, 1.697), (10_000, 1.645)]:
        assert abs(t_quantile(0.95, dof) - published) < 1e-3, (dof, t_quantile(0.95, dof))
    kld, tokens = [3.0, 1.0, 2.5, 2.0], [500, 400, 512, 300]
    units = torch.tensor([[k, 0.0, 0.0, n] for k, n in zip(kld, tokens, strict=True)], dtype=torch.float64)
    units = torch.cat([units, torch.zeros(2, 4, dtype=torch.float64)])  # a batch's idle rows: no tokens, no unit
    mean = sum(kld) / sum(tokens)
    residuals = [k - mean * n for k, n in zip(kld, tokens, strict=True)]
    stderr = math.sqrt(sum(r * r for r in residuals) / (4 * 3)) / statistics.mean(tokens)
    budget = Budget("kld", 0.01)
    assert budget.cost(units) == pytest.approx(mean, rel=1e-12)
    assert budget.bound(units) == pytest.approx(mean + 2.3534 * math.sqrt(2) * stderr, rel=1e-4)
    with pytest.raises(LitPplError, match=r"gave one window \(500 scored tokens\).*at least two"):
        budget.bound(units[:1])


def test_the_knapsack_finds_the_fewest_bytes_within_the_budget():
    """Against brute force on random instances: never over the budget, never more bytes than the best assignment
    whose costs, rounded up to the budget's steps, fit."""
    rng = random.Random(0)
    for _ in range(200):
        units = [
            [(rng.randint(1, 100), rng.random() * rng.choice([0.0, 1.0])) for _ in range(rng.randint(1, 3))]
            for _ in range(rng.randint(1, 5))
        ]
        limit, bins = rng.random() * 2, 50
        picks = cheapest(units, limit, bins)
        fits = [c for c in itertools.product(*units) if sum(math.ceil(cost / limit * bins) for _, cost in c) <= bins]
        if not fits:
            assert picks is None
            continue
        chosen = [u[j] for u, j in zip(units, picks, strict=True)]
        assert sum(cost for _, cost in chosen) <= limit
        assert sum(b for b, _ in chosen) == min(sum(b for b, _ in c) for c in fits)


def test_a_size_budget_finds_the_least_cost_within_its_bytes():
    """Against brute force on random instances: never over the bytes, the summed cost within the knapsack's
    resolution of the least that fits (each of n costs rounded up by 1/bins of the target: every target above
    least · bins / (bins − n) fits; the target bisected to 1/bins); ``None`` when the fewest bytes do not fit."""
    rng = random.Random(1)
    for _ in range(200):
        units = [
            [(rng.randint(1, 100), rng.random() * rng.choice([0.0, 1.0])) for _ in range(rng.randint(1, 3))]
            for _ in range(rng.randint(1, 5))
        ]
        max_bytes, bins = rng.randint(1, 300), 50
        fits = [c for c in itertools.product(*units) if sum(b for b, _ in c) <= max_bytes]
        found = least_cost(units, max_bytes, bins)
        if not fits:
            assert found is None
            continue
        chosen = [u[j] for u, j in zip(units, found[0], strict=True)]
        least = min(sum(cost for _, cost in c) for c in fits)
        assert sum(b for b, _ in chosen) <= max_bytes
        within = least * bins**2 / ((bins - len(units)) * (bins - 1))
        assert least <= sum(cost for _, cost in chosen) <= within + 1e-12


@pytest.mark.parametrize("scale", [0.5, 0.8, 1.3, 2.0])
def test_the_search_grows_into_slack_and_shrinks_from_overshoot_to_the_best_met_assignment(scale):
    """The whole measures ``scale`` × the table's sum (an estimate too high below 1, too low above): whether the
    first round meets the budget with slack or misses it, the search ends on the fewest bytes whose measured bound
    meets it (brute force over every assignment) within ROUNDS measurements, and never returns one that missed."""
    rng, layers, budget = random.Random(int(scale * 10)), [f"layer{i}" for i in range(10)], Budget("kld", 0.02)
    for _ in range(10):
        options = []
        for _ in layers:
            width, int8, int4 = rng.choice([1, 2, 4]), rng.uniform(1e-4, 2e-3), rng.uniform(2e-3, 2e-2)
            options.append(
                [Option("none", 32 * width), Option("int8", 9 * width, int8), Option("int4", 5 * width, int4)]
            )
        table = {(n, o.kind): o.kld for n, unit in zip(layers, options, strict=True) for o in unit}

        def measured(quantized: dict[str, str], table: dict = table) -> tuple[float, float]:
            cost = scale * sum(table[n, k] for n, k in quantized.items())
            return cost, 1.1 * cost

        chosen, index, rounds = _search(layers, options, budget, measured, ["none", "int8", "int4"])
        met = [
            sum(o.bytes for o in c) for c in itertools.product(*options) if 1.1 * scale * sum(o.kld for o in c) <= 0.02
        ]
        assert sum(o.bytes for o in chosen.values()) == rounds[index]["bytes"] == min(met)
        assert rounds[index]["bound"] <= 0.02 and len(rounds) <= ROUNDS
        assert all(r["bound"] > 0.02 for r in rounds if r["bytes"] < rounds[index]["bytes"])
        first = rounds[0]["bound"]
        assert len(rounds) > 1 if first > 0.02 or first < 0.02 * (1 - SLACK) else len(rounds) == 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fisher", "exact"])  # exact: with int4 by GPTQ
def test_two_fsdp_ranks_choose_what_one_rank_chooses(compose, tmp_path, method):
    """Under fsdp × 2 each rank holds its rows of the float decoder layers and measures its share of the calibration
    batches, summed in global batch order: the same sensitivities bit for bit (deterministic mode), so the same
    policy, and the same weights as one process. The four windows are one batch: rank 1 runs every pass idle, so
    that each gather of a layer's rows has both ranks."""
    from lit_ppl.run import evaluate

    require_shared()
    args = auto_args(
        tmp_path,
        "quant.budget.kld=0.02",
        f"data.cache_dir={tmp_path}",
        "eval.deterministic=true",
        "quant.calibration.batch_size=4",
        f"quant.sensitivity_method={method}",
        *(["quant.method=gptq"] if method == "exact" else []),  # GPTQ's solved candidates kept by rows
    )
    one = evaluate(compose(*args))
    proc, two = run_entry([*args, "strategy=fsdp", "trainer.devices=2"], tmp_path / "two", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert two["world_size"] == 2 and two["parallel"]["kind"] == "fsdp"
    assert (
        two["quant"]["auto"]["measurement"]["held_by_rows"] and not one["quant"]["auto"]["measurement"]["held_by_rows"]
    )
    assert two["quant"]["auto"]["policy"] == one["quant"]["auto"]["policy"]
    assert two["quant"]["auto"]["sensitivity"] == one["quant"]["auto"]["sensitivity"]  # bit for bit
    assert two["quant"]["digest"] == one["quant"]["digest"]
    assert two["quant"]["consistency"]["digest"] == one["quant"]["consistency"]["digest"]
    assert [r["bytes"] for r in two["quant"]["auto"]["rounds"]] == [r["bytes"] for r in one["quant"]["auto"]["rounds"]]
    assert two["ppl"] == pytest.approx(one["ppl"], rel=1e-9)


@pytest.mark.slow
def test_tensor_parallel_ranks_choose_what_one_process_chooses(compose, tmp_path):
    """Under tp × 2 the group measures as one process does, each rank holding its slices of the decoder layers
    (gathered for each call) and the vocabulary's tables whole for the while: the same sensitivities (to 1e-9: the
    ranks run without deterministic mode, which tp refuses), the same policy, and the same weights as one process
    (AWQ's layers solved whole, the row-parallel layers' int8 quantized over whole rows, each rank keeping its
    slice), the perplexity within tp's own rounding."""
    from lit_ppl.run import evaluate

    require_shared()
    args = auto_args(tmp_path, "quant.budget.kld=0.02", f"data.cache_dir={tmp_path}")
    one = evaluate(compose(*args, "eval.deterministic=true"))
    proc, tp = run_entry([*args, "strategy=tp", "trainer.devices=2"], tmp_path / "tp", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    auto, ref = tp["quant"]["auto"], one["quant"]["auto"]
    assert tp["parallel"]["kind"] == "tp" and auto["measurement"]["held_by_rows"]
    assert {n: set(k) for n, k in auto["sensitivity"].items()} == {n: set(k) for n, k in ref["sensitivity"].items()}
    for name, kinds in ref["sensitivity"].items():
        for kind, entry in kinds.items():
            assert auto["sensitivity"][name][kind] == pytest.approx(entry, rel=1e-9, abs=1e-15), (name, kind)
    assert auto["policy"] == ref["policy"]
    assert {n for n, k in auto["choice"].items() if k == "int8" and n.endswith(("o_proj", "down_proj"))}
    assert tp["quant"]["digest"] == one["quant"]["digest"]
    assert max(tp["rank_weight_bytes"]) < 0.6 * one["rank_weight_bytes"][0]
    assert abs(tp["ppl"] / one["ppl"] - 1) < 1e-6, (tp["ppl"], one["ppl"])


def test_under_tensor_parallelism_a_slice_that_would_quantize_unlike_its_rows_is_no_candidate():
    """A row-parallel slice holding half an int4 group of its rows (g64 of 64 input features, 32 per rank) cannot
    take int4; int8 by round to nearest it can (quantized over whole rows)."""
    model = stories_lm(tied=True)
    o_proj = model.get_submodule("model.layers.0.self_attn.o_proj")
    o_proj.full_in_features, o_proj.in_features = 64, 32  # as tensor_parallel.parallelize leaves it at tp=2
    cfg = quant_config({"name": "auto", "budget": {"kld": 0.1}, "group_size": 64, "calibration": {"path": "x"}})
    int4, report, _ = assign(model, kind_rules(model, cfg, "int4"))
    assert "model.layers.0.self_attn.o_proj" not in int4 and "model.layers.1.self_attn.o_proj" in int4
    assert "int4 groups of 64 would straddle" in report["model.layers.0.self_attn.o_proj"]["rule"]
    assert "model.layers.0.self_attn.o_proj" in assign(model, kind_rules(model, cfg, "int8"))[0]


def test_gptq_candidates_are_the_weights_the_policy_applies(compose, tmp_path):
    """int4 by GPTQ, each candidate measured alone (``exact``): the joint measurement on the calibration text is of
    the same weights the evaluation holds."""
    from lit_ppl.run import evaluate

    require_shared()
    exact = ("quant.method=gptq", "quant.budget.kld=0.05", "quant.sensitivity_method=exact")
    r = evaluate(compose(*auto_args(tmp_path, *exact)))
    auto, modules = r["quant"]["auto"], r["quant"]["modules"]
    assert auto["measurement"] == auto["measurement"] | {"passes": 67, "replayed_blocks": True}  # 36 int8 + 31 int4
    int4 = [n for n, kind in auto["choice"].items() if kind == "int4"]
    assert int4 and all(
        modules[n]["config"] == "int4-g32" and modules[n]["gptq_tokens"] == SMALL["tokens"] for n in int4
    )
    assert {rule["method"] for rule in auto["policy"]["rules"] if rule["config"] == "int4"} == {"gptq"}
    assert auto["measured_calibration"] <= 0.05 and r["compare"]["kld_mean"] <= 0.05
    assert_page_shows_the_choice(tmp_path / "out" / "report.html", auto)


def test_the_fisher_estimate_ranks_layers_as_the_exact_measurement_does(tmp_path):
    """Each int8 candidate of stories260K alone (35 linear layers, the tied embedding table): the gradient
    estimate (4 windows) against the exact measurement (36 passes) on the same calibration text, the same sums over
    ranks: the same order of sensitivity (rank correlation 0.942 measured on windows spread over the text, 0.965 on
    its first 1,024 tokens), each estimate within a factor of 2 of its measurement (0.76–1.42 measured), and no
    layer type estimated apart from the others (medians 0.87–1.11). The
    diagonal ``½ Σ g² Δy²`` ranked them more closely (0.99) but put key and value projections at 0.81 and 0.82 of
    their measurement, the MLP's at 0.94–0.97; at their own output, not attention's, value projections came out at
    0.29–0.83. Runs of 16 positions rank this small model's candidates a little worse than squares per position
    (0.973): its 1,024 tokens give fewer squared terms, and it has no bias between positions to remove."""
    import statistics

    from test_calibrate import calibration, lm

    from lit_ppl.quant.auto.candidates import Candidates
    from lit_ppl.quant.auto.fisher import estimate_layers
    from lit_ppl.quant.auto.sensitivity import Meter
    from lit_ppl.quant.auto.table import measure_layers, table_from_sums
    from lit_ppl.quant.calibrated.stream import Where, ordered_sum

    model, cal, at = lm(), calibration(tmp_path, tokens=1024, batch_size=2), Where()
    cfg = quant_config({"name": "auto", "schemes": ["none", "int8"], "budget": {"kld": 0.1}})
    candidates = Candidates(model, cfg, ["int8"], cal, at)
    meter = Meter(model, cal, 0, 1, 256, "model.layers")
    units = meter.measure()  # the float model: no KLD, one unit per window (the bound's), in batch order
    order = [i for batch in cal.batches(0, 1) for i in batch]
    assert units[..., 3].flatten().tolist() == cal.windows.lengths[order].tolist() and units[..., 0].abs().max() < 1e-9
    exact, passes = measure_layers(model, candidates, meter, ["int8"], at)
    local, windows = estimate_layers(model, candidates, cal, ["int8"], at, 256)
    estimate = table_from_sums(ordered_sum(local, at), candidates, ["int8"])
    assert (passes, windows) == (36, 4) and estimate.keys() == exact.keys()
    pairs = [(estimate[n]["int8"]["kld"], exact[n]["int8"]["kld"]) for n in exact]
    ranks = [sorted(v).index for v in zip(*pairs, strict=True)]
    assert statistics.correlation([ranks[0](e) for e, _ in pairs], [ranks[1](x) for _, x in pairs]) > 0.9
    far = {n: e / x for n, (e, x) in zip(exact, pairs, strict=True) if not 1 / 2 < e / x < 2}
    assert not far, far
    by_type: dict[str, list[float]] = {}
    for n, (e, x) in zip(exact, pairs, strict=True):
        by_type.setdefault(n.rsplit(".", 1)[-1], []).append(e / x)
    apart = {t: statistics.median(r) for t, r in by_type.items() if not 0.85 < statistics.median(r) < 1.15}
    assert not apart, apart


def stories_lm(tied: bool) -> torch.nn.Module:
    """stories260K (tied head and embeddings), or a copy whose head holds its own weight (untied)."""
    from lit_ppl.model.spec import ModelSpec

    require_shared()
    model = ModelSpec(path=str(STORIES)).build()
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone(), requires_grad=False)
    return model


@pytest.fixture(scope="module")
def small_calibration(tmp_path_factory) -> Calibration:
    """auto_args' calibration text, tokenized once for the tests that build candidates themselves."""
    from lit_ppl.model.spec import ModelSpec

    require_shared()
    node = {"path": str(SHAKESPEARE), "cache_dir": str(tmp_path_factory.mktemp("calibration")), **SMALL}
    spec = CalibrationSpec.from_cfg(quant_config({"name": "auto", "calibration": node}).calibration, "auto")
    return Calibration(spec, prepare_calibration(spec, ModelSpec(path=str(STORIES)).tokenizer(), None))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_head_and_embeddings_are_candidates_applied_as_measured(small_calibration, tied):
    """The head and the embedding table are candidates (a tied pair one, swapped in both modules), their bytes
    packed as stored, and quant=policy rules applying a choice give the very KLD measured with it installed."""
    from lit_ppl.quant.apply import quantize_model
    from lit_ppl.quant.auto.budget import packed_bytes
    from lit_ppl.quant.auto.candidates import Candidates, installed
    from lit_ppl.quant.auto.policy import policy_node
    from lit_ppl.quant.auto.sensitivity import Meter
    from lit_ppl.quant.calibrated.stream import Where, ordered_sum
    from lit_ppl.runtime.memory import inner_tensors, tensor_bytes

    model, cal = stories_lm(tied), small_calibration
    cfg = quant_config({"name": "auto", "method": "rtn", "group_size": 32, "budget": {"kld": 1.0}})
    candidates = Candidates(model, cfg, ["int8", "int4"], cal, Where())
    emb, head, q = "model.embed_tokens", "lm_head", "model.layers.0.self_attn.q_proj"
    assert candidates.layers[0] == emb and candidates.modules(q) == [q]
    if tied:  # one candidate for the one tensor, after the 35 linear layers' and before nothing
        assert candidates.modules(emb) == [emb, head] and len(candidates.layers) == 36
    else:
        assert candidates.modules(emb) == [emb] and candidates.modules(head) == [head] == candidates.layers[-1:]
    assert candidates.scheme(emb, "int4") == (Scheme("int4", 32), "rtn")  # int4 by round-to-nearest, any method
    float_head = model.lm_head.weight
    picks = {emb: "int4", q: "int8"} | ({} if tied else {head: "int8"})
    meter = Meter(model, cal, 0, 1, 256, None)
    with installed(model, {n: candidates.weight(n, k) for n, k in picks.items()}):
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        assert type(model.model.embed_tokens.weight).__name__ == "IntxUnpackedToInt8Tensor"
        measured = ordered_sum(meter.measure(), Where())
    assert model.lm_head.weight is float_head and (model.model.embed_tokens.weight is float_head) == tied

    # Packed bytes: int8 as torchao's tensor holds its codes and per-row scales (its per-row zero point of the
    # symmetric grid is 0), int4 half a byte per weight plus per group a scale and a zero point.
    weight = model.model.embed_tokens.weight
    held = dict(inner_tensors(candidates.weight(emb, "int8")[0]))
    assert packed_bytes(Scheme("int8"), weight) == tensor_bytes(held["qdata"]) + tensor_bytes(held["scale"])
    assert not held["zero_point"].any() and held["qdata"].shape == weight.shape and held["scale"].numel() == 512
    assert packed_bytes(Scheme("int4", 32), weight) == weight.numel() // 2 + 2 * (weight.numel() // 32) * 4

    policy = policy_node(cfg, {n: candidates.scheme(n, k) for n, k in picks.items()})
    assert {r["method"] for r in policy["rules"]} == {"rtn"}
    report = quantize_model(model, dataclasses.replace(cfg, name="policy", rules=policy["rules"]))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert report.modules[head]["config"] == ("int4-g32" if tied else "int8")
    applied = ordered_sum(meter.measure(), Where())
    assert measured[:, 0].sum() > 0 and torch.equal(applied, measured)  # the same weights: the same bits


def test_without_auto_embeddings_only_linear_layers_are_candidates(small_calibration):
    from lit_ppl.quant.auto.candidates import Candidates
    from lit_ppl.quant.calibrated.stream import Where

    cfg = quant_config({"name": "auto", "method": "rtn", "budget": {"kld": 1.0}, "auto_embeddings": False})
    candidates = Candidates(stories_lm(tied=False), cfg, ["int8"], small_calibration, Where())
    assert len(candidates.layers) == 35 and all(".layers." in n for n in candidates.layers)
    # A packed int4 kernel (F.linear only) leaves the lookup table int8 or full precision, and an untied head int4.
    cfg = dataclasses.replace(cfg, auto_embeddings=True, backend="prototype", group_size=32)
    for tied in (True, False):
        model = stories_lm(tied).to(torch.bfloat16)
        candidates = Candidates(model, cfg, ["int8", "int4"], small_calibration, Where())
        assert candidates.scheme("model.embed_tokens", "int8") is not None
        assert candidates.scheme("model.embed_tokens", "int4") is None
        assert (candidates.scheme("lm_head", "int4") is None) == tied


def test_the_estimate_holds_candidates_quantized_not_their_float_changes(small_calibration):
    """The gradient estimate keeps each candidate as built and makes its ΔW when a gradient needs it: what it holds
    for the pass is under one float model's bytes for two schemes (every ΔW held was two float models)."""
    from lit_ppl.quant.auto.candidates import Candidates
    from lit_ppl.quant.auto.fisher import _Probe
    from lit_ppl.quant.calibrated.stream import Where
    from lit_ppl.runtime.memory import tensor_bytes

    cfg = quant_config({"name": "auto", "method": "rtn", "group_size": 32, "budget": {"kld": 1.0}})
    model, kinds = stories_lm(tied=False), ["int8", "int4"]
    candidates = Candidates(model, cfg, kinds, small_calibration, Where())
    probe = _Probe(model, candidates, kinds)
    kept = [b for built in probe.built.values() for b in built if b is not None]
    assert len(kept) == sum(candidates.scheme(n, k) is not None for n in probe.layers for k in kinds) > 60
    assert all(type(weight) is not torch.Tensor for weight, _ in kept)  # torchao's tensors: codes and scales
    held = sum(tensor_bytes(weight) for weight, _ in kept)
    assert held < sum(tensor_bytes(candidates.tensor(n)) for n in probe.layers), held


def test_the_estimate_makes_each_candidates_change_once_per_window(small_calibration, monkeypatch):
    """A window runs as one batch of its rows (two sampled tokens' and the text's): each candidate's ΔW is made
    once per window and scheme, not once per gradient, and every row's gradient reaches it."""
    from lit_ppl.quant.auto import fisher
    from lit_ppl.quant.auto.candidates import Candidates
    from lit_ppl.quant.calibrated.stream import Where

    cfg = quant_config({"name": "auto", "method": "rtn", "group_size": 32, "budget": {"kld": 1.0}})
    model, kinds, made = stories_lm(tied=True), ["int8", "int4"], []
    candidates = Candidates(model, cfg, kinds, small_calibration, Where())
    delta = fisher._delta
    monkeypatch.setattr(fisher, "_delta", lambda *a: made.append(1) or delta(*a))
    chunk = fisher.ROWS * SMALL["seq_len"]  # the head's logits of a whole window at once: one call a window
    local, windows = fisher.estimate_layers(model, candidates, small_calibration, kinds, Where(), chunk, "model.layers")
    built = sum(candidates.scheme(n, k) is not None for n in candidates.layers for k in kinds)
    # The tied table is one candidate seen twice a window: where it is looked up and where the head reads it.
    assert windows == 4 and len(made) == windows * (built + 2) and fisher.ROWS == fisher.SAMPLES + 1 == 3
    kld, nll = local.sum(0)[..., 0], local.sum(0)[..., 1]
    has = torch.tensor([[candidates.scheme(n, k) is not None for k in kinds] for n in candidates.layers])
    # Every built candidate gets the sampled rows' term and the text row's first-order term.
    assert (kld[has] > 0).all() and (nll[has] != kld[has]).all() and not kld[~has].any()


def test_groups_of_experts_are_candidates_estimated_and_applied_as_measured(small_calibration, compose, tmp_path):
    """A mixture-of-experts model (Mixtral, every expert's projection in one 3D parameter): each fused parameter is
    one candidate, int8 only (torchao's int4 takes no 3D weight), its bytes packed per expert and row; after the last
    router the estimate matches the exact measurement; the run's policy applies the choice as measured."""
    from helpers import zoo

    from lit_ppl.model.spec import ModelSpec
    from lit_ppl.quant.auto.budget import packed_bytes
    from lit_ppl.quant.auto.candidates import Candidates
    from lit_ppl.quant.auto.fisher import estimate_layers
    from lit_ppl.quant.auto.sensitivity import Meter
    from lit_ppl.quant.auto.table import measure_layers, table_from_sums
    from lit_ppl.quant.calibrated.stream import Where, ordered_sum
    from lit_ppl.run import evaluate
    from lit_ppl.runtime.memory import inner_tensors, tensor_bytes

    path = zoo.build("mixtral", tmp_path, STORIES)
    model, cal, at = ModelSpec(path=str(path)).build(), small_calibration, Where()
    cfg = quant_config({"name": "auto", "method": "rtn", "group_size": 32, "budget": {"kld": 1.0}})
    candidates = Candidates(model, cfg, ["int8", "int4"], cal, at)
    experts = [n for n in candidates.layers if ".experts." in n]
    assert experts == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")]
    assert all(candidates.scheme(n, "int4") is None and candidates.scheme(n, "int8") for n in experts)
    weight, held = candidates.tensor(experts[0]), dict(inner_tensors(candidates.weight(experts[0], "int8")[0]))
    assert weight.ndim == 3 and held["scale"].numel() == weight.shape[0] * weight.shape[1]  # per expert and row
    assert packed_bytes(Scheme("int8"), weight) == tensor_bytes(held["qdata"]) + tensor_bytes(held["scale"])

    kinds = ["int8", "int4"]
    exact = measure_layers(model, candidates, Meter(model, cal, 0, 1, 256, "model.layers"), kinds, at)[0]
    estimate = table_from_sums(
        ordered_sum(estimate_layers(model, candidates, cal, kinds, at, 256)[0], at), candidates, kinds
    )
    assert exact.keys() == estimate.keys()
    # Past the last router nothing routes differently: the second-order estimate holds (measured 0.97-1.03).
    for name in [*experts[2:], "lm_head"]:
        assert estimate[name]["int8"]["kld"] == pytest.approx(exact[name]["int8"]["kld"], rel=0.2), name

    docs = tmp_path / "docs.txt"
    docs.write_text(TINYSTORIES.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    args = [a for a in auto_args(tmp_path, "quant.method=rtn", "quant.budget.kld=1") if not a.startswith("model.path")]
    r = evaluate(compose(*args, f"model.path={path}", f"data.path={docs}", f"output_dir={tmp_path / 'out'}"))
    auto = r["quant"]["auto"]
    assert {n: auto["choice"][n] for n in experts} == dict.fromkeys(experts, "int8")  # a loose budget: all int8
    assert all(r["quant"]["modules"][n]["config"] == "int8" for n in experts)
    assert auto["met"]["calibration"] and r["compare"]["kld_mean"] == auto["measured_evaluated"] > 0
