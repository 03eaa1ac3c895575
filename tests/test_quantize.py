"""Quantization on the real stories260K: configs, skip report, policies, tied weights, rank consistency."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import STORIES, TINYSTORIES, require_shared, run_entry

from lit_ppl.model.spec import ModelSpec
from lit_ppl.quant import consistency as quant_check
from lit_ppl.quant import quantizer as quantize
from lit_ppl.run import evaluate

DATA = ["model=hf", f"model.path={STORIES}", "data=text", f"data.path={TINYSTORIES}", "trainer=cpu"]
CONFIGS = {
    "none": [],
    "int8": ["quant=int8"],
    "int8dq": ["quant=int8dq"],
    "int4-g32": ["quant=int4", "quant.group_size=32"],
    "policy": ["quant=policy"],
}
LAYERS = 5  # stories260K: hidden 64, intermediate 172, 5 decoder layers, tied embeddings


def lm() -> torch.nn.Module:
    require_shared()
    return ModelSpec(path=str(STORIES)).build()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every config evaluated once in rolling mode, seq_len 512 (the parity setting)."""
    require_shared()
    from hydra import compose, initialize_config_dir

    from lit_ppl.validate import conf_dir

    out = {}
    for name, overrides in CONFIGS.items():
        tmp = tmp_path_factory.mktemp(name)
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            cfg = compose(
                "validate", overrides=[f"output_dir={tmp}", f"data.cache_dir={tmp.parent / 'cache'}", *DATA, *overrides]
            )
        out[name] = evaluate(cfg)
        assert json.loads((tmp / "results.json").read_text())["quant"] == out[name]["quant"]
    return out


def test_every_config_runs_and_changes_ppl(runs):
    base = runs["none"]["ppl"]
    assert base == pytest.approx(6.8972206, rel=2e-5) and runs["none"]["quant"] is None
    for name in ("int8", "int8dq", "int4-g32", "policy"):
        r = runs[name]
        assert math.isfinite(r["ppl"]) and r["ppl"] != base, name
        assert r["tokens"] == runs["none"]["tokens"]
        q = r["quant"]
        assert q["weight_bytes_after"] < q["weight_bytes_before"], name
        assert q["backend"], name
    # Measured: int8 6.8986 (+0.02%), int4 g32 8.0773 (+17%).
    assert abs(runs["int8"]["ppl"] - base) < abs(runs["int4-g32"]["ppl"] - base)
    assert abs(runs["int8dq"]["ppl"] - base) < abs(runs["int4-g32"]["ppl"] - base)
    assert "IntxWeightOnlyConfig" in runs["int4-g32"]["quant"]["backend"]["int4-g32 (intx)"]  # fp32 on CPU


def test_packed_bytes_count_int4_at_half_a_byte_whatever_the_cpu_kernel_holds(runs):
    q = runs["int4-g32"]["quant"]
    int4 = [m for m in q["modules"].values() if m["config"] == "int4-g32"]
    numel = [m["bytes_before"] // 4 for m in int4]  # float32 weights
    # Half a byte per weight, and a float32 scale and zero point per group of 32.
    assert [m["bytes_packed"] for m in int4] == [n // 2 + 2 * (n // 32) * 4 for n in numel]
    saved = sum(m["bytes_before"] - m["bytes_packed"] for m in int4)
    assert q["weight_bytes_packed"] == q["weight_bytes_before"] - saved < q["weight_bytes_after"]  # unpacked on CPU
    q8 = runs["int8"]["quant"]
    int8 = [m for m in q8["modules"].values() if m["config"] == "int8"]
    saved = sum(m["bytes_before"] - m["bytes_packed"] for m in int8)
    assert q8["weight_bytes_packed"] == q8["weight_bytes_before"] - saved
    assert all(m["bytes_before"] // 4 < m["bytes_packed"] < m["bytes_before"] // 3 for m in int8)  # a byte + row scales


def test_int4_skip_report_lists_every_layer_the_group_cannot_take(runs):
    q = runs["int4-g32"]["quant"]
    down = {f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)}
    assert set(q["skipped"]) == down
    assert all("in_features 172 is not divisible by group_size 32" in why for why in q["skipped"].values())
    assert q["modules"]["lm_head"]["config"] is None and "quant.head=false" in q["modules"]["lm_head"]["reason"]
    applied = {n for n, m in q["modules"].items() if m["config"] == "int4-g32"}
    assert len(applied) == 6 * LAYERS and not applied & down  # q, k, v, o, gate, up per layer
    for name in down:
        assert q["modules"][name]["bytes_after"] == q["modules"][name]["bytes_before"]


def test_group_sizes_and_backends_fail_clearly():
    with pytest.raises(ValueError, match="group_size in"):
        quantize.build({"name": "int4", "group_size": 48})
    with pytest.raises(ValueError, match=r"tinygemm.*needs CUDA"):
        quantize.build({"name": "int4", "group_size": 32, "backend": "tinygemm"})(lm())
    with pytest.raises(ValueError, match=r"prototype.*bfloat16"):
        quantize.build({"name": "int4", "group_size": 32, "backend": "prototype"})(lm())
    with pytest.raises(ValueError, match="role"):
        quantize.build({"name": "policy", "rules": [{"role": "ffn", "config": "int8"}]})


def test_a_config_that_quantizes_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"quantizes none of LlamaForCausalLM's 37 linear, embedding and expert"):
        quantize.build({"name": "policy", "rules": [{"role": "linear", "config": "none"}]})(lm())


def test_a_linear_subclass_with_its_own_forward_is_refused():
    """Its forward may not call F.linear (Falcon's did not): a quantized weight there would fail or mislead."""

    class Doubled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = lm()
    model.model.layers[0].mlp.up_proj.__class__ = Doubled
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj is a Doubled, whose forward is not"):
        quantize.build({"name": "int8"})(model)


def test_int4_bf16_on_cpu_uses_the_prototype_backend():
    model = lm().to(torch.bfloat16)
    report = quantize.build({"name": "int4", "group_size": 64})(model)
    assert "PrototypeInt4WeightOnlyConfig" in report.backend["int4-g64 (prototype)"]
    # Its CPU packing needs out_features % 16 == 0: gate/up (172 out) are listed, as is down (172 in).
    mlp = {f"model.layers.{i}.mlp.{p}_proj" for i in range(LAYERS) for p in ("gate", "up", "down")}
    assert set(report.skipped) == mlp
    assert "out_features 172 is not a multiple of 16" in report.skipped["model.layers.0.mlp.up_proj"]
    ids = torch.randint(0, 512, (1, 32))
    assert torch.isfinite(model(ids).logits).all()


def test_weights_quantized_as_they_are_read_get_the_kernel_of_their_device(compose):
    """One process reads stories260K's checkpoint weight by weight, each quantized as it arrives; the int4 kernel is
    chosen while the weights are still unread (on the meta device): for bf16 on CPU, the CPU prototype, as when the
    model was loaded whole first (a meta weight's own device chose intx)."""
    r = evaluate(compose(*DATA, "quant=int4", "quant.group_size=64", "precision=bf16-true"))
    assert set(r["quant"]["backend"]) == {"int4-g64 (prototype)"} and r["quant"]["quantized_modules"] == 4 * LAYERS


def test_policy_quantizes_exactly_the_modules_its_rules_name():
    from torchao.quantization import Int8Tensor, IntxUnpackedToInt8Tensor

    model = lm()
    rules = [
        {"match": r"layers\.0\.", "config": "none"},  # first match wins: layer 0 stays float
        {"role": "attention", "config": "int4", "group_size": 32},
        {"match": r"mlp\.(gate|up)_proj$", "config": "int8"},
    ]
    report = quantize.build({"name": "policy", "rules": rules})(model)
    names = dict(model.named_modules())
    expect_int4 = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(1, LAYERS) for p in "qkvo"}
    expect_int8 = {f"model.layers.{i}.mlp.{p}_proj" for i in range(1, LAYERS) for p in ("gate", "up")}
    got_int4 = {n for n, m in names.items() if isinstance(getattr(m, "weight", None), IntxUnpackedToInt8Tensor)}
    got_int8 = {n for n, m in names.items() if isinstance(getattr(m, "weight", None), Int8Tensor)}
    assert got_int4 == expect_int4 and got_int8 == expect_int8
    assert {n for n, m in report.modules.items() if m["config"]} == expect_int4 | expect_int8
    assert report.modules["model.layers.0.self_attn.q_proj"]["reason"] == "rule 0 (layers\\.0\\.) says none"
    assert report.modules["model.layers.1.mlp.down_proj"]["reason"] == "no rule matches"
    assert sorted(report.quantized_params) == sorted(f"{n}.weight" for n in expect_int4 | expect_int8)


def test_tied_head_and_embeddings_stay_one_quantized_tensor():
    model = lm()
    report = quantize.build({"name": "policy", "rules": [{"role": "head", "config": "int8"}]})(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    assert report.modules["lm_head"]["tied_to"] == "model.embed_tokens"
    assert set(report.quantized_params) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert torch.isfinite(model(torch.randint(0, 512, (1, 16))).logits).all()
    conflict = [{"role": "head", "config": "int8"}, {"role": "embeddings", "config": "int4", "group_size": 32}]
    with pytest.raises(ValueError, match="share one weight"):
        quantize.build({"name": "policy", "rules": conflict})(lm())


def _consistency_worker(rank: int, store: str, out: str) -> None:
    """One rank of the consistency test: three scenarios, outcomes written to ``out``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for scenario, perturb, source in (("same", False, "local"), ("perturbed", True, "local"), ("rank0", True, "rank0")):
        model = ModelSpec(path=str(STORIES)).build()
        if perturb and rank == 1:
            with torch.no_grad():
                model.model.layers[3].self_attn.v_proj.weight.mul_(1.5)
        try:
            report = quantize.build({"name": "int4", "group_size": 32, "source": source})(model)
            w = model.model.layers[3].self_attn.v_proj.weight
            results[scenario] = {"ok": True, "digest": quant_check.digest(w), "consistency": report.consistency}
        except RuntimeError as err:
            results[scenario] = {"ok": False, "error": str(err)}
        dist.barrier()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_rank_consistency_check_and_rank0_source(tmp_path):
    require_shared()
    import torch.multiprocessing as mp

    out = tmp_path / "result"
    mp.start_processes(_consistency_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"result.{r}").read_text()) for r in (0, 1))
    assert r0["same"]["ok"] and r1["same"]["ok"] and r0["same"]["consistency"]["checked"]
    for r in (r0, r1):  # every rank aborts, naming the module that differs
        assert not r["perturbed"]["ok"]
        assert "differ across ranks" in r["perturbed"]["error"]
        assert "model.layers.3.self_attn.v_proj" in r["perturbed"]["error"]
        assert "layers.2" not in r["perturbed"]["error"]
    # quant.source=rank0: rank 1's perturbed weights are replaced by rank 0's quantization.
    assert r0["rank0"]["ok"] and r1["rank0"]["ok"]
    assert r0["rank0"]["digest"] == r1["rank0"]["digest"] == r0["same"]["digest"]


@pytest.mark.slow
def test_quantized_eval_and_compare_agree_across_world_sizes(compose, tmp_path):
    """int4 g32 + comparison at world size 1, then 2 × ddp and 2 × fsdp: the same numbers."""
    require_shared()
    args = [*DATA, "quant=int4", "quant.group_size=32", "compare=unquantized", "eval.seq_len=128"]
    single = evaluate(compose(*args))
    for strategy in ("ddp", "fsdp"):
        run_dir = tmp_path / strategy
        run_dir.mkdir()
        proc, r = run_entry(
            [*args, f"strategy={strategy}", "trainer.devices=2", f"data.cache_dir={tmp_path / 'cache'}"], run_dir
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert r["world_size"] == 2 and min(r["rank_tokens"]) > 0
        assert r["ppl"] == pytest.approx(single["ppl"], rel=1e-6), strategy
        assert r["quant"]["consistency"]["checked"] and r["quant"]["skipped"] == single["quant"]["skipped"]
        for key in ("kld_mean", "kld_p99", "kld_p50", "kld_min", "p_diff_p90", "same_top", "ppl_base"):
            assert r["compare"][key] == pytest.approx(single["compare"][key], rel=1e-6, abs=1e-12), (strategy, key)
        assert r["compare"]["tokens"] == single["compare"]["tokens"] == single["tokens"]


def widths_lm() -> torch.nn.Module:
    """A tiny Llama from its config with the widths real models have: hidden 96 (= 3·32), intermediate 192."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def test_a_layer_the_group_does_not_divide_takes_the_largest_group_that_does(caplog):
    from torchao.quantization import IntxUnpackedToInt8Tensor

    model = widths_lm()
    with caplog.at_level("WARNING", logger="lit_ppl.quant.apply"):
        report = quantize.build({"name": "int4", "group_size": 128})(model)
    q = report.to_dict()
    down = {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    assert set(q["adapted"]) == {n for n, m in q["modules"].items() if m["config"]} and not q["skipped"]
    assert all(q["adapted"][n] == {"requested": "int4-g128", "config": "int4-g64"} for n in down)
    assert all(a["config"] == "int4-g32" for n, a in q["adapted"].items() if n not in down)  # 96 = 3·32
    for name, a in q["adapted"].items():
        w = model.get_submodule(name).weight
        assert isinstance(w, IntxUnpackedToInt8Tensor) and w.block_size == (1, int(a["config"].split("g")[-1]))
    (line,) = [r.getMessage() for r in caplog.records]  # one short line: counts, reasons, the fix
    assert line.startswith("quantization: 14 of 14 layers took a smaller int4 group: in_features 96 is not a multiple")
    assert "quant.group_size=32 divides all" in line and len(line) < 300
    with pytest.raises(ValueError, match=r"would quantize none of the 14 layers .* or quant\.group_fallback=true"):
        quantize.build({"name": "int4", "group_size": 128, "group_fallback": False})(widths_lm())


def test_the_skip_warning_is_one_line_with_counts_and_the_fix(caplog):
    with caplog.at_level("WARNING", logger="lit_ppl.quant.apply"):
        quantize.build({"name": "int4", "group_size": 32})(lm())
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("quantization: 5 of 35 layers stay in full precision: in_features 172 is not divisible")
    assert "no int4 group size in (32, 64, 128, 256) divides in_features 172" in line and len(line) < 300
