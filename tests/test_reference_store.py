"""A reference saved once (``save_reference``) and read by ``compare=saved``: the live comparison's numbers without a
second model, at any layout; ``report.per_token``'s per-token NLLs in corpus order."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import STORIES, require_shared, run_entry
from helpers import zoo
from helpers.runs import evaluate_overrides, stories_overrides, torchrun_cases

from lit_ppl.errors import LitPplError


def _numbers(c: dict, prefix: str = "") -> dict[str, float]:
    """Every number of a ``compare`` result, the per-bucket ones and the histogram's included, by a flat key."""
    out: dict[str, float] = {}
    for k, v in c.items():
        if isinstance(v, dict):
            out |= _numbers(v, f"{prefix}{k}.")
        elif isinstance(v, list):
            out |= _numbers({str(i): x for i, x in enumerate(v)}, f"{prefix}{k}.")
        elif isinstance(v, int | float):  # not the noise floor's precision and source
            out[f"{prefix}{k}"] = v
    return out


def _worst(a: dict, b: dict) -> float:
    """The largest relative difference between two ``compare`` results, over every statistic."""
    a, b = _numbers(a), _numbers(b)
    assert a.keys() == b.keys()
    return max(abs(a[k] - b[k]) / abs(a[k]) if a[k] else abs(b[k]) for k in a)


def _store_files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.glob("*.npy"))}


@pytest.fixture(scope="module")
def saved(docs_file, tmp_path_factory):
    """One reference saved in 32-true with per-token outputs, its live and its saved comparison of int8."""
    require_shared()
    root = tmp_path_factory.mktemp("saved")
    base = stories_overrides(docs_file, root / "cache")
    store = root / "store"
    ref = evaluate_overrides([*base, f"save_reference={store}", "report.per_token=true"], root / "ref")
    live = evaluate_overrides([*base, "quant=int8", "compare=unquantized", "report.per_token=true"], root / "live")
    read = evaluate_overrides([*base, "quant=int8", "compare=saved", f"compare.reference.store={store}"], root / "read")
    return {"root": root, "store": store, "ref": ref, "live": live, "read": read, "base": base}


def test_saved_reference_gives_the_live_comparison(saved):
    live, read = saved["live"]["compare"], saved["read"]["compare"]
    assert live["tokens"] == read["tokens"] == saved["ref"]["tokens"]
    assert 0 < live["kld_mean"] < 0.1
    assert _worst(live, read) <= 1e-6, {k: (live[k], read[k]) for k in live if live[k] != read[k]}
    assert saved["read"]["ppl"] == saved["live"]["ppl"]
    # int8 keeps the head in float: the stored head is the model's own, which is used rather than loaded again.
    assert saved["read"]["reference_store"]["head"] == "the model's own"
    # The noise floor: measured by the saving run on its model, stored, read back; the live one measures the same.
    stored = saved["ref"]["saved_reference"]["noise_floor"]
    assert json.loads((saved["store"] / "manifest.json").read_text())["noise_floor"] == stored
    assert live["noise_floor"] == stored and read["noise_floor"] == {**stored, "source": "saved"}
    assert 0 < stored["kld_mean"] < 1e-9 and stored["windows"] == 4 and stored["precision"] == "32-true"


def test_store_size_is_hidden_states_and_the_head(saved):
    store, ref = saved["store"], saved["ref"]
    manifest = json.loads((store / "manifest.json").read_text())
    tokens, hidden = ref["tokens"], manifest["hidden"]
    assert manifest["complete"] and manifest["tokens"] == tokens and manifest["dtype"] == "float32"
    head = (store / "head.pt").stat().st_size
    total = sum(p.stat().st_size for p in store.iterdir() if p.name != "manifest.json")
    assert total == ref["saved_reference"]["bytes"] + 4 * 128  # + each .npy file's header
    # hidden × 4 + 8 bytes per token, 24 bytes of digests per window
    assert total == tokens * (hidden * 4 + 8) + manifest["window_count"] * 24 + head + 4 * 128
    assert np.load(store / "hidden.npy", mmap_mode="r").shape == (tokens, hidden)


def test_per_token_sums_to_the_nll_sum(saved):
    out = saved["root"] / "ref"
    per_token = np.load(out / "per_token.npy")
    index = np.load(out / "per_token_index.npy")
    ref = saved["ref"]
    assert per_token.dtype == np.float64 and per_token.shape == (ref["tokens"],)
    # The values the run summed (float64 under a comparison, where float32 rows were 4e-10 off): equal but for the
    # order of the additions.
    for run, values in ((ref, per_token), (saved["live"], np.load(saved["root"] / "live" / "per_token.npy"))):
        assert math.isclose(values.sum(), run["nll_sum"], rel_tol=1e-13, abs_tol=0)
    # Corpus order: documents ascending, each one's positions 0, 1, 2, ...
    doc, pos = index[:, 0], index[:, 1]
    assert (np.diff(doc) >= 0).all() and doc.max() + 1 == ref["documents"]
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], doc])))
    assert (pos[starts] == 0).all() and (np.diff(pos)[np.diff(doc) == 0] == 1).all()
    assert ref["per_token"]["path"] == str(out / "per_token.npy")


def test_a_store_of_other_windows_or_text_is_refused(saved, tmp_path):
    base, store = saved["base"], saved["store"]
    other = [*[a for a in base if not a.startswith("eval.seq_len")], "eval.seq_len=32"]
    with pytest.raises(LitPplError, match="other windows"):
        evaluate_overrides([*other, "compare=saved", f"compare.reference.store={store}"], tmp_path / "a")
    partial = tmp_path / "partial"
    partial.mkdir()
    manifest = json.loads((store / "manifest.json").read_text())
    (partial / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(LitPplError, match="incomplete"):
        evaluate_overrides([*base, "compare=saved", f"compare.reference.store={partial}"], tmp_path / "b")


def test_outputs_and_comparisons_that_cannot_go_together_are_refused(saved, tmp_path):
    base = saved["base"]
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(LitPplError, match="holding other files"):
        evaluate_overrides([*base, f"save_reference={tmp_path / 'home'}"], tmp_path / "a")
    with pytest.raises(LitPplError, match="read as it was saved"):
        store = f"compare.reference.store={saved['store']}"
        evaluate_overrides([*base, "compare=saved", store, f"+compare.reference.path={STORIES}"], tmp_path / "b")
    with pytest.raises(LitPplError, match="with compare"):
        evaluate_overrides([*base, "compare=unquantized", f"save_reference={tmp_path / 's'}"], tmp_path / "c")
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("family", ["gemma2", "granite"])  # soft-capping; logit scaling
def test_64_bit_saved_reference_with_a_logit_transform(docs_file, tmp_path, family):
    """Two seeds of a zoo model in 64-true: the saved reference of one gives the live comparison to 1e-12."""
    require_shared()
    a = zoo.build(family, tmp_path / "a", STORIES, seed=0)
    b = zoo.build(family, tmp_path / "b", STORIES, seed=1)
    base = stories_overrides(docs_file, tmp_path / "cache", "precision=64-true")
    base = [a for a in base if not a.startswith("model.path")]
    store = tmp_path / "store"
    evaluate_overrides([*base, f"model.path={a}", f"save_reference={store}"], tmp_path / "ref")
    assert json.loads((store / "manifest.json").read_text())["softcap" if family == "gemma2" else "scale"]
    live = evaluate_overrides(
        [*base, f"model.path={b}", "compare=unquantized", f"compare.reference.path={a}"], tmp_path / "live"
    )
    read = evaluate_overrides(
        [*base, f"model.path={b}", "compare=saved", f"compare.reference.store={store}"], tmp_path / "read"
    )
    assert live["compare"]["kld_mean"] > 0.01 and read["reference_store"]["head"] == "stored"  # another seed's
    assert _worst(live["compare"], read["compare"]) <= 1e-12


INT4 = ["quant=int4", "quant.group_size=32"]  # int8's per-row scales cannot be split over tensor-parallel slices


@pytest.fixture(scope="module")
def two_ranks(saved, tmp_path_factory) -> dict[str, dict]:
    """Every 2-rank run of the two tests below, as the jobs of one ``-m`` sweep on one torchrun launch of 2 ranks
    (a launch's cost is its interpreters' start-up): name -> results.json. "fsdp_save" writes ``root/store``."""
    root = tmp_path_factory.mktemp("two_ranks")
    base = [a for a in saved["base"] if not a.startswith("data.cache_dir")] + [f"data.cache_dir={root / 'cache'}"]
    det, read = ["eval.deterministic=true"], ["compare=saved", f"compare.reference.store={saved['store']}"]
    fsdp, tp = ["strategy=fsdp"], ["strategy=tp"]
    cases = {
        "fsdp_save": [*det, *fsdp, f"save_reference={root / 'store'}"],
        "fsdp": [*fsdp, "quant=int8", *read],  # the stored head sharded
        "tp_saved": [*tp, *INT4, *read],
        "tp_live": [*tp, *INT4, "compare=unquantized"],
        # compare.reference as a path (a live reference model) or as {store: DIR} (the saved one)
        "det_live": [*det, *fsdp, "quant=int8", f"compare.reference={STORIES}"],
        "det_saved": [*det, *fsdp, "quant=int8", "compare.reference={store:'" + str(saved["store"]) + "'}"],
    }
    runs = torchrun_cases([*base, "trainer.devices=2"], cases, 2, root, timeout=600)
    assert {r["world_size"] for r in runs.values()} == {2}
    return {**runs, "store": root / "store"}


@pytest.mark.slow
def test_saved_reference_under_every_layout(saved, two_ranks, tmp_path):
    """The store a 2-rank FSDP run writes is one process's, bit for bit (deterministic); compare=saved gives one
    process's statistics under fsdp, ddp (== at 3 ranks, deterministic), tp and fsdp_tp, and so does the live
    comparison under tp."""
    base = [a for a in saved["base"] if not a.startswith("data.cache_dir")]
    det, read = ["eval.deterministic=true"], ["compare=saved", f"compare.reference.store={saved['store']}"]

    def entry(name: str, *args: str) -> dict:
        proc, r = run_entry([*base, *args], tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return r

    one, two = tmp_path / "one", two_ranks["store"]
    evaluate_overrides([*saved["base"], *det, f"save_reference={one}"], tmp_path / "one_out")
    assert two_ranks["fsdp_save"]["strategy"] == "fsdp"
    assert _store_files(one) == _store_files(two)
    floors = [json.loads((s / "manifest.json").read_text())["noise_floor"] for s in (one, two)]
    assert floors[0] == floors[1] and floors[0]["kld_mean"] > 0  # measured on the sharded model: one process's
    assert _worst(saved["live"]["compare"], two_ranks["fsdp"]["compare"]) <= 1e-6
    single = evaluate_overrides([*saved["base"], *det, "quant=int8", *read], tmp_path / "det1")["compare"]
    assert entry("ddp3", *det, "quant=int8", "strategy=ddp", "trainer.devices=3", *read)["compare"] == single
    # The reference's hidden states under tp carry the split sums' rounding: the means agree to 1e-6.
    single = evaluate_overrides([*saved["base"], *INT4, "compare=unquantized"], tmp_path / "int4")["compare"]
    for name in ("tp_saved", "tp_live"):
        assert two_ranks[name]["strategy"] == "tp"
        r = two_ranks[name]["compare"]
        for key in ("ppl", "ppl_base", "kld_mean", "kld_rev_mean", "p_diff_rms", "same_top"):
            assert r[key] == pytest.approx(single[key], rel=1e-6), (name, key)
    r = entry(
        "fsdp_tp",
        "strategy=fsdp_tp",
        "trainer.devices=4",
        "parallel.tp=2",
        "compare=saved",
        f"compare.reference.store={two}",
    )
    assert r["compare"]["kld_mean"] < 1e-9 and r["compare"]["same_top"] == 1.0  # the same model as the store's


@pytest.mark.slow
def test_reverse_kld_and_buckets_under_fsdp_are_one_processes(saved, two_ranks, tmp_path):
    """compare's reverse KLD, top-1 buckets and histogram: the live and the saved comparison under fsdp × 2 give one
    process's, bit for bit in deterministic mode."""
    det = [*saved["base"], "eval.deterministic=true", "quant=int8"]
    store = saved["store"]
    single = [
        evaluate_overrides([*det, "compare.reference=" + str(STORIES)], tmp_path / "live1")["compare"],
        evaluate_overrides([*det, "compare.reference={store:'" + str(store) + "'}"], tmp_path / "saved1")["compare"],
    ]
    runs = [two_ranks["det_live"], two_ranks["det_saved"]]
    assert [r["strategy"] for r in runs] == ["fsdp", "fsdp"] and "reference_store" in runs[1]
    assert runs[1]["reference_store"]["head"] == "the model's own"  # its float head, sharded, has the stored digest
    for one, two in zip(single, (r["compare"] for r in runs), strict=True):
        assert two == one and two["noise_floor"]["kld_mean"] > 0  # the noise floor too, bit for bit
        assert (
            0 < one["kld_rev_mean"] != one["kld_mean"]
            and sum(b["tokens"] for b in one["kld_by_top_p"]) == one["tokens"]
        )
    assert _worst(single[0], single[1]) <= 1e-6  # and the live comparison is the saved one
