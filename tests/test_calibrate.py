"""Calibrated quantization on the real stories260K: refusals, exact statistics, identical weights at 1-3 ranks.

AWQ and GPTQ run end to end on CPU, int8 and int4 (GPTQ on torch ops: lit_ppl.quant.calibrated.gptq_solver;
torchao 0.18's own ``gptq_quantize`` asserts a CUDA weight, and is kept for the tinygemm int4 layouts on a GPU).

Calibration text is Shakespeare; the evaluated text is TinyStories. Multi-rank runs are real gloo processes.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, SHARED, STORIES, TINYSTORIES, require_shared, run_entry
from helpers.runs import torchrun_sweep

from lit_ppl.config.quant import quant_config
from lit_ppl.data.sampler import global_batches
from lit_ppl.data.sources import DataSpec
from lit_ppl.model.spec import ModelSpec
from lit_ppl.quant import quantizer as quantize
from lit_ppl.quant.calibrated.awq import candidate_scales
from lit_ppl.quant.calibrated.text import Calibration, CalibrationSpec, prepare_calibration

SHAKESPEARE = SHARED / "tinyshakespeare.txt"
# Windows of 256, 256, 256, 256 and 88 tokens in batches of 2: three batches (2 + 1 at two ranks, 1 + 1 + 1 at
# three); a small scale grid keeps the tests quick on two CPUs.
SMALL = {"tokens": 1112, "seq_len": 256, "batch_size": 2, "grid": 5}


def awq_cfg(cache, **calibration) -> dict:
    return {
        "name": "int8",
        "method": "awq",
        "calibration": {"path": str(SHAKESPEARE), "cache_dir": str(cache), **SMALL, **calibration},
    }


@functools.cache
def _loaded() -> torch.nn.Module:
    return ModelSpec(path=str(STORIES)).build()


def lm() -> torch.nn.Module:
    """A fresh copy of stories260K (loaded once per process: a load takes a second or more)."""
    require_shared()
    return copy.deepcopy(_loaded())


@functools.cache
def tokenizer():
    return ModelSpec(path=str(STORIES)).tokenizer()  # read once: loading it takes seconds


def calibration(cache, **overrides) -> Calibration:
    spec = CalibrationSpec.from_cfg(quant_config(awq_cfg(cache, **overrides)).calibration, "awq")
    return Calibration(spec, prepare_calibration(spec, tokenizer(), None))


def linear_configs(model: torch.nn.Module) -> dict:
    """Int8 for every linear layer but the (tied) head, as ``quant=awq`` chooses."""
    from torchao.quantization import Int8WeightOnlyConfig

    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    return {n: Int8WeightOnlyConfig() for n in linear}


def reference_inputs(cal: Calibration) -> tuple[torch.nn.Module, dict[str, list[torch.Tensor]]]:
    """One process, every calibration input of every linear layer but the head kept (real positions only)."""
    model = lm()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    real: list[torch.Tensor] = []
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: inputs[n].append(a[0][real[-1]]))
        for n in names
    ]
    with torch.no_grad():
        for ids in global_batches(cal.windows.lengths, cal.spec.config.batch_size):  # the batches every world size runs
            input_ids, mask = cal.batch(ids, torch.device("cpu"))
            real.append(mask)
            model.model(input_ids=input_ids, use_cache=False)
    for h in hooks:
        h.remove()
    return model, inputs


def assert_xtx_close(got: torch.Tensor, x: torch.Tensor) -> None:
    """``got`` equals ``xᵀx`` to 1e-12 of ``|x|ᵀ|x|``: the scale of a float64 sum's rounding. An entry whose terms
    cancel (Σ xᵢxⱼ ≈ 0) has no meaningful relative error, so plain ``rtol`` would judge noise."""
    want = x.T @ x
    bound = 1e-12 * (x.abs().T @ x.abs())
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound.clamp(min=1e-300)).max())
    torch.testing.assert_close(got.diagonal(), want.diagonal(), rtol=1e-12, atol=0)  # no cancellation there


def reference_statistics(cal: Calibration) -> dict[str, dict[str, torch.Tensor]]:
    """One process, every calibration input kept: Σ|x|, the count and each candidate's Σ error², in float64."""
    from torchao.quantization import Int8WeightOnlyConfig

    from lit_ppl.quant.calibrated.awq import quantize_weight

    model, inputs = reference_inputs(cal)
    names = list(inputs)
    out = {}
    for n in names:
        x = torch.cat(inputs[n]).to(torch.float64)
        w = model.get_submodule(n).weight
        scales = candidate_scales(x.abs().sum(0) / x.shape[0], cal.spec.config.grid, w.dtype)
        errors = []
        for s in scales:
            q = quantize_weight(w * s, Int8WeightOnlyConfig())
            # Per batch, as the model computed them (float32 products), then one float64 sum over the whole set.
            diff = [(F.linear(xb, w) - F.linear(xb * (1.0 / s), q)).to(torch.float64) for xb in inputs[n]]
            errors.append(torch.cat(diff).pow(2).sum())
        out[n] = {"abs_sum": x.abs().sum(0), "count": torch.tensor(x.shape[0]), "errors": torch.stack(errors)}
    return out


# --- refusals -----------------------------------------------------------------------------------------------


def test_calibrating_on_the_evaluated_text_is_refused(tmp_path):
    require_shared()
    same = awq_cfg(tmp_path) | {"calibration": {"path": str(TINYSTORIES), "cache_dir": str(tmp_path)}}
    with pytest.raises(ValueError, match=r"quant\.calibration\.path=.*tinystories_sample.txt.* is the evaluated text"):
        quantize.build(same, tokenizer(), DataSpec(path=str(TINYSTORIES)))
    copy = tmp_path / "renamed.txt"  # the same text under another name is still the evaluated text
    shutil.copy(TINYSTORIES, copy)
    renamed = awq_cfg(tmp_path) | {"calibration": {"path": str(copy), "cache_dir": str(tmp_path)}}
    with pytest.raises(ValueError, match="allow_overlap=true"):
        quantize.build(renamed, tokenizer(), DataSpec(path=str(TINYSTORIES)))
    renamed["calibration"]["allow_overlap"] = True
    assert quantize.build(renamed, tokenizer(), DataSpec(path=str(TINYSTORIES))) is not None


def test_an_empty_calibration_set_is_refused(tmp_path):
    require_shared()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = awq_cfg(tmp_path) | {"calibration": {"path": str(empty), "cache_dir": str(tmp_path)}}
    with pytest.raises(ValueError, match=r"quant\.calibration\.path=.*empty\.txt.*no tokens"):
        quantize.build(cfg, tokenizer(), DataSpec(path=str(TINYSTORIES)))
    with pytest.raises(ValueError, match=r"quant\.calibration\.tokens=0 must be a positive integer"):
        quantize.build(awq_cfg(tmp_path, tokens=0), tokenizer())
    with pytest.raises(ValueError, match=r"needs calibration text: set quant\.calibration\.path"):
        quantize.build({"name": "int8", "method": "awq"}, tokenizer())


def test_calibration_windows_spread_over_a_longer_text(tmp_path):
    """Of a text longer than quant.calibration.tokens, whole windows spread evenly over it — the first at its
    start, the last its last whole window — reading exactly ``tokens``, the last window cut; a text shorter than
    ``tokens`` is read whole, window after window."""
    import numpy as np

    require_shared()
    seq = SMALL["seq_len"]
    cal = calibration(tmp_path)
    start, lengths = cal.windows.start, cal.windows.lengths
    assert cal.tokens == SMALL["tokens"] and lengths.tolist() == [seq] * 4 + [SMALL["tokens"] - 4 * seq]
    assert cal.text_tokens > 100 * SMALL["tokens"] and (start % seq == 0).all()
    assert start[0] == 0 and start[-1] == (cal.text_tokens // seq - 1) * seq, start
    gaps = np.diff(start) // seq
    assert gaps.min() >= gaps.max() - 1 and gaps.min() > 100, gaps  # even, not the text's first pages
    inputs = cal.batch([4], torch.device("cpu"))[0]
    assert inputs[0, : lengths[4]].tolist() == cal.corpus.tokens[start[4] : start[4] + lengths[4]].tolist()
    assert cal.describe()["text_tokens"] == cal.text_tokens

    short = tmp_path / "short.txt"
    short.write_text(SHAKESPEARE.read_text()[:1500])
    whole = calibration(tmp_path, path=str(short))
    assert whole.tokens == whole.text_tokens < SMALL["tokens"]
    assert (np.diff(whole.windows.start) == seq).all() and whole.windows.start[0] == 0


def test_calibration_and_auto_run_under_every_split_layout():
    from lit_ppl.parallel.layout import Layout

    layouts = [Layout(1, 2, 1), Layout(2, 2, 1), Layout(1, 1, 2), Layout(1, 2, 2)]  # fsdp, hsdp, tp, fsdp_tp
    for layout in layouts:
        for method in ("awq", "gptq"):
            quantize.check_layout(quant_config({"name": "int4", "method": method}), layout)
        quantize.check_layout(quant_config({"name": "auto", "budget": {"kld": 0.01}}), layout)
        with pytest.raises(ValueError, match=r"quant\.source=rank0 with strategy layout"):
            quantize.check_layout(quant_config({"name": "int4", "method": "awq", "source": "rank0"}), layout)


def test_methods_that_cannot_run_here_are_refused_in_one_line(tmp_path):
    require_shared()
    with pytest.raises(ValueError, match=r"quant\.method=gptq needs calibration text: set quant\.calibration\.path"):
        quantize.build({"name": "int8", "method": "gptq"}, tokenizer())
    prototype = awq_cfg(tmp_path) | {"name": "int4", "method": "gptq", "group_size": 32}
    with pytest.raises(ValueError, match=r"method=gptq .* the CPU bf16 prototype packing has none to set: use quant"):
        quantize.build(prototype, tokenizer())(lm().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"quant\.method=hqq .* chooses int4 group scales: use config int4"):
        quantize.build({"name": "int8", "method": "hqq"})(lm())
    with pytest.raises(ValueError, match=r"method=awq .* is weight-only .* int8dq"):
        quantize.build(awq_cfg(tmp_path) | {"name": "int8dq"}, tokenizer())(lm())
    tied = awq_cfg(tmp_path) | {"head": True}
    with pytest.raises(
        ValueError, match=r"(lm_head|model\.embed_tokens): .*a tied head/embedding table has none: give it method=rtn"
    ):
        quantize.build(tied, tokenizer())(lm())
    with pytest.raises(ValueError, match=r"quant\.method='smooth' .* is not one of rtn, awq, gptq, hqq"):
        quantize.build({"name": "int8", "method": "smooth"})
    with pytest.raises(ValueError, match=r"quant\.gptq\.damp=1\.5 must be in \[0, 1\)"):
        quantize.build(awq_cfg(tmp_path) | {"method": "gptq", "gptq": {"damp": 1.5}}, tokenizer())(lm())


# --- what AWQ does ------------------------------------------------------------------------------------------


def test_policy_rules_choose_the_method_per_module(tmp_path):
    from torchao.quantization import Int8Tensor

    require_shared()
    cfg = awq_cfg(tmp_path) | {
        "name": "policy",
        "method": "rtn",
        "rules": [{"role": "attention", "config": "int8", "method": "awq"}, {"role": "mlp", "config": "int8"}],
    }
    model = lm()
    report = quantize.build(cfg, tokenizer(), DataSpec(path=str(TINYSTORIES)))(model)
    for name, entry in report.modules.items():
        if ".self_attn." in name:
            assert entry["method"] == "awq" and 0 <= entry["awq_ratio"] < 1 and entry["awq_error_vs_rtn"] <= 1
            assert model.get_submodule(name).weight.act_pre_scale is not None
        elif ".mlp." in name:
            assert entry["method"] == "rtn" and "awq_ratio" not in entry
            assert model.get_submodule(name).weight.act_pre_scale is None
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, Int8Tensor)
    cal = report.to_dict()["calibration"]
    assert cal["source"] == str(SHAKESPEARE.resolve()) and cal["tokens"] == SMALL["tokens"] and cal["windows"] == 5
    assert torch.isfinite(model(torch.randint(0, 512, (1, 16))).logits).all()


def test_statistics_equal_a_float64_computation_over_the_whole_set(tmp_path):
    from lit_ppl.quant.calibrated.awq import awq_statistics

    require_shared()
    cal = calibration(tmp_path, batch_size=3)  # [256, 256, 256] and [256, 88 + padding]: padding is left out
    model = lm()
    configs = linear_configs(model)
    got = awq_statistics(model, configs, cal, 0, 1)
    want = reference_statistics(cal)
    assert set(got) == set(want)
    for n in want:
        assert int(got[n]["count"]) == int(want[n]["count"]) == SMALL["tokens"]
        torch.testing.assert_close(got[n]["abs_sum"], want[n]["abs_sum"], rtol=1e-12, atol=0)
        torch.testing.assert_close(got[n]["errors"], want[n]["errors"], rtol=1e-12, atol=0)


def test_gptq_hessians_equal_a_float64_xtx_over_the_whole_set(tmp_path):
    from lit_ppl.quant.calibrated.gptq import gptq_hessians

    require_shared()
    cal = calibration(tmp_path, batch_size=3)  # padding in the last batch is left out
    model, inputs = reference_inputs(cal)
    got = gptq_hessians(model, list(inputs), cal, 0, 1)
    for n, xs in inputs.items():
        x = torch.cat(xs).to(torch.float64)
        assert int(got[n]["count"]) == x.shape[0] == SMALL["tokens"]
        assert_xtx_close(got[n]["xtx"], x)


def test_gptq_refusals_on_cuda_are_decided_without_one():
    """What a GPU would refuse (tinygemm without mslk, int8dq, a tied table) is decided by the plan, testable here."""
    import importlib.util

    from lit_ppl.quant.methods import METHODS
    from lit_ppl.quant.schemes import Scheme
    from lit_ppl.quant.targets import find_targets

    require_shared()
    targets = find_targets(lm())
    q, embed = targets["model.layers.0.self_attn.q_proj"], targets["model.embed_tokens"]

    def problem(scheme: Scheme, kernel: str | None, target, tied: bool = False) -> str | None:
        return METHODS["gptq"].problem(scheme, kernel, target, tied, "role linear")

    assert problem(Scheme("int8"), None, q) is None
    assert problem(Scheme("int4", 32), "intx", q) is None  # lit-ppl's GPTQ on torch ops, on CUDA too
    if importlib.util.find_spec("mslk") is None:
        assert "needs the mslk package" in problem(Scheme("int4", 32), "tinygemm", q)
    assert "weight-only" in problem(Scheme("int8dq"), None, q)
    assert "a tied head/embedding table has none" in problem(Scheme("int8"), None, q, tied=True)
    assert "an embedding weight has none" in problem(Scheme("int8"), None, embed)


def test_gptq_quantization_itself_needs_cuda(tmp_path):
    """torchao's GPTQ core refuses CPU tensors before any arithmetic; lit-ppl says so in one line first."""
    from torchao.prototype.gptq import GPTQConfig, gptq_quantize
    from torchao.quantization import Int8WeightOnlyConfig

    from lit_ppl.quant.calibrated.gptq import gptq_weight

    x = torch.randn(64, 32, dtype=torch.float64)
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match=r"GPTQ needs a CUDA GPU .* the weights are on cpu"):
        gptq_weight(x.T @ x, 64, w, Int8WeightOnlyConfig())
    # If this starts passing, torchao runs GPTQ on CPU: test the ranks' GPTQ weights here, not only on a GPU.
    with pytest.raises(AssertionError, match="GPTQ only supports CUDA currently"):
        gptq_quantize((x.T @ x).float(), w, GPTQConfig(step="convert", base_config=Int8WeightOnlyConfig()))


def int4_configs(model: torch.nn.Module, group: int = 32) -> dict:
    """torchao's CPU int4 config for every linear layer the group size divides (the tied head excluded)."""
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    cfg = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group))
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    return {n: cfg for n, m in linear.items() if m.in_features % group == 0}


def test_gptq_on_uncorrelated_inputs_is_torchaos_round_to_nearest_bit_for_bit():
    """A diagonal XᵀX feeds no error to other columns: GPTQ must then give torchao's own RTN tensor, codes,
    scales and zero points, which checks that the solver's grid and codes are torchao's."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    from lit_ppl.config.quant import GptqConfig
    from lit_ppl.quant.calibrated.awq import quantize_weight
    from lit_ppl.quant.calibrated.gptq_solver import gptq_tensor
    from lit_ppl.quant.consistency import digest

    torch.manual_seed(0)
    w = torch.randn(48, 128)
    xtx = torch.diag(torch.rand(128, dtype=torch.float64) + 0.1)
    for config in (IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)), Int8WeightOnlyConfig()):
        rtn = quantize_weight(w, config)
        for act_order in (False, True):
            got, _ = gptq_tensor(xtx, w, config, GptqConfig(act_order=act_order, block_size=64))
            assert type(got) is type(rtn) and digest(got) == digest(rtn), (config, act_order)
            torch.testing.assert_close(got.dequantize(), rtn.dequantize(), rtol=0, atol=0)


def textbook_gptq(w: torch.Tensor, xtx: torch.Tensor, g: int, act_order: bool, damp: float = 0.01) -> torch.Tensor:
    """Frantar et al.'s Algorithm 1 one column at a time (no lazy blocks), the authors' symmetric int4 grid (scale
    ``amax / 7.5``, codes −8…7), a group's from its columns as the errors left them (the authors' code reads it
    before its lazy block's own feedback: benchmarks/README.md), act-order's static groups from the original
    weight; dequantized."""
    W, H = w.double().clone(), xtx.clone()
    dead = H.diagonal() == 0
    H[dead, dead], W[:, dead] = 1.0, 0.0

    def scale(cols: torch.Tensor) -> torch.Tensor:  # float32, as torchao computes it from the float32 weight
        return cols.float().abs().amax(1) / 7.5

    static = [scale(W[:, j : j + g]) for j in range(0, W.shape[1], g)]
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else torch.arange(W.shape[1])
    W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.empty_like(W)
    for i, col in enumerate(perm.tolist()):
        if not act_order and col % g == 0:
            static[col // g] = scale(W[:, i : i + g])
        s = static[col // g]
        Q[:, i] = (torch.clamp(torch.round(W[:, i].float() * (1 / s)), -8, 7) * s).double()
        W[:, i:] -= ((W[:, i] - Q[:, i]) / U[i, i])[:, None] * U[i, i:][None, :]
    return Q[:, torch.argsort(perm)]


def test_gptq_solver_equals_the_textbook_algorithm_column_by_column():
    """Act-order off (lazy blocks of 64 columns, groups of 32: a group's grid read mid-block) and on (blocks of 48),
    a dead input: lit-ppl's solver gives the codes of Algorithm 1 computed one column at a time."""
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    from lit_ppl.config.quant import GptqConfig
    from lit_ppl.quant.calibrated.gptq_solver import gptq_tensor

    torch.manual_seed(0)
    w = torch.randn(24, 192)
    x = torch.randn(400, 192, dtype=torch.float64) @ torch.randn(192, 192, dtype=torch.float64)  # correlated inputs
    x[:, 5] = 0.0
    config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    for act_order in (False, True):
        got = gptq_tensor(x.T @ x, w, config, GptqConfig(act_order=act_order, block_size=48))[0].dequantize()
        want = textbook_gptq(w, x.T @ x, 32, act_order)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6, msg=f"act_order={act_order}")


def test_gptq_lowers_every_layers_output_error_below_round_to_nearest(tmp_path):
    """On the calibration inputs themselves, ‖XWᵀ − XQᵀ‖² of GPTQ's Q is below RTN's for every int4 layer."""
    from lit_ppl.config.quant import GptqConfig
    from lit_ppl.quant.calibrated.awq import quantize_weight
    from lit_ppl.quant.calibrated.gptq_solver import gptq_tensor

    require_shared()
    cal = calibration(tmp_path)
    model, inputs = reference_inputs(cal)
    for name, config in int4_configs(model).items():
        x, w = torch.cat(inputs[name]), model.get_submodule(name).weight.detach()
        x64 = x.to(torch.float64)
        err = {}
        for label, q in (
            ("rtn", quantize_weight(w, config)),
            ("gptq", gptq_tensor(x64.T @ x64, w, config, GptqConfig())[0]),
        ):
            err[label] = float((x64 @ (w.double() - q.dequantize().double()).T).pow(2).sum())
        assert err["gptq"] < err["rtn"], (name, err)


def kld_to_float(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean KL(float ‖ model) per token of ``ids``, ``ref`` the float model's log-probabilities (float64)."""
    with torch.no_grad():
        got = torch.log_softmax(model(ids).logits.double(), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def test_calibrated_int4_runs_on_cpu_and_beats_round_to_nearest(tmp_path):
    """quant=int4 with method awq, gptq (one pass; sequential) and hqq on CPU float32: torchao's int4 tensor (AWQ
    with its input pre-scale), each closer to the float model than RTN on text it was not calibrated on."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    from lit_ppl.quant.calibrated.awq import PRE_SCALE

    require_shared()
    ids = torch.tensor(tokenizer().encode(TINYSTORIES.read_text())[:1792]).view(7, 256)  # not the calibration text
    with torch.no_grad():
        ref = torch.log_softmax(lm()(ids).logits.double(), -1)
    kld = {}
    for label, extra in (
        ("rtn", {"method": "rtn"}),
        ("awq", {"method": "awq"}),
        ("gptq", {"method": "gptq"}),
        ("gptq-seq", {"method": "gptq", "gptq": {"sequential": True}}),
        ("hqq", {"method": "hqq"}),
    ):
        model = lm()
        cfg = awq_cfg(tmp_path, tokens=512) | {"name": "int4", "group_size": 32} | extra  # one batch of 2 × 256
        report = quantize.build(cfg, tokenizer())(model)
        layers = {n for n, e in report.modules.items() if e["config"]}
        assert len(layers) == 30 and all(report.modules[n]["method"] == extra["method"] for n in layers)
        assert all(isinstance(model.get_submodule(n).weight, IntxUnpackedToInt8Tensor) for n in layers)
        assert all(hasattr(model.get_submodule(n), PRE_SCALE) == (label == "awq") for n in layers)
        kld[label] = kld_to_float(model, ids, ref)
    # With 1,112 calibration tokens and grid 20 (benchmarks/README.md, "INT4 methods"): rtn 0.121, awq 0.107,
    # gptq 0.086, gptq-seq 0.090, hqq 0.100; here 512 tokens and grid 5, to keep the test quick.
    assert all(kld[m] < kld["rtn"] for m in ("awq", "gptq", "gptq-seq", "hqq")), kld


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchao's GPTQ runs on CUDA only (tested on CPU: above)")
def test_gptq_int8_quantizes_every_linear_layer_on_cuda(tmp_path):
    from torchao.quantization import Int8Tensor

    require_shared()
    model = lm().cuda()
    report = quantize.build(awq_cfg(tmp_path) | {"method": "gptq"}, tokenizer())(model)
    layers = {n: e for n, e in report.modules.items() if e["config"]}
    assert layers and all(e["method"] == "gptq" and e["gptq_tokens"] == SMALL["tokens"] for e in layers.values())
    assert all(isinstance(model.get_submodule(n).weight, Int8Tensor) for n in layers)
    assert report.calibration["method"] == "gptq" and report.calibration["tokens"] == SMALL["tokens"]
    assert torch.isfinite(model(torch.randint(0, 512, (1, 16), device="cuda")).logits).all()


# --- ranks --------------------------------------------------------------------------------------------------


INT4_CALIBRATED = {
    "awq": {"name": "int4", "group_size": 32, "method": "awq"},
    "gptq": {"name": "int4", "group_size": 32, "method": "gptq", "gptq": {"act_order": True}},
    "gptq-seq": {"name": "int4", "group_size": 32, "method": "gptq", "gptq": {"sequential": True}},
}


def _in_each_world(rank: int, work, store: str, out: str) -> None:
    """One spawned process: ``work(rank, world)`` in a gloo group of 3 ranks, then (ranks 0 and 1) in a new group
    of 2, each result saved to ``{out}{world}.{rank}``: both world sizes on one launch of processes."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for world in (3, 2):
        if rank >= world:
            return
        dist.init_process_group("gloo", init_method=f"file://{store}{world}", rank=rank, world_size=world)
        try:
            work(rank, world, f"{out}{world}.{rank}")
        finally:
            dist.destroy_process_group()


def _rank_worker(rank: int, cache: str, store: str, out: str) -> None:
    _in_each_world(rank, functools.partial(_rank_work, cache=cache), store, out)


# SMALL's three batches (2 + 1 at two ranks, 1 + 1 + 1 at three) from half its tokens: windows of 4 × 128 and 44.
HALF = {"tokens": 556, "seq_len": 128}


def _rank_work(rank: int, world: int, path: str, cache: str) -> None:
    """One rank: the reduced statistics, then the whole quantization with source=local and source=rank0."""
    from lit_ppl.quant.calibrated.awq import awq_statistics

    cal = calibration(cache, **HALF)
    model = lm()
    configs = linear_configs(model)
    stats = awq_statistics(model, configs, cal, rank, world)
    result: dict = {"stats": {n: {k: v.tolist() for k, v in st.items() if k != "scales"} for n, st in stats.items()}}
    for source in ("local", "rank0"):
        model = lm()
        report = quantize.build(awq_cfg(cache, **HALF) | {"source": source}, tokenizer())(model)
        result[source] = {"consistency": report.consistency, "calibration": report.calibration}
    for label, extra in INT4_CALIBRATED.items():  # int4 on CPU: AWQ with its input pre-scale, GPTQ on torch ops
        report = quantize.build(awq_cfg(cache, **HALF) | extra, tokenizer())(lm())
        solvers = {e["gptq_solved_by"] for e in report.modules.values() if "gptq_solved_by" in e}
        result[label] = {"consistency": report.consistency, "calibration": report.calibration}
        result[label]["solvers"] = sorted(solvers)
    with open(path, "w") as f:
        json.dump(result, f)


@pytest.mark.slow
def test_one_two_and_three_ranks_calibrate_to_identical_weights(tmp_path):
    """AWQ int8 (statistics and weights), AWQ int4 and GPTQ int4 (act-order; sequential): every quantized weight's
    hash (AWQ's input pre-scales included) at 2 and 3 gloo ranks equals 1 rank's."""
    import torch.multiprocessing as mp

    require_shared()
    cal = calibration(tmp_path, **HALF)  # the token store, built once before the ranks start
    assert len(cal.batches(0, 1)) == 3, cal.windows.lengths  # SMALL's batch structure, as HALF says
    cfg = awq_cfg(tmp_path, **HALF)
    single = quantize.build(cfg, tokenizer())(lm())
    int4 = {k: quantize.build(cfg | e, tokenizer())(lm()).consistency for k, e in INT4_CALIBRATED.items()}
    assert len({c["digest"] for c in int4.values()} | {single.consistency["digest"]}) == 4  # four different models
    want = reference_statistics(cal)
    # Three processes start once: a group of 3, then ranks 0 and 1 in a fresh group of 2 (imports take seconds).
    args = (str(tmp_path), str(tmp_path / "store"), str(tmp_path / "w"))
    mp.start_processes(_rank_worker, args=args, nprocs=3, start_method="spawn")
    for world in (2, 3):
        ranks = [json.loads((tmp_path / f"w{world}.{r}").read_text()) for r in range(world)]
        for r in ranks:
            for n, st in want.items():  # every rank holds the whole set's sums, equal to the single-process ones
                torch.testing.assert_close(torch.tensor(r["stats"][n]["abs_sum"], dtype=torch.float64), st["abs_sum"])
                torch.testing.assert_close(torch.tensor(r["stats"][n]["errors"], dtype=torch.float64), st["errors"])
                assert r["stats"][n]["count"] == HALF["tokens"]
            assert r["stats"] == ranks[0]["stats"]  # bit for bit: one all_reduce gives every rank the same numbers
            for source in ("local", "rank0"):
                consistency = r[source]["consistency"]
                assert consistency["checked"] and consistency["world_size"] == world
                assert consistency["digest"] == single.consistency["digest"], (world, source)
            for label, one in int4.items():
                assert r[label]["calibration"]["world_size"] == world and r[label]["consistency"]["checked"]
                assert r[label]["consistency"]["digest"] == one["digest"], (world, label)
                # GPTQ's solves shared out: every rank solved some layers, the others received its codes
                assert r[label]["solvers"] == ([] if label == "awq" else list(range(world))), (world, label)
        assert ranks[0]["local"]["calibration"]["world_size"] == world
        assert ranks[0]["rank0"]["calibration"]["world_size"] == 1  # rank 0 calibrated on the whole set
        assert ranks[1]["rank0"]["calibration"] is None  # and the others received its weights


def _ddp(world: int, source: str, cache) -> list[str]:
    return ["strategy=ddp", f"trainer.devices={world}", f"quant.source={source}", f"data.cache_dir={cache}"]


@pytest.mark.slow
def test_awq_evaluation_is_the_same_at_one_two_and_three_ranks(compose, tmp_path):
    from lit_ppl.run import evaluate

    require_shared()
    cal = [f"quant.calibration.{k}={v}" for k, v in SMALL.items()]
    args = [
        "model=hf",
        f"model.path={STORIES}",
        "data=text",
        f"data.path={TINYSTORIES}",
        "trainer=cpu",
        "quant=awq",
        f"quant.calibration.path={SHAKESPEARE}",
        *cal,
        "eval.seq_len=128",
    ]
    single = evaluate(compose(*args))
    assert single["quant"]["calibration"]["tokens"] == SMALL["tokens"]
    assert single["quant"]["calibration"]["source"] == str(SHAKESPEARE.resolve())
    runs = {}
    proc, runs[3, "local"] = run_entry([*args, *_ddp(3, "local", tmp_path)], tmp_path / "3-local", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Both 2-rank sources on one torchrun launch of 2 ranks (a Hydra sweep over quant.source).
    two = torchrun_sweep([*args, *_ddp(2, "local,rank0", tmp_path)], 2, tmp_path / "2-sweep", timeout=600)
    runs[2, "local"], runs[2, "rank0"] = two
    for (world, source), r in runs.items():
        assert r["quant"]["source"] == source, (world, r["quant"])
        assert r["world_size"] == world
        assert r["quant"]["consistency"]["digest"] == single["quant"]["consistency"]["digest"], (world, source)
        assert r["ppl"] == pytest.approx(single["ppl"], rel=1e-6), (world, source)


def _gptq_rank_worker(rank: int, cache: str, store: str, out: str) -> None:
    _in_each_world(rank, functools.partial(_gptq_rank_work, cache=cache), store, out)


def _gptq_rank_work(rank: int, world: int, path: str, cache: str) -> None:
    """One rank: its shard's Hessians, reduced over the ranks, saved for the parent to compare."""
    from lit_ppl.quant.calibrated.gptq import gptq_hessians

    cal = calibration(cache)
    model = lm()
    names = list(linear_configs(model))
    local = len(cal.batches(rank, world))
    torch.save({"batches": local, "hessians": gptq_hessians(model, names, cal, rank, world)}, path)


@pytest.mark.slow
def test_gptq_hessians_are_identical_on_every_rank_and_equal_the_whole_set(tmp_path):
    import torch.multiprocessing as mp

    require_shared()
    cal = calibration(tmp_path)  # the token store, built once before the ranks start
    _, inputs = reference_inputs(cal)
    want = {n: torch.cat(xs).to(torch.float64) for n, xs in inputs.items()}
    # Three processes start once: a group of 3, then ranks 0 and 1 in a fresh group of 2 (imports take seconds).
    args = (str(tmp_path), str(tmp_path / "gstore"), str(tmp_path / "g"))
    mp.start_processes(_gptq_rank_worker, args=args, nprocs=3, start_method="spawn")
    for world in (2, 3):
        ranks = [torch.load(tmp_path / f"g{world}.{r}") for r in range(world)]
        assert all(r["batches"] >= 1 for r in ranks)  # every rank really saw a shard of its own
        for r in ranks:
            for n, x in want.items():
                got = r["hessians"][n]
                assert int(got["count"]) == SMALL["tokens"]
                assert_xtx_close(got["xtx"], x)
                assert torch.equal(got["xtx"], ranks[0]["hessians"][n]["xtx"]), (world, n)  # bit for bit


# --- memory -------------------------------------------------------------------------------------------------

_MEASURE = """
import json, sys, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
import test_calibrate as t
from lit_ppl.quant.calibrated.awq import awq_statistics
torch.set_num_threads(1)
cal = t.calibration(Path({cache!r}), tokens={tokens}, seq_len=512, batch_size=8)
model = t.lm()
configs = t.linear_configs(model)
kib = lambda key: int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current resident size
before = kib("VmRSS:")
awq_statistics(model, configs, cal, 0, 1)
print(json.dumps({{"before_kib": before, "peak_kib": kib("VmHWM:"), "tokens": cal.tokens}}))
"""


def calibration_peak(cache, tokens: int) -> dict:
    """Peak resident memory of one calibration in a fresh process (Linux ``/proc``)."""
    code = _MEASURE.format(tests=str(ROOT / "tests"), cache=str(cache), tokens=tokens)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_calibration_memory_does_not_grow_with_the_calibration_set(tmp_path):
    require_shared()
    calibration(tmp_path)
    small, large = calibration_peak(tmp_path, 8192), calibration_peak(tmp_path, 32768)
    assert (small["tokens"], large["tokens"]) == (8192, 32768)
    # Keeping the inputs, as torchao's AWQObserver does, would add ~11 KB per token here (7 linear inputs per
    # layer, 5 layers, float32): ~270 MiB more for the larger set. Measured 43 MiB more over a peak of 419 MiB, where
    # a bound of 10% of the peak had passed before: too close to the edge to stay.
    assert large["peak_kib"] - small["peak_kib"] < 100 * 1024, (small, large)


def test_awq_int4_on_the_bf16_cpu_prototype_uses_torchaos_pre_scale(tmp_path):
    from lit_ppl.quant.calibrated.awq import PRE_SCALE

    require_shared()
    model = lm().to(torch.bfloat16)
    rules = [{"match": r"layers\.0\.self_attn", "config": "int4", "group_size": 64}]  # its bf16 kernels are slow
    cfg = awq_cfg(tmp_path, tokens=256, grid=2) | {"name": "policy", "rules": rules}
    report = quantize.build(cfg, tokenizer())(model)
    layers = [n for n, e in report.modules.items() if e["config"]]
    assert len(layers) == 4 and "PrototypeInt4WeightOnlyConfig" in report.backend["awq int4-g64 (prototype)"]
    for name in layers:
        mod = model.get_submodule(name)
        assert mod.weight.act_pre_scale is not None and not hasattr(mod, PRE_SCALE)
    assert torch.isfinite(model(torch.randint(0, 512, (1, 16))).logits).all()


# --- split layouts ------------------------------------------------------------------------------------------


def _int4_args(method: str, cache) -> list[str]:
    """Calibrated int4 (g32) of stories260K on TinyStories; each layer's statistics from Shakespeare in SMALL's
    three batches (2 + 1 at two ranks)."""
    return [
        "model=hf",
        f"model.path={STORIES}",
        "data=text",
        f"data.path={TINYSTORIES}",
        f"data.cache_dir={cache}",
        "trainer=cpu",
        "report.plots=false",
        f"quant={method}",
        "quant.name=int4",
        "quant.group_size=32",
        f"quant.calibration.path={SHAKESPEARE}",
        *(f"quant.calibration.{k}={v}" for k, v in SMALL.items()),
        "eval.seq_len=128",
        "++quant.gptq.act_order=true",  # GPTQ's options (AWQ has none to read)
        "++quant.gptq.sequential=true",
    ]


@pytest.mark.slow
def test_calibrated_int4_under_fsdp_is_one_process_model_and_tp_its_perplexity(compose, tmp_path):
    """AWQ and GPTQ (act-order, sequential) int4 at fsdp × 2 (each rank calibrates on its share of the batches) hold
    the weights of one process bit for bit (the layout-free digest), so the same perplexity; at tp × 2 (each split
    layer observed and solved whole, o_proj's GPTQ error feedback over its whole rows) the perplexity within 1e-4."""
    from lit_ppl.run import evaluate

    require_shared()
    # One process in deterministic mode (one thread, as each torchrun rank here: OMP_NUM_THREADS=1); the ranks run
    # without it, which tp refuses (its split sums round differently) and calibration does not read.
    single = {m: evaluate(compose(*_int4_args(m, tmp_path), "eval.deterministic=true")) for m in ("awq", "gptq")}
    assert len({r["quant"]["digest"] for r in single.values()}) == 2
    # One torchrun launch of 2 ranks runs the four jobs: quant × strategy, in Hydra's sweep order.
    args = [*_int4_args("awq,gptq", tmp_path), "strategy=fsdp,tp", "trainer.devices=2"]
    runs = torchrun_sweep(args, 2, tmp_path / "split", timeout=900)
    assert len(runs) == 4
    for r in runs:
        method, kind = r["quant"]["modules"]["model.layers.0.self_attn.q_proj"]["method"], r["parallel"]["kind"]
        one = single[method]
        assert r["world_size"] == 2 and r["quant"]["calibration"]["tokens"] == SMALL["tokens"], (method, kind)
        assert method == "awq" or r["quant"]["calibration"]["gptq"]["act_order"]
        o_proj = r["quant"]["modules"]["model.layers.0.self_attn.o_proj"]
        assert o_proj["config"] == one["quant"]["modules"]["model.layers.0.self_attn.o_proj"]["config"] == "int4-g32"
        if kind == "fsdp":
            assert r["quant"]["calibration"]["world_size"] == 2
            assert r["quant"]["digest"] == one["quant"]["digest"], method
            assert r["quant"]["consistency"]["digest"] == one["quant"]["consistency"]["digest"], method
            assert r["ppl"] == pytest.approx(one["ppl"], rel=1e-9), method
        else:
            assert kind == "tp" and r["quant"]["calibration"]["tp"] == 2
            assert r["quant"]["digest"] is not None
            assert abs(r["ppl"] / one["ppl"] - 1) < 1e-4, (method, r["ppl"], one["ppl"])
