"""Checkpoints as they are shipped: GGUF files and pre-quantized Hugging Face checkpoints, evaluated as stored.

Every file is made here: a GGUF written with the ``gguf`` package from a tiny Llama built from a config
(:mod:`helpers.gguf_files`), whose dequantized weights saved as a plain checkpoint are the reference.
"""

from __future__ import annotations

import pytest
from conftest import STORIES, require_shared, run_entry
from helpers.gguf_files import write_gguf
from helpers.runs import evaluate_overrides

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
    assert q["ggml_types"] == {"F32": 5, qtype: 16} and q["quantized_modules"] == 16
    assert q["bits"] == {"Q8_0": 8.5, "Q4_K": 4.5}[qtype] and ref["quant"] is None
    assert f"gguf:{qtype}" in table and f"{qtype}×16 F32×5" in table


def test_gguf_file_not_in_the_directory(gguf_files):
    path, _ = gguf_files["Q8_0"]
    with pytest.raises(LitPplError, match=r"model.gguf_file='nope.gguf' is not a file in .*its GGUF files: tiny"):
        ModelSpec(path=str(path.parent), gguf_file="nope.gguf")


@pytest.mark.slow
def test_gguf_under_fsdp(gguf_files, docs_file, tmp_path):
    """Rank 0 reads (and dequantizes) the file like any checkpoint and shards it."""
    path, reference = gguf_files["Q4_K"]
    proc, r = run_entry(_args(docs_file, f"model.path={path}", "strategy=fsdp", "trainer.devices=2"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = evaluate_overrides(_args(docs_file, f"model.path={reference}"), tmp_path / "ref")
    assert r["world_size"] == 2 and r["tokens"] == ref["tokens"]
    assert r["ppl"] == pytest.approx(ref["ppl"], rel=1e-6) and r["quant"]["name"] == "gguf:Q4_K"
