"""Corpora: every file layout gives the same tokens and PPL, the token store is shared safely and stays narrow."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from conftest import ROOT, STORIES, TINYSTORIES, WIKITEXT, require_shared
from helpers.nodes import launch, wait

from lit_ppl.data.datamodule import WindowCollator
from lit_ppl.data.reading import documents
from lit_ppl.data.sampler import PAD
from lit_ppl.data.sources import DataSpec
from lit_ppl.data.store import Corpus, prepare, store_dir, token_dtype
from lit_ppl.data.windows import build_windows
from lit_ppl.model.spec import ModelSpec
from lit_ppl.model.tokenizer import ByteTokenizer
from lit_ppl.run import evaluate

COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress, ".zst": zstandard.compress}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    require_shared()
    return [t.strip() for t in TINYSTORIES.read_text(encoding="utf-8").split("<|endoftext|>") if t.strip()]


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(COMPRESS[path.suffix](data) if path.suffix in COMPRESS else data)
    return path


def _layouts(tmp: Path, texts: list[str]) -> dict[str, str]:
    """The same five documents as JSON lines in every way a corpus ships; ``plain`` is the reference."""
    shards = [texts[:2], texts[2:]]
    for i, part in enumerate(shards):
        _write(tmp / "shards" / f"c4-validation.{i:05d}-of-00002.json.gz", _jsonl(part))
        _write(tmp / "list" / f"part{i}.jsonl.bz2", _jsonl(part))
    (tmp / "shards" / ".index").write_text("hidden files are not data")
    return {
        "plain": str(_write(tmp / "docs.jsonl", _jsonl(texts))),
        "zst": str(_write(tmp / "docs.jsonl.zst", _jsonl(texts))),
        "xz": str(_write(tmp / "docs.jsonl.xz", _jsonl(texts))),
        "directory": str(tmp / "shards"),
        "glob": str(tmp / "shards" / "*.json.gz"),
        "list": "[" + ",".join(str(tmp / "list" / f"part{i}.jsonl.bz2") for i in (1, 0)) + "]",  # given out of order
    }


def test_every_layout_gives_the_same_tokens_and_ppl(compose, tmp_path, texts):
    layouts = _layouts(tmp_path / "data", texts)
    common = (f"model.path={STORIES}", "eval.seq_len=128", "precision=64-true")
    results = {name: evaluate(compose(*common, f"data.path={path}")) for name, path in layouts.items()}
    ref = results.pop("plain")
    assert ref["documents"] == 5 and ref["data"]["documents"] == 5
    for name, r in results.items():
        assert (r["tokens"], r["documents"], r["words"], r["bytes"]) == (
            ref["tokens"],
            ref["documents"],
            ref["words"],
            ref["bytes"],
        ), name
        assert r["nll_sum"] == pytest.approx(ref["nll_sum"], rel=1e-12, abs=0), name
    # The list was given out of order: its files are read as given (part1 first), a directory's sorted.
    assert results["directory"]["data"]["files"] == 2 and results["list"]["data"]["files"] == 2


def test_store_holds_exactly_what_the_tokenizer_gives(tmp_path, texts):
    """The token store against the plain reading: ``[BOS] + tokenizer(doc)`` for every document, nothing else."""
    tok = ModelSpec(path=str(STORIES)).tokenizer()
    path = _write(tmp_path / "docs.jsonl.gz", _jsonl(texts))
    corpus = Corpus.open(prepare(DataSpec(path=str(path), cache_dir=str(tmp_path / "c")), tok, progress=False))
    ids = tok.tok(texts, add_special_tokens=False)["input_ids"]
    expected = np.concatenate([[tok.context_id, *x] for x in ids])
    assert corpus.tokens.dtype == np.uint16 and isinstance(corpus.tokens, np.memmap)
    np.testing.assert_array_equal(np.asarray(corpus.tokens), expected)
    np.testing.assert_array_equal(corpus.doc_lengths, [len(x) for x in ids])
    np.testing.assert_array_equal(corpus.doc_bytes, [len(t.encode()) for t in texts])
    assert corpus.max_token == int(expected.max())


@pytest.mark.parametrize("name", ["wiki.test.raw", "wiki.test.tokens", "README", "story.txt.gz"])
def test_any_extension_is_text(compose, tmp_path, name):
    require_shared()
    data = TINYSTORIES.read_bytes()
    path = _write(tmp_path / name, data)
    common = (f"model.path={STORIES}", "eval.seq_len=512")
    ref = evaluate(compose(*common, f"data.path={TINYSTORIES}"))
    r = evaluate(compose(*common, f"data.path={path}"))
    assert (r["tokens"], r["nll_sum"]) == (ref["tokens"], ref["nll_sum"])
    assert r["tokens"] == 1882  # the reference figure of ../shared/data/README.md


def test_format_override_reads_json_as_text(tmp_path, texts):
    path = _write(tmp_path / "docs.jsonl", _jsonl(texts))
    as_json = list(documents(DataSpec(path=str(path))))
    as_text = list(documents(DataSpec(path=str(path), format="text")))
    assert sum(len(b) for b in as_json) == 5 and as_text == [[path.read_text()]]


def test_limit_counts_exactly_n_documents(compose, tmp_path, texts):
    path = _write(tmp_path / "docs.jsonl", _jsonl(texts))
    common = (f"model.path={STORIES}", f"data.path={path}", "eval.seq_len=128")
    first3 = _write(tmp_path / "first3.jsonl", _jsonl(texts[:3]))
    r = evaluate(compose(*common, "data.limit=3"))
    ref = evaluate(compose(f"model.path={STORIES}", f"data.path={first3}", "eval.seq_len=128"))
    assert r["documents"] == 3 and r["data"]["limit"] == 3 and r["config"]["data"]["limit"] == 3
    assert (r["tokens"], r["nll_sum"]) == (ref["tokens"], ref["nll_sum"])
    assert evaluate(compose(*common, "data.limit=100"))["documents"] == 5  # more than there are: all of them


class _WideTokenizer(ByteTokenizer):
    """Byte ids shifted past 65,535: a vocabulary that needs uint32."""

    vocab_size = 70_000
    bos_id = 69_999

    @property
    def fingerprint(self) -> str:
        return "wide-v1"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [[65_600 + b for b in t.encode()] for t in texts]


def test_store_dtype_follows_the_vocabulary(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld")
    assert token_dtype(512) == np.uint16 and token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    narrow = Corpus.open(prepare(DataSpec(path=str(path), cache_dir=str(tmp_path / "c")), ByteTokenizer(), 5, False))
    wide = Corpus.open(prepare(DataSpec(path=str(path), cache_dir=str(tmp_path / "c")), _WideTokenizer(), 5, False))
    assert narrow.tokens.dtype == np.uint16 and narrow.tokens.nbytes == 2 * (len("héllo wörld".encode()) + 1)
    assert wide.tokens.dtype == np.uint32 and int(wide.tokens[-1]) == 65_600 + ord("d") and wide.max_token == 69_999


@pytest.mark.parametrize("mode,stride", [("rolling", None), ("sliding", 3), ("block", None)])
def test_a_batch_is_its_windows_side_by_side(mode, stride):
    """The collator builds a batch at once; it must equal its windows collated one by one, padded to the widest and
    in the batch's order (padding entries included), with the scored positions offset by their row."""
    lengths = [1, 7, 8, 9, 20, 3]
    ids = [[1000 * (d + 1) + i for i in range(n)] for d, n in enumerate(lengths)]
    corpus = Corpus.from_lists(ids, [d + 1 for d in range(len(ids))], [2 * n for n in lengths], 0)
    w = build_windows(mode, corpus.doc_lengths, 8, stride, corpus.doc_words, corpus.doc_bytes)
    collate = WindowCollator(corpus, w, pad_id=-7)
    batch_ids = [3, PAD, 0, len(w) - 1, 1, PAD]  # out of order, a padding entry inside and at the end
    batch = collate(batch_ids)
    width = batch["input_ids"].shape[1]
    assert width == max(int(w.end[i] - w.start[i]) for i in batch_ids if i != PAD)
    index, targets, docs = [], [], []
    for row, i in enumerate(batch_ids):
        if i == PAD:
            assert (batch["input_ids"][row] == -7).all()
            continue
        one = collate([i])
        inputs = one["input_ids"][0]
        assert batch["input_ids"][row, : len(inputs)].tolist() == inputs.tolist()
        assert (batch["input_ids"][row, len(inputs) :] == -7).all()
        index += (one["score_index"] + row * width).tolist()
        targets += one["targets"].tolist()
        docs += one["doc_ids"].tolist()
    assert batch["score_index"].tolist() == index
    assert batch["targets"].tolist() == targets and batch["doc_ids"].tolist() == docs
    real = [i for i in batch_ids if i != PAD]
    for key, per_window in (("documents", w.documents), ("words", w.words), ("bytes", w.bytes)):
        assert int(batch[key]) == int(per_window[real].sum()), key
    assert batch["window_ids"].tolist() == batch_ids
    assert all(batch[k].dtype == torch.int64 for k in ("input_ids", "score_index", "targets", "doc_ids"))
    empty = collate([PAD, PAD])  # a rank's padding step: nothing scored
    assert empty["input_ids"].shape == (2, 1) and empty["targets"].numel() == 0 and int(empty["documents"]) == 0


def test_warm_store_is_reused_and_a_changed_file_is_not(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("one two three")
    spec = lambda: DataSpec(path=str(path), cache_dir=str(tmp_path / "c"))  # noqa: E731
    first = prepare(spec(), ByteTokenizer(), 5, False)
    mtime = (first / "tokens.bin").stat().st_mtime_ns
    assert prepare(spec(), ByteTokenizer(), 5, False) == first and (first / "tokens.bin").stat().st_mtime_ns == mtime
    path.write_text("one two three four")
    second = prepare(spec(), ByteTokenizer(), 5, False)
    assert second != first and Corpus.open(second).doc_lengths.tolist() == [18]


def test_a_live_builder_is_waited_for_and_a_silent_one_taken_over(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("some text")
    spec = DataSpec(path=str(path), cache_dir=str(tmp_path / "c"))
    final = store_dir(spec, ByteTokenizer())
    lock = final.with_name(final.name + ".lock")
    lock.parent.mkdir(parents=True)
    lock.write_text("otherhost pid 1\n")
    stop = time.monotonic() + 1.5

    def live_builder() -> None:  # refreshes its lock for 1.5 s, then goes silent (it died)
        while time.monotonic() < stop:
            os.utime(lock)
            time.sleep(0.05)

    beat = threading.Thread(target=live_builder)
    beat.start()
    t0 = time.monotonic()
    store = prepare(spec, ByteTokenizer(), timeout_s=0.5, progress=False)
    waited = time.monotonic() - t0
    beat.join()
    assert waited >= 1.5, "a lock that shows progress is waited for, however long"
    assert Corpus.open(store).doc_lengths.tolist() == [9] and not lock.exists()
    # A lock left long ago (by the wall clock) is taken over at once.
    path.write_text("other text")
    spec = DataSpec(path=str(path), cache_dir=str(tmp_path / "c"))
    lock = store_dir(spec, ByteTokenizer()).with_name(store_dir(spec, ByteTokenizer()).name + ".lock")
    lock.write_text("gone pid 2\n")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    assert Corpus.open(prepare(spec, ByteTokenizer(), timeout_s=300, progress=False)).doc_lengths.tolist() == [10]


_PREPARE = """
import sys
from lit_ppl.data.datamodule import WindowCollator
from lit_ppl.model.spec import ModelSpec
from lit_ppl.data.sources import DataSpec
from lit_ppl.data.store import prepare
tok = ModelSpec(path=sys.argv[1]).tokenizer()
print(prepare(DataSpec(path=sys.argv[2], cache_dir=sys.argv[3], num_proc=int(sys.argv[4])), tok, 120, False))
"""


@pytest.mark.slow
def test_concurrent_cold_builds_leave_one_valid_store(tmp_path):
    """Two processes (as two nodes' first ranks on a shared cache) start on the same cold cache at once."""
    require_shared()
    text = tmp_path / "wiki.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8") * 3, encoding="utf-8")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", _PREPARE, str(STORIES), str(text), str(cache)]
    procs = [subprocess.Popen([*cmd, "1"], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1]
    assert sorted(p.name for p in (cache / "tokens").iterdir()) == [Path(outs[0]).name], "no temp dir, no lock left"
    # num_proc=2 (a pool of forked processes) writes exactly the same store as one process did.
    parallel = subprocess.run([*cmd[:-1], str(tmp_path / "cache2"), "2"], env=env, capture_output=True, text=True)
    assert parallel.returncode == 0, parallel.stderr[-2000:]
    for name in ("tokens.bin", "documents.npy"):
        assert (Path(outs[0]) / name).read_bytes() == (Path(parallel.stdout.strip()) / name).read_bytes()


@pytest.mark.slow
def test_two_nodes_share_one_cold_cache(tmp_path, docs_file):
    """Two torchrun "nodes" on one shared cache directory: one builds, the other waits, results are one run's."""
    require_shared()
    cache, out = tmp_path / "cache", tmp_path / "out"
    args = [f"model.path={STORIES}", f"data.path={docs_file}", f"data.cache_dir={cache}", "eval.seq_len=64"]
    args += ["trainer.accelerator=cpu", "strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1", f"output_dir={out}"]
    results = wait(launch(args, tmp_path, nodes=2, per_node=1), timeout=300)
    assert all(code == 0 for code, _ in results), [err[-2000:] for _, err in results]
    assert len([p for p in (cache / "tokens").iterdir()]) == 1
    r = json.loads((out / "results.json").read_text())
    assert r["world_size"] == 2 and r["documents"] == 5 and sum(r["rank_tokens"]) == r["tokens"]


def test_fetch_prepares_the_store_an_offline_run_uses(tmp_path, compose, texts):
    from lit_ppl.fetch import fetch

    path = _write(tmp_path / "docs.jsonl", _jsonl(texts))
    cfg = compose(f"model.path={STORIES}", f"data.path={path}", "eval.seq_len=128")
    store = fetch(cfg)
    before = (store / "tokens.bin").stat().st_mtime_ns
    r = evaluate(cfg)
    assert r["data"]["token_store"] == str(store) and (store / "tokens.bin").stat().st_mtime_ns == before
    assert len(list(store.parent.iterdir())) == 1, "the run built no second store"
