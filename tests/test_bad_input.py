"""Bad input: a clear one-line error naming the bad value and what would be valid — never a wrong number."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import STORIES, TINYSTORIES, require_shared, run_entry

from lit_ppl.run import evaluate
from lit_ppl.runtime.files import write_json_atomic


def _checkpoint(tmp_path: Path, name: str, edit) -> Path:
    """A copy of stories260K with ``edit`` applied to the model (its tokenizer unchanged)."""
    require_shared()
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    out = tmp_path / name
    model = (
        edit(AutoModelForCausalLM.from_pretrained(STORIES))
        if edit
        else LlamaForCausalLM(
            LlamaConfig(
                vocab_size=100,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
            )
        )
    )
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / f, out / f)
    return out


def _nan_norm(model):
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    return model


def _bytes(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _mixed_dir(tmp_path: Path) -> Path:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.txt").write_text("a story")
    (tmp_path / "shards" / "b.jsonl").write_text('{"text": "another"}\n')
    return tmp_path / "shards"


def _corrupt_gz(tmp_path: Path) -> Path:
    return _bytes(tmp_path, "bad.json.gz", gzip.compress(b'{"text": "a story"}\n' * 50)[:30])


EMPTY_DOC_JSONL = b'{"text": "hi"}\n{"text": ""}\n'

# (id, overrides built from tmp_path, error type, message that must appear)
CASES = [
    (
        "missing model path",
        lambda t: ["model.path=/no/such/ckpt"],
        FileNotFoundError,
        "model.path='/no/such/ckpt' does not exist; give a Hugging Face checkpoint directory",
    ),
    ("dir without config", lambda t: [f"model.path={t}"], ValueError, "is a directory without config.json"),
    ("not a causal LM", lambda t: [f"model.path={_vision(t)}"], ValueError, "is a 'vit' model, not a causal LM"),
    (
        "vocab mismatch",
        lambda t: [f"model.path={_checkpoint(t, 'v100', None)}", f"data.path={TINYSTORIES}"],
        ValueError,
        "out of the model's vocabulary of 100: the tokenizer does not match the model",
    ),
    (
        "missing data file",
        lambda t: ["data.path=/no/such.txt"],
        FileNotFoundError,
        "data.path='/no/such.txt' is not a file",
    ),
    ("mixed formats", lambda t: [f"data.path={_mixed_dir(t)}"], ValueError, "mixes formats"),
    ("empty glob", lambda t: [f"data.path={t}/*.json.gz"], FileNotFoundError, "matches no files"),
    ("corrupt gzip", lambda t: [f"data.path={_corrupt_gz(t)}"], ValueError, "bad.json.gz is not a valid .gz file"),
    (
        "invalid utf-8 compressed",
        lambda t: ["data.path=" + str(_bytes(t, "bad.txt.gz", gzip.compress(b"abc\xffdef")))],
        ValueError,
        "is not valid UTF-8 at byte offset 3",
    ),
    ("unknown format", lambda t: ["data.format=csv"], ValueError, "data.format='csv' is not one of auto, text"),
    ("zero limit", lambda t: ["data.limit=0"], ValueError, "data.limit=0 must be a positive number of documents"),
    (
        "unreachable hub data",
        lambda t: ["data=wikitext2"],
        ValueError,
        "data.hub_name='wikitext' is not in the datasets cache and the hub cannot be reached",
    ),
    (
        "unreachable hub model",
        lambda t: ["model=hf", "model.path=nobody/no-such-model"],
        ValueError,
        "model.path='nobody/no-such-model' is not a local directory, not in the Hugging Face cache",
    ),
    ("empty file", lambda t: [f"data.path={_bytes(t, 'empty.txt', b'')}"], ValueError, "documents have no tokens"),
    (
        "empty document",
        lambda t: ["data.path=" + str(_bytes(t, "d.jsonl", EMPTY_DOC_JSONL))],
        ValueError,
        "1 of 2 documents have no tokens (first: document 1)",
    ),
    (
        "invalid utf-8",
        lambda t: ["data.path=" + str(_bytes(t, "bad.txt", b"abc\xffdef"))],
        ValueError,
        "is not valid UTF-8 at byte offset 3",
    ),
    (
        "seq_len too long",
        lambda t: ["eval.seq_len=4096"],
        ValueError,
        "eval.seq_len=4096 exceeds the model's maximum of 2048 positions",
    ),
    (
        "stride zero",
        lambda t: ["eval=sliding", "eval.stride=0"],
        ValueError,
        "eval.stride=0 must be in [1, seq_len - 1",
    ),
    ("stride too long", lambda t: ["eval=sliding", "eval.stride=600"], ValueError, "eval.stride=600 must be in"),
    (
        "bad mode",
        lambda t: ["eval.mode=zigzag"],
        ValueError,
        "eval.mode='zigzag' is not one of rolling, sliding, block, llamacpp",
    ),
    (
        "group size fits no layer",
        lambda t: [f"model.path={STORIES}", "quant=int4", "quant.group_size=256", "quant.group_fallback=false"],
        ValueError,
        "would quantize none of the 35 layers",
    ),
    ("bad precision", lambda t: ["precision=fp8"], Exception, "Precision 'fp8' is invalid"),
    (
        "no gpu",
        lambda t: ["trainer.accelerator=gpu", "trainer.devices=2", "strategy=ddp"],
        ValueError,
        "trainer.accelerator=gpu trainer.devices=2, but 0 CUDA devices are visible",
    ),
    ("output_dir not writable", lambda t: [f"output_dir={_bytes(t, 'file', b'x')}/sub"], ValueError, "is not writable"),
    (
        "foreign _target_",
        lambda t: ["model._target_=os.system"],
        ValueError,
        "model._target_='os.system' is not a lit_ppl class",
    ),
    (
        "nan loss",
        lambda t: [f"model.path={_checkpoint(t, 'nan', _nan_norm)}", f"data.path={TINYSTORIES}"],
        FloatingPointError,
        "tokens had a NaN/inf loss (first at batch {0: 0} by rank)",
    ),
    (
        "deterministic with batch_size=auto",
        lambda t: ["eval.deterministic=true", "batch_size=auto"],
        ValueError,
        "batch_size=auto with eval.deterministic=true",
    ),
    (
        "deterministic with compile",
        lambda t: ["eval.deterministic=true", "compile=true"],
        ValueError,
        "compile=true with eval.deterministic=true",
    ),
    ("unknown balance", lambda t: ["distributed.balance=fastest"], ValueError, "distributed.balance='fastest' is not"),
    (
        "weights missing",
        lambda t: ["distributed.balance=weights"],
        ValueError,
        "distributed.balance=weights needs distributed.weights: positive relative speeds per node or per rank",
    ),
    (
        "weights of the wrong length",
        lambda t: ["distributed.balance=weights", "distributed.weights=[1.0,0.5,0.2]"],
        ValueError,
        "distributed.weights has 3 entries; give one per node (1) or one per rank (1)",
    ),
    (
        "measured under fsdp",
        lambda t: ["distributed.balance=measured", "strategy=fsdp", "trainer.devices=2"],  # refused before launching
        ValueError,
        "distributed.balance=measured cannot time a rank alone under strategy=fsdp",
    ),
    (
        "weights under deterministic fsdp",
        lambda t: [
            "distributed.balance=weights",
            "distributed.weights=[1,0.5]",
            "strategy=fsdp",
            "trainer.devices=2",
            "eval.deterministic=true",
        ],
        ValueError,
        "cannot help under strategy=fsdp with eval.deterministic=true",
    ),
]


def _vision(tmp_path: Path) -> Path:
    from transformers import ViTConfig, ViTModel

    out = tmp_path / "vit"
    ViTModel(
        ViTConfig(
            hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, image_size=8, patch_size=4
        )
    ).save_pretrained(out)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_message(case, compose, tmp_path):
    _, overrides, error, message = case
    args = overrides(tmp_path)
    with pytest.raises(error) as info:
        evaluate(compose(*args))
    text = str(info.value)
    assert message in text
    assert "\n" not in text.strip() or error is Exception, "one line"
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["data.path=/no/such.txt"], "lit-ppl: error: data.path='/no/such.txt' is not a file"),
        (["eval.seq_len=4096"], "lit-ppl: error: eval.seq_len=4096 exceeds the model's maximum of 2048"),
        (["strategy=nope"], "Could not find 'strategy/nope'"),  # Hydra lists the valid options after this line
        (
            ["eval.bogus=1"],
            "unknown key eval.bogus (valid keys: mode, seq_len, stride, chunk_size, chunk_budget_mb, deterministic)",
        ),
    ],
)
def test_entry_exits_nonzero_with_the_message(tmp_path, args, message):
    proc, results = run_entry(args, tmp_path)
    assert proc.returncode != 0 and results is None
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_input_is_refused_before_lightning_is_imported(tmp_path):
    """The checks before any weight loads need no Lightning: a mistaken path is one line in seconds, not after the
    seconds Lightning's import takes (its own, torch's compiler and torchmetrics')."""
    proc, results = run_entry(["data.path=/no/such.txt"], tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 1 and results is None
    lines = proc.stderr.splitlines()
    assert [line for line in lines if line.startswith("lit-ppl:")] == [
        "lit-ppl: error: data.path='/no/such.txt' is not a file, a directory or a glob that matches"
    ]
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    assert "torch" in imported and "lightning" not in imported


def test_failed_write_keeps_the_previous_results(tmp_path):
    path = write_json_atomic(tmp_path / "results.json", {"ppl": 1.5})
    with pytest.raises(ValueError, match="Out of range float values"):
        write_json_atomic(path, {"ppl": 2.0, "bad": float("nan")})  # fails half-way through the dump
    assert json.loads(path.read_text()) == {"ppl": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"], "no temp file left behind"


def test_same_command_twice_is_bit_identical(compose, tmp_path):
    require_shared()
    args = (f"model.path={STORIES}", f"data.path={TINYSTORIES}", "eval.seq_len=128")
    a, b = evaluate(compose(*args)), evaluate(compose(*args))
    for key in ("ppl", "nll_sum", "nll_stderr", "word_ppl", "byte_ppl", "tokens"):
        assert a[key] == b[key], key


@pytest.mark.parametrize(
    "bug",
    ["{}['missing']", "int('not a number')"],  # a KeyError in lit-ppl; a ValueError that is not lit-ppl's check
)
def test_an_internal_bug_keeps_its_traceback(tmp_path, bug):
    """Only lit-ppl's own checks (LitPplError) are one-line user errors; anything else is reported as a bug."""
    code = (
        "import sys, lit_ppl.run as run\n"
        f"def evaluate(cfg):\n    return {bug}\n"
        "run.evaluate = evaluate\n"
        f"sys.argv = ['lit_ppl.validate', 'output_dir={tmp_path}', 'hydra.run.dir={tmp_path}']\n"
        "from lit_ppl.validate import entry\nentry()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lit-ppl: internal error: ") and "please report it" in last, proc.stderr[-2000:]
    assert "lit-ppl: error:" not in proc.stderr


def test_lit_ppl_checks_raise_lit_ppl_error():
    from lit_ppl.errors import LitPplError
    from lit_ppl.parallel.layout import resolve

    with pytest.raises(LitPplError, match="is not the world size 2"):
        resolve(2, 2, 1, world_size=2)
