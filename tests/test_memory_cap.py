"""Memory that follows the layout, proved by the kernel: each process capped below what one process needs.

A random-init Llama built from a config whose weights dwarf the interpreter (hidden 1024, 24 layers, vocabulary
8k, untied: 1.5 GiB in float32) is saved as bfloat16 safetensors and evaluated in float32; every process runs in
its own cgroup v1 memory group capped at :data:`CAP_MB`. Under ``fsdp`` × 2 each rank reads, holds and gathers
only its share: the run succeeds. One process needs the whole model beside the interpreter: the kernel's OOM
killer stops it, which the group's ``oom_kill`` count records. In ``int8`` both fit: each decoder weight is
quantized as it is read, so neither holds the float model. In AWQ int4 the fsdp ranks fit too: each holds its rows
of the float weights while it calibrates. Needs root and a writable cgroup v1 memory hierarchy
(skipped otherwise).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROOT, STORIES, TINYSTORIES, WIKITEXT, require_shared, run
from helpers.nodes import free_port

MEMCG = Path("/sys/fs/cgroup/memory")
# Weights ~1,500 MiB in 24 blocks of 60 MiB: one process needs them whole plus ~430 MB of interpreter and libraries
# (≥ 1.9 GB); an fsdp rank its half, one block gathered (FSDP2 on CPU: 2.5 × a block while it gathers) and the
# interpreter (≈ 1.35 GB).
CAP_MB = 1700
SHAPE = {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24}


def _cgroups_writable() -> str | None:
    """Why per-process memory caps cannot be set here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root to create cgroups"
    if not (MEMCG / "cgroup.procs").is_file():
        return f"no cgroup v1 memory hierarchy at {MEMCG}"
    probe = MEMCG / f"lit_ppl_probe_{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(2**30))
    except OSError as err:
        return f"cgroup v1 memory groups are not writable ({err})"
    finally:
        if probe.is_dir():
            probe.rmdir()
    return None


@pytest.fixture
def capped_groups():
    """``make(n)``: ``n`` fresh memory cgroups capped at :data:`CAP_MB`; removed afterwards."""
    why = _cgroups_writable()
    if why:
        pytest.skip(why)
    made: list[Path] = []

    def make(n: int) -> list[Path]:
        groups = [MEMCG / f"lit_ppl_cap_{uuid.uuid4().hex[:8]}" for _ in range(n)]
        for g in groups:
            g.mkdir()
            made.append(g)
            (g / "memory.limit_in_bytes").write_text(str(CAP_MB * 2**20))
        return groups

    yield make
    for g in made:  # its processes have exited: the group can go
        g.rmdir()


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory) -> Path:
    require_shared()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **SHAPE,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # init_weights' scale, drawn fast: the figures are about bytes, not values
            p.normal_(0.0, 0.02, generator=generator) if p.dim() > 1 else p.fill_(1.0)
    model.model.rotary_emb.__init__(cfg)  # its inv_freq buffer, computed for real
    out = tmp_path_factory.mktemp("large") / "llama"
    # Stored in bfloat16, evaluated in float32: the weights live in anonymous memory (a float32 file would stay
    # memory-mapped, clean page cache the kernel reclaims under the cap instead of stopping the process).
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, out / name)
    return out


def _in_group(group: str) -> list[str]:
    """A shell prefix that moves itself into the memory cgroup ``group`` (a shell word, expanded there), then
    ``exec``s its arguments: every byte the evaluation allocates is charged to that group. (It writes 0, "the
    writer", rather than ``$$``, which torchrun's argument templates would turn into ``$``.)"""
    script = f'echo 0 > "{group}/cgroup.procs" && exec "$@"'
    return ["sh", "-c", script, "sh"]


def _args(model: Path, text: Path, out: Path, *extra: str) -> list[str]:
    return [
        "-m", "lit_ppl.validate", f"model.path={model}", "data=text", f"data.path={text}", "eval.seq_len=64",
        "batch_size=2", "trainer.accelerator=cpu", "report.plots=false", f"output_dir={out}", f"hydra.run.dir={out}",
        *extra,
    ]  # fmt: skip


def _oom_kills(group: Path) -> int:
    fields = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))


def _text_env_weights(large: Path, tmp_path: Path) -> tuple[Path, dict[str, str], float]:
    """The evaluated text, the runs' environment, and the model's float32 weights in MiB."""
    text = tmp_path / "text.txt"
    # One step per rank: the figures are about memory, and each step gathers the whole 1.5 GiB model.
    text.write_text(TINYSTORIES.read_text(encoding="utf-8")[:500], encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return text, env, 2 * sum(f.stat().st_size for f in large.glob("*.safetensors")) / 2**20  # bf16 on disk


def _fsdp_two_ranks(
    large: Path, text: Path, out: Path, env: dict[str, str], ranks: list[Path], *extra: str, timeout: float = 180
) -> dict:
    """``strategy=fsdp`` × 2 (torchrun), each rank in its own capped group (by its LOCAL_RANK): its results."""
    env = env | {f"LIT_PPL_MEMCG_{i}": str(g) for i, g in enumerate(ranks)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "--no-python"]
    cmd += [*_in_group("$(printenv LIT_PPL_MEMCG_$LOCAL_RANK)"), sys.executable]
    cmd += _args(large, text, out, "strategy=fsdp", "trainer.devices=2", *extra)
    proc = run(cmd, timeout, cwd=out.parent, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["world_size"] == 2 and math.isfinite(r["ppl"]) and r["tokens"] > 0
    assert max(r["rank_peak_rss_mb"]) < CAP_MB and all(_oom_kills(g) == 0 for g in ranks), r["rank_peak_rss_mb"]
    return r


@pytest.mark.slow
def test_fsdp_fits_where_one_process_does_not(large_checkpoint, capped_groups, tmp_path):
    text, env, weights_mb = _text_env_weights(large_checkpoint, tmp_path)
    assert weights_mb + 300 > CAP_MB > weights_mb / 2 + 700, weights_mb  # the cap sits between the two needs
    r = _fsdp_two_ranks(large_checkpoint, text, tmp_path / "fsdp", env, capped_groups(2))
    assert max(r["rank_weight_bytes"]) / 2**20 < 0.55 * weights_mb

    (alone,) = capped_groups(1)
    cmd = [*_in_group(str(alone)), sys.executable, *_args(large_checkpoint, text, tmp_path / "one")]
    proc = run(cmd, 180, cwd=tmp_path, env=env)
    assert proc.returncode == -9 and _oom_kills(alone) >= 1, (proc.returncode, proc.stderr[-2000:])
    assert not (tmp_path / "one" / "results.json").exists()


@pytest.mark.slow
def test_int8_quantizes_each_weight_as_it_is_read(large_checkpoint, capped_groups, tmp_path):
    """``quant=int8`` under the same cap, where the float model alone beside the interpreter is above it: each
    decoder weight is quantized as it is read (under ``fsdp`` × 2 each rank then keeps its rows), so neither the two
    ranks nor one process ever hold the float model. (Quantizing after loading, both were killed by the cap.)"""
    text, env, weights_mb = _text_env_weights(large_checkpoint, tmp_path)
    assert weights_mb + 400 > CAP_MB  # the float model and the interpreter alone would not fit
    r = _fsdp_two_ranks(large_checkpoint, text, tmp_path / "int8", env, capped_groups(2), "quant=int8")
    assert r["quant"]["consistency"]["checked"]

    (alone,) = capped_groups(1)
    cmd = [*_in_group(str(alone)), sys.executable, *_args(large_checkpoint, text, tmp_path / "one", "quant=int8")]
    proc = run(cmd, 180, cwd=tmp_path, env=env)
    assert proc.returncode == 0 and _oom_kills(alone) == 0, (proc.returncode, proc.stderr[-2000:])
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    assert one["rank_peak_rss_mb"][0] < CAP_MB and one["quant"]["digest"] == r["quant"]["digest"]
    assert one["ppl"] == pytest.approx(r["ppl"], rel=1e-6)


@pytest.mark.slow
def test_awq_calibrates_with_each_rank_holding_its_rows(large_checkpoint, capped_groups, tmp_path):
    """AWQ int4 under the same cap: calibration runs whole forward passes and reads whole weights, yet under
    ``fsdp`` × 2 each rank holds its rows of the float weights (one layer gathered at a time, one block whole while
    it is quantized), so it fits. (Before, every rank loaded the float model whole to calibrate it, as one process
    does: :func:`test_fsdp_fits_where_one_process_does_not` shows that load killed by the cap.)"""
    text, env, weights_mb = _text_env_weights(large_checkpoint, tmp_path)
    assert weights_mb + 400 > CAP_MB  # the float model and the interpreter alone would not fit
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(WIKITEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    awq = ["quant=awq", "quant.name=int4", "quant.group_size=64", f"quant.calibration.path={calibration}"]
    awq += ["quant.calibration.tokens=128", "quant.calibration.seq_len=64", "quant.calibration.grid=2"]
    r = _fsdp_two_ranks(large_checkpoint, text, tmp_path / "awq", env, capped_groups(2), *awq, timeout=480)
    assert r["quant"]["calibration"]["world_size"] == 2 and r["quant"]["consistency"]["checked"]
    assert r["quant"]["quantized_modules"] == SHAPE["num_hidden_layers"] * 7
