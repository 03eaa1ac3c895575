"""Every architecture family people evaluate, against a plain Hugging Face forward of the same weights.

Tiny random-init models (:mod:`zoo`) of each family are scored by lit-ppl at one process, under ``fsdp`` and ``tp``
on 2 gloo ranks (one torchrun sweep over the families each) and with ``quant=int8``; the reference is the model's own
``forward(...).logits`` in float64, one window per document.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, STORIES, TINYSTORIES, require_shared, run, run_entry
from helpers import zoo
from helpers.nodes import free_port

from lit_ppl.model import scorer
from lit_ppl.model.scorer import ScorerMismatchError
from lit_ppl.quant.targets import to_plain_linear
from lit_ppl.run import evaluate

SEQ_LEN = 128
REL = 1e-6  # float32 lit-ppl vs float64 reference: measured ≤ 1e-7 on every architecture


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """Six short real documents, each within one window of SEQ_LEN tokens (of different lengths: padding)."""
    require_shared()
    texts = [t.strip() for t in TINYSTORIES.read_text(encoding="utf-8").split("<|endoftext|>") if t.strip()]
    return [t[:120] for t in texts] + [texts[0][200:260]]


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory, documents) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    zoo.write_documents(root / "docs.jsonl", documents)
    return root


@pytest.fixture(scope="module")
def reference(zoo_root, documents):
    """``arch -> (model dir, reference PPL, tokens)``, built and scored once per module."""
    out = {}

    def get(arch: str):
        if arch not in out:
            path = zoo.build(arch, zoo_root, STORIES)
            nll, tokens = zoo.reference_nll(path, documents, SEQ_LEN)
            out[arch] = (path, math.exp(nll / tokens), tokens)
        return out[arch]

    return get


def overrides(model: Path | str, docs: Path, *extra: str) -> list[str]:
    return [
        "model=hf",
        f"model.path={model}",
        "data=text",
        f"data.path={docs}",
        f"eval.seq_len={SEQ_LEN}",
        "report.plots=false",
        "trainer.accelerator=cpu",
        *extra,
    ]


@pytest.mark.parametrize("arch", zoo.ARCHITECTURES)
def test_one_process_matches_the_model_forward(arch, reference, zoo_root, compose):
    path, ppl, tokens = reference(arch)
    r = evaluate(compose(*overrides(path, zoo_root / "docs.jsonl")))
    assert r["tokens"] == tokens
    assert r["ppl"] == pytest.approx(ppl, rel=REL), arch
    assert r["scorer_check"]["max_abs_logprob_diff"] <= r["scorer_check"]["tolerance"]


@pytest.mark.parametrize("arch", zoo.ARCHITECTURES)
def test_int8_quantizes_every_architecture(arch, reference, zoo_root, compose):
    path, ppl, tokens = reference(arch)
    r = evaluate(compose(*overrides(path, zoo_root / "docs.jsonl", "quant=int8")))
    q = r["quant"]
    assert q["quantized_modules"] > 0 and q["weight_bytes_after"] < q["weight_bytes_before"]
    assert r["tokens"] == tokens and math.isfinite(r["ppl"])
    assert r["ppl"] != ppl and r["ppl"] == pytest.approx(ppl, rel=0.02), "int8 should move the PPL a little"
    # Every linear layer but the head is quantized: only the head and the embeddings (no rule names them) stay.
    kept = {n: m["reason"] for n, m in q["modules"].items() if m["config"] is None}
    assert sum("head kept" in why for why in kept.values()) >= 1, kept
    unmatched = [n for n, why in kept.items() if why == "no rule matches"]
    assert all(any(k in n for k in ("embed", "wte", "wpe")) for n in unmatched), kept
    assert set(kept.values()) <= {"no rule matches", "output head kept (quant.head=false) says none"}, kept
    assert 0 < q["full_precision_fraction"] < 0.6


# Families whose checkpoints transformers converts on the way in (fuses per-expert tensors): read by rank 0.
READ_BY_RANK_0 = {"mixtral", "qwen2_moe"}


def test_each_rank_reads_what_from_pretrained_reads(reference):
    """The per-rank reader's view of every family's checkpoint (transformers' key renames, tied weights) fills an
    empty model with exactly the tensors ``from_pretrained`` loads, bit for bit; the families transformers
    converts on the way are left to rank 0's ``from_pretrained``."""
    from lit_ppl.model.spec import ModelSpec
    from lit_ppl.parallel.sharding import load_own_parts, materialize

    rank0 = set()
    for arch in zoo.ARCHITECTURES:
        spec = ModelSpec(path=str(reference(arch)[0]))
        lm = spec.build_empty(torch.float32)
        parts = spec.tensor_parts(lm)
        if parts is None:
            rank0.add(arch)
            continue
        materialize(lm, torch.device("cpu"))
        load_own_parts(lm, parts, {}, None)
        theirs, ours = spec.build(torch.float32).state_dict(), lm.state_dict()
        assert set(ours) == set(theirs), arch
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), arch
    assert rank0 == READ_BY_RANK_0


def sweep_two_ranks(archs: list[str], reference, zoo_root: Path, tmp_path: Path, strategy: str) -> dict[str, dict]:
    """Every family in one sweep (``-m model.path=A,B,...``) under ``torchrun --nproc_per_node 2``: the same two
    ranks run every job, so each family costs its evaluation, not two interpreters' start-up. ``arch -> results``."""
    paths = [str(reference(arch)[0]) for arch in archs]
    assert not any("," in p for p in paths)
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "-m", "lit_ppl.validate", "-m"]
    cmd += overrides(",".join(paths), zoo_root / "docs.jsonl", f"strategy={strategy}", "trainer.devices=2")
    cmd += [f"hydra.sweep.dir={sweep_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = run(cmd, 60 + 30 * len(archs), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {a: json.loads((sweep_dir / str(i) / "results.json").read_text()) for i, a in enumerate(archs)}


def assert_match_the_forward(results: dict[str, dict], reference) -> None:
    wrong = {}
    for arch, r in results.items():
        path, ppl, tokens = reference(arch)
        if r["model"] != str(path) or r["tokens"] != tokens or r["world_size"] != 2 or abs(r["ppl"] / ppl - 1) > REL:
            wrong[arch] = (r["model"], r["tokens"], tokens, r["ppl"], ppl)
    assert not wrong, wrong


@pytest.mark.slow
def test_fsdp_two_ranks_matches_the_model_forward(reference, zoo_root, tmp_path):
    assert_match_the_forward(sweep_two_ranks(zoo.ARCHITECTURES, reference, zoo_root, tmp_path, "fsdp"), reference)


def _tp_plan_problem(arch: str) -> str | None:
    """Why lit-ppl cannot split ``arch`` tensor-parallel (from its config alone), or ``None``."""
    from transformers import AutoConfig

    from lit_ppl.parallel.tensor_parallel import check_plan

    try:
        check_plan(AutoConfig.for_model(zoo.model_type(arch), **zoo.COMMON, **zoo.CONFIGS[arch]))
    except ValueError as err:
        return str(err)
    return None


TP_FAMILIES = [a for a in zoo.ARCHITECTURES if _tp_plan_problem(a) is None]


def test_families_without_a_plain_tp_plan_are_refused_by_config():
    from transformers import AutoConfig

    from lit_ppl.parallel.tensor_parallel import check_plan

    refused = {a: _tp_plan_problem(a) for a in zoo.ARCHITECTURES if a not in TP_FAMILIES}
    assert {"gpt2", "phi3"} <= set(refused)  # no plan; fused-gather styles lit-ppl lacks
    assert all(f"model_type {a!r}" in why for a, why in refused.items())
    assert {"llama", "gpt_neox", "qwen2", "gemma", "gemma2", "gemma3_text", "llama_mqa"} <= set(TP_FAMILIES)
    # Mixtral's own plan splits its experts up to transformers 5.24 and only its attention from 5.25: an expert style
    # in any plan is refused by name.
    cfg = AutoConfig.for_model("mixtral", **zoo.COMMON, **zoo.CONFIGS["mixtral"])
    cfg.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.experts": "moe_tp_experts"}
    with pytest.raises(ValueError, match=r"model_type 'mixtral'.*uses moe_tp_experts; lit-ppl splits only colwise"):
        check_plan(cfg)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_matches_the_model_forward(reference, zoo_root, tmp_path):
    """The model's own plan, split over 2 ranks, against a plain float64 forward of the whole model: the scorer's
    self-check cannot see a split that changes the model (both of its paths run the split model)."""
    results = sweep_two_ranks(TP_FAMILIES, reference, zoo_root, tmp_path, "tp")
    assert all(r["parallel"]["tp"] == 2 for r in results.values())
    assert_match_the_forward(results, reference)


def test_moe_experts_are_quantized_by_name(reference, zoo_root, compose):
    """Mixtral keeps its experts as fused 3D parameters: int8 quantizes them; int4 cannot and says so."""
    path, _, _ = reference("mixtral")
    docs = zoo_root / "docs.jsonl"
    q8 = evaluate(compose(*overrides(path, docs, "quant=int8")))["quant"]
    experts = {n: m for n, m in q8["modules"].items() if m.get("kind") == "experts"}
    assert len(experts) == 2 * zoo.LAYERS and all(m["config"] == "int8" for m in experts.values())
    assert "experts" in q8["backend"]
    q4 = evaluate(compose(*overrides(path, docs, "quant=int4", "quant.group_size=32")))["quant"]
    skipped = {n: why for n, why in q4["skipped"].items() if "experts" in n}
    assert len(skipped) == 2 * zoo.LAYERS and all("3D expert weights" in why for why in skipped.values())
    # The experts hold most of the weights: the report says plainly how much stayed in full precision.
    assert q4["full_precision_fraction"] > 0.6 > q8["full_precision_fraction"]


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_projections_become_plain_linear_exactly(arch, reference):
    """GPT-2's Conv1D and Falcon's FalconLinear are replaced by nn.Linear computing the same function."""
    from transformers import AutoModelForCausalLM

    path, _, _ = reference(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    ids = torch.randint(0, zoo.VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        converted = to_plain_linear(model)
        after = model(input_ids=ids).logits
    assert converted and set(converted.values()) == {"Conv1D" if arch == "gpt2" else "FalconLinear"}
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n in converted)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)


def test_a_head_transform_lit_ppl_does_not_know_is_refused(reference, zoo_root, compose, monkeypatch):
    """Without Granite's logits_scaling the scorer disagrees with the model: the run stops, naming the class."""
    path, _, _ = reference("granite")
    monkeypatch.delitem(scorer.LOGIT_SCALES, "granite")
    with pytest.raises(ScorerMismatchError, match=r"GraniteForCausalLM .*differs from the model's own forward"):
        evaluate(compose(*overrides(path, zoo_root / "docs.jsonl")))


def broken_checkpoint(src: Path, dst: Path, drop: str | None = None, add: str | None = None) -> Path:
    """A copy of ``src`` whose safetensors file lacks the tensor ``drop`` or has an extra tensor ``add``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_incomplete_checkpoint_is_refused_on_one_process(reference, zoo_root, compose, tmp_path):
    path, _, _ = reference("gpt_neox")
    lacking = broken_checkpoint(path, tmp_path / "lacking", drop="gpt_neox.layers.1.mlp.dense_h_to_4h.weight")
    with pytest.raises(ValueError, match=r"lacks gpt_neox\.layers\.1\.mlp\.dense_h_to_4h\.weight"):
        evaluate(compose(*overrides(lacking, zoo_root / "docs.jsonl")))
    extra = broken_checkpoint(path, tmp_path / "extra", add="gpt_neox.layers.0.surprise")
    with pytest.raises(ValueError, match=r"does not use: gpt_neox\.layers\.0\.surprise"):
        evaluate(compose(*overrides(extra, zoo_root / "docs.jsonl")))


@pytest.mark.slow
def test_incomplete_checkpoint_is_refused_by_every_fsdp_rank(reference, zoo_root, tmp_path):
    """Rank 0 reads the checkpoint; the other rank learns of the problem instead of waiting for its shard.

    The checkpoint's ``embed_out.weight`` is the model's ``lm_head.weight`` (transformers renames it while loading):
    the error names the model's key.
    """
    path, _, _ = reference("gpt_neox")
    lacking = broken_checkpoint(path, tmp_path / "lacking", drop="embed_out.weight")
    args = overrides(lacking, zoo_root / "docs.jsonl", "strategy=fsdp", "trainer.devices=2", "distributed.timeout_s=60")
    proc, r = run_entry(args, tmp_path / "run", timeout=120)
    assert proc.returncode == 1 and r is None
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-ppl: error:")]
    assert errors and all("lacks lm_head.weight" in line for line in errors), proc.stderr[-2000:]
