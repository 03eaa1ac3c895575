"""Checkpoints as they are shipped: GGUF files and pre-quantized Hugging Face checkpoints, evaluated as stored.

Every file is made here: a GGUF written with the ``gguf`` package from a tiny Llama built from a config
(:mod:`helpers.gguf_files`), whose dequantized weights saved as a plain checkpoint are the reference.
"""

from __future__ import annotations

import pytest
from conftest import STORIES, require_shared
from helpers.gguf_files import write_gguf
from helpers.runs import evaluate_overrides, torchrun_cases

from lit_ppl.errors import LitPplError
from lit_ppl.model.spec import ModelSpec


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """``{type: (gguf file, dequantized checkpoint)}`` for Q8_0 and the K-quant Q4_K."""
    require_shared()
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(root, STORIES, q) for q in ("Q8_0", "Q4_K")}


def _args(docs, *extra):
    return [f"data.path={docs}", "eval.seq_len=64", "trainer.accelerator=cpu", *extra]


@pytest.mark.parametrize("qtype,as_dir", [("Q8_0", True), ("Q4_K", False)])
def test_gguf_equals_its_dequantized_weights(gguf_files, docs_file, tmp_path, capsys, qtype, as_dir):
    path, reference = gguf_files[qtype]
    model = [f"model.path={path.parent}", f"model.gguf_file={path.name}"] if as_dir else [f"model.path={path}"]
    r = evaluate_overrides(_args(docs_file, *model), tmp_path / "gguf")
    table = capsys.readouterr().out
    ref = evaluate_overrides(_args(docs_file, f"model.path={reference}"), tmp_path / "ref")
    assert r["tokens"] == ref["tokens"] and r["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)
    q = r["quant"]
    assert (q["name"], q["source"], q["format"]) == (f"gguf:{qtype}", "checkpoint", "gguf")
    assert q["ggml_types"] == {"F32": 5, qtype: 15} and q["quantized_modules"] == 15
    assert q["bits"] == {"Q8_0": 8.5, "Q4_K": 4.5}[qtype] and ref["quant"] is None
    assert f"gguf:{qtype}" in table and f"{qtype}×15 F32×5" in table


def test_gguf_is_read_into_the_tied_model_as_its_dequantized_weights(gguf_files):
    """Bit for bit the reference's tensors, the head still the embedding (transformers' loader untied them)."""
    import torch

    for path, reference in gguf_files.values():
        lm, ref = ModelSpec(path=str(path)).build(), ModelSpec(path=str(reference)).build()
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
        ours, theirs = lm.state_dict(), ref.state_dict()
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


_PEAK = """
import sys
from pathlib import Path
from lit_ppl.model.spec import ModelSpec

def status(key):
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key))

spec = ModelSpec(path=sys.argv[1])
spec.build_empty(__import__("torch").float32)  # imports, the header and the config read before the baseline
Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the resident size
base = status("VmRSS:")
lm = spec.build()
print(status("VmHWM:") - base, sum(p.nbytes for p in lm.parameters()), lm.model.embed_tokens.weight.nbytes)
"""


def test_gguf_loads_a_block_of_rows_at_a_time(tmp_path):
    """A fresh process's high-water mark while it builds the model from a GGUF file: the weights, the file's pages
    and blocks of rows dequantized (8 MiB of float32 and gguf-py's temporaries); never the 64 MiB embedding whole,
    the whole model dequantized beside it (transformers' loader: 3.2× the weights here) or a tied head's copy."""
    import subprocess
    import sys

    require_shared()
    path, _ = write_gguf(tmp_path, STORIES, "Q8_0", vocab_size=65536, num_hidden_layers=1)
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak, weights, largest = map(int, proc.stdout.split()[-3:])
    # The file's pages, read through its memory map, count in the resident size too.
    bound = weights + path.stat().st_size + 40 * 2**20
    assert largest == 64 * 2**20 and bound < weights + largest and peak <= bound, (peak, weights, largest)


def test_gguf_file_not_in_the_directory(gguf_files):
    path, _ = gguf_files["Q8_0"]
    with pytest.raises(LitPplError, match=r"model.gguf_file='nope.gguf' is not a file in .*its GGUF files: tiny"):
        ModelSpec(path=str(path.parent), gguf_file="nope.gguf")


def _as_bin(out, legacy: bool = False):
    """stories260K as a PyTorch ``pytorch_model.bin`` (zip format, or the legacy one), with its config and tokenizer."""
    import shutil

    import torch
    from safetensors.torch import load_file

    out.mkdir()
    for f in STORIES.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    torch.save(
        load_file(STORIES / "model.safetensors"), out / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy
    )
    return out


@pytest.fixture(scope="module")
def bin_checkpoint(tmp_path_factory):
    require_shared()
    return _as_bin(tmp_path_factory.mktemp("bin") / "stories260K-bin")


def test_a_pytorch_bin_checkpoint_is_read_a_tensor_at_a_time(bin_checkpoint, tmp_path):
    """A ``.bin`` in the zip format is memory-mapped and read per tensor (each rank its part under a split layout), as
    a safetensors file; the legacy format cannot be mapped and goes through ``from_pretrained`` on one reader."""
    import torch
    from safetensors.torch import load_file

    spec = ModelSpec(path=str(bin_checkpoint))
    parts = dict(spec.tensor_parts(spec.build_empty(torch.float32)))
    stored = load_file(STORIES / "model.safetensors")
    assert set(parts) >= set(stored) and parts
    for name, value in stored.items():
        rows = (slice(1, 3),) if value.dim() else ()
        assert torch.equal(parts[name][rows], value[rows]), name
    legacy = ModelSpec(path=str(_as_bin(tmp_path / "legacy", legacy=True)))
    assert legacy.tensor_parts(legacy.build_empty(torch.float32)) is None


@pytest.fixture(scope="module")
def two_ranks(gguf_files, int8_checkpoint, bin_checkpoint, docs_file, tmp_path_factory) -> dict[str, dict]:
    """The 2-rank runs of this file as the jobs of one ``-m`` sweep on one torchrun launch of 2 ranks (a launch's
    cost is its interpreters' start-up): "gguf-fsdp" (Q4_K), "int8-fsdp", "int8-tp" (the torchao checkpoint),
    "bin-fsdp" (a ``.bin`` checkpoint)."""
    gguf, int8 = f"model.path={gguf_files['Q4_K'][0]}", f"model.path={int8_checkpoint}"
    cases = {
        "gguf-fsdp": [gguf, "strategy=fsdp"],
        "int8-fsdp": [int8, "strategy=fsdp"],
        "int8-tp": [int8, "strategy=tp"],
        "bin-fsdp": [f"model.path={bin_checkpoint}", "strategy=fsdp"],
    }
    return torchrun_cases(_args(docs_file, "trainer.devices=2"), cases, 2, tmp_path_factory.mktemp("two"))


@pytest.mark.slow
def test_gguf_under_fsdp(gguf_files, two_ranks, docs_file, tmp_path):
    """Rank 0 reads (and dequantizes) the file like any checkpoint and shards it."""
    _, reference = gguf_files["Q4_K"]
    r = two_ranks["gguf-fsdp"]
    ref = evaluate_overrides(_args(docs_file, f"model.path={reference}"), tmp_path / "ref")
    assert (r["strategy"], r["world_size"]) == ("fsdp", 2) and r["tokens"] == ref["tokens"]
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=1e-6) and r["quant"]["name"] == "gguf:Q4_K"


@pytest.mark.slow
def test_a_bin_checkpoint_under_fsdp_is_the_safetensors_one(two_ranks, docs_file, tmp_path):
    r = two_ranks["bin-fsdp"]
    ref = evaluate_overrides(_args(docs_file, f"model.path={STORIES}"), tmp_path / "ref")
    assert (r["strategy"], r["world_size"]) == ("fsdp", 2) and r["tokens"] == ref["tokens"]
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory):
    """stories260K quantized by transformers' ``TorchAoConfig(Int8WeightOnlyConfig())`` and saved: a shipped
    torchao INT8 checkpoint (safetensors holding each weight's codes, scales and zero points)."""
    require_shared()
    import torch
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    out = tmp_path_factory.mktemp("int8") / "stories260K-int8"
    config = TorchAoConfig(Int8WeightOnlyConfig())
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32, quantization_config=config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def int8_reference(int8_checkpoint, docs_file, tmp_path_factory):
    return evaluate_overrides(_args(docs_file, f"model.path={int8_checkpoint}"), tmp_path_factory.mktemp("int8ref"))


def test_torchao_int8_checkpoint_as_stored(int8_checkpoint, int8_reference):
    from transformers import AutoModelForCausalLM

    r, q = int8_reference, int8_reference["quant"]
    assert (q["name"], q["source"], q["format"], q["config"]) == (
        "torchao:int8",
        "checkpoint",
        "torchao",
        "Int8WeightOnlyConfig",
    )
    model = AutoModelForCausalLM.from_pretrained(int8_checkpoint)
    int8 = {n.removesuffix(".weight") for n, p in model.named_parameters() if hasattr(p, "__tensor_flatten__")}
    assert q["bits"] == 8 and q["group_size"] == "per row" and set(q["modules"]) == int8 and len(int8) == 35
    stored = sum(t.numel() * t.element_size() for p in model.parameters() for t in _leaves(p))  # tied: once
    assert q["weight_bytes"] == stored and 0 < q["full_precision_fraction"] < 1
    assert r["ppl"] == pytest.approx(_hf_ppl(model, r), rel=1e-6)  # the stored INT8 model's own forward


def _leaves(t):
    """A tensor's stored tensors: a torchao tensor's codes, scales and zero points."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [getattr(t, n) for n in names]
    return [t]


def _hf_ppl(model, r):
    """exp(mean NLL) of rolling windows of 64 over the five documents, by a plain forward of ``model``."""
    import json
    import math

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    texts = [json.loads(line)["text"] for line in _docs(r)]
    nll, n = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
            for end in range(1, len(ids), 64):  # lm-eval's rolling windows: each predicts the next 64 tokens
                stop = min(end + 64, len(ids))
                begin = max(0, stop - 1 - 64)
                logits = model(torch.tensor([ids[begin : stop - 1]])).logits[0].double()
                logp = torch.log_softmax(logits, -1)[end - 1 - begin :]
                nll -= float(logp.gather(1, torch.tensor(ids[end:stop])[:, None]).sum())
                n += stop - end
    assert n == r["tokens"]
    return math.exp(nll / n)


def _docs(r):
    from pathlib import Path

    return Path(r["config"]["data"]["path"]).read_text(encoding="utf-8").splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_torchao_int8_checkpoint_split(two_ranks, int8_reference, strategy):
    """The stored INT8 codes sharded (FSDP) or split (TP) like on-the-fly quantized ones: the same PPL."""
    r = two_ranks[f"int8-{strategy}"]
    assert r["strategy"] == strategy and r["world_size"] == 2 and r["tokens"] == int8_reference["tokens"]
    assert r["ppl"] == pytest.approx(int8_reference["ppl"], rel=1e-6)
    assert r["quant"]["name"] == "torchao:int8" and r["quant"]["consistency"]["checked"]


def test_quantized_checkpoints_without_a_path_are_one_line(int8_checkpoint, tmp_path):
    import json
    import shutil

    def variant(name, edit):
        out = tmp_path / name
        shutil.copytree(int8_checkpoint, out)
        cfg = json.loads((out / "config.json").read_text())
        edit(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
        return str(out)

    int4 = variant("int4", lambda q: q["quant_type"]["default"].update(_type="IntxWeightOnlyConfig"))
    with pytest.raises(LitPplError, match="torchao IntxWeightOnlyConfig checkpoint, which transformers cannot reload"):
        ModelSpec(path=int4).limits()
    gptq = variant("gptq", lambda q: q.update(quant_method="gptq"))
    with pytest.raises(LitPplError, match=r"gptq checkpoint: evaluating it needs a GPTQ kernel .* on a CUDA device"):
        ModelSpec(path=gptq).limits()
    with pytest.raises(
        LitPplError, match=r"is already quantized \(torchao:int8\); evaluate it as stored with quant=none"
    ):
        evaluate_overrides([f"model.path={int8_checkpoint}", "quant=int8"], tmp_path / "twice")


def test_compare_across_formats(gguf_files, int8_checkpoint, int8_reference, docs_file, tmp_path):
    """``compare.reference.path`` the float checkpoint while ``model.path`` is a GGUF or a torchao checkpoint."""
    path, dequantized = gguf_files["Q8_0"]
    r = evaluate_overrides(
        _args(docs_file, f"model.path={path}", "compare=unquantized", f"compare.reference.path={dequantized}"),
        tmp_path / "gguf",
    )
    c = r["compare"]  # the same weights in two formats: no divergence at all
    assert c["kld_max"] == 0.0 and c["ppl"] == c["ppl_base"] and r["quant"]["name"] == "gguf:Q8_0"
    r = evaluate_overrides(
        _args(docs_file, f"model.path={int8_checkpoint}", "compare=unquantized", f"compare.reference.path={STORIES}"),
        tmp_path / "int8",
    )
    c = r["compare"]
    assert r["ppl"] == pytest.approx(int8_reference["ppl"], rel=1e-6) and c["kld_mean"] > 0
    with pytest.raises(LitPplError, match=r"stored quantized .*torchao:int8.* set compare.reference.path="):
        evaluate_overrides(_args(docs_file, f"model.path={int8_checkpoint}", "compare=unquantized"), tmp_path / "x")
    assert c["ppl_base"] != pytest.approx(c["ppl"], rel=1e-6) and r["quant"]["name"] == "torchao:int8"
