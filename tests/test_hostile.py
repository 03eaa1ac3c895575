"""Hostile but realistic input (issue 25): nodes that disagree, replaced weights, partial runs, bad values."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, STORIES, TINYSTORIES, require_shared
from helpers.nodes import launch, wait


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("lit-ppl: error:")]


@pytest.mark.slow
def test_nodes_with_different_settings_are_refused_on_every_rank(tmp_path):
    """Two torchrun nodes, one given another eval.seq_len: before, both exited 0 with one wrong PPL."""
    require_shared()
    args = [f"model.path={STORIES}", "model=hf", "data=text", f"data.path={TINYSTORIES}", "trainer.accelerator=cpu"]
    args += ["strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1", f"output_dir={tmp_path / 'out'}"]
    procs = launch(args, tmp_path, node_args={0: ["eval.seq_len=256"], 1: ["eval.seq_len=128"]})
    results = wait(procs, timeout=300)
    for code, err in results:
        lines = _lines(err)
        assert code != 0 and len(lines) == 1, err[-3000:]
        assert "the ranks disagree on eval, seq_len, windows" in lines[0] and "ranks [1]" in lines[0], lines[0]
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        ("+trainer.limit_val_batches=2", "trainer.limit_val_batches=2 would score part of the corpus"),
        ("+trainer.limit_val_batches=0.25", "trainer.limit_val_batches=0.25 would score part of the corpus"),
        ("+trainer.fast_dev_run=true", "trainer.fast_dev_run=True would score part of the corpus"),
        ("distributed.timeout_s=0", "distributed.timeout_s=0.0 must be a number of seconds > 0"),
        ("resume.save_every=-5", "resume.save_every=-5 must be an integer >= 0"),
        ("resume.check_every=0", "resume.check_every=0 must be a positive integer"),
    ],
)
def test_values_that_would_misreport_are_refused_by_the_schema(override, message):
    from hydra import compose, initialize_config_dir

    from lit_ppl import config
    from lit_ppl.validate import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose("validate", overrides=[override, "output_dir=/nonexistent"])
    with pytest.raises(config.ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config.check(cfg)


def test_every_gpu_on_a_cpu_run_is_one_line(compose):
    from lit_ppl.run import evaluate

    with pytest.raises(ValueError, match=r"trainer.devices=-1 means every GPU, but this run is on the CPU"):
        evaluate(compose("trainer.accelerator=cpu", "trainer.devices=-1"))


def test_a_whitespace_only_text_is_refused(compose, tmp_path):
    from lit_ppl.run import evaluate

    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n\t \n")
    with pytest.raises(ValueError, match=r"holds only whitespace: there is no text to score"):
        evaluate(compose("data=text", f"data.path={blank}", f"data.cache_dir={tmp_path / 'cache'}"))


def test_results_follow_the_umask_and_stride_is_null_where_ignored(compose, tmp_path):
    from lit_ppl.run import evaluate

    old = os.umask(0o022)
    try:
        r = evaluate(compose("eval.stride=128", f"data.cache_dir={tmp_path / 'cache'}"))
    finally:
        os.umask(old)
    mode = stat.S_IMODE((Path(r["config"]["output_dir"]) / "results.json").stat().st_mode)
    assert mode == 0o644, oct(mode)  # mkstemp's 0600 hid results from the rest of a group on shared storage
    assert r["mode"] == "rolling" and r["stride"] is None and r["config"]["eval"]["stride"] == 128


def _checkpoint(root: Path, seed: int) -> Path:
    """A small llama checkpoint (stories260K's shape, random weights from ``seed``) with stories260K's tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(STORIES))
    model.save_pretrained(root)
    for f in STORIES.iterdir():
        if "token" in f.name:
            shutil.copy(f, root / f.name)
    return root


def _interrupted(tmp_path: Path, model: Path) -> tuple[list[str], dict, Path]:
    """A run stopped by SIGUSR1 once it has saved progress twice; its command, environment and output_dir."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "lit_ppl.validate", "model=hf", f"model.path={model}", "data=text"]
    args += [f"data.path={TINYSTORIES}", "eval.seq_len=32", "batch_size=1", "resume.save_every=5"]
    args += ["resume.check_every=1", f"output_dir={out}", f"data.cache_dir={tmp_path / 'c'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(list((out / "progress").glob("rank0-step*.pt"))) < 2 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    return args, env, out


@pytest.mark.slow
def test_resume_refuses_progress_of_replaced_weights(tmp_path):
    """Interrupt a run, replace model.safetensors with other weights of the same shape, rerun: before, "resuming
    from step N" mixed the two checkpoints' sums into one PPL."""
    require_shared()
    ckpt, other = _checkpoint(tmp_path / "ckpt", 0), _checkpoint(tmp_path / "other", 1)
    args, env, out = _interrupted(tmp_path, ckpt)
    (ckpt / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    lines = _lines(done.stderr)
    assert done.returncode == 1 and len(lines) == 1 and "holds progress of a different run" in lines[0], done.stderr
    assert not (out / "results.json").exists()


@pytest.mark.slow
def test_a_truncated_progress_file_falls_back_to_the_one_before(tmp_path):
    require_shared()
    args, env, out = _interrupted(tmp_path, STORIES)
    files = sorted((out / "progress").glob("rank0-step*.pt"), key=lambda f: int(f.stem.split("step")[1]))
    newest, older = files[-1], files[-2]
    newest.write_bytes(newest.read_bytes()[:100])  # a full disk cut it short
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ignoring progress file {newest}" in done.stderr
    assert f"resuming from step {older.stem.split('step')[1]}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "outputs").exists(), "Hydra wrote outputs/ under the working directory"


def test_results_name_the_weights_they_came_from(compose, tmp_path):
    from lit_ppl.run import evaluate

    require_shared()
    ckpt = _checkpoint(tmp_path / "ckpt", 0)
    args = ("model=hf", f"model.path={ckpt}", f"data.cache_dir={tmp_path / 'cache'}")
    first = evaluate(compose(*args))
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())  # same bytes, new ctime
    second = evaluate(compose(*args))
    ident = first["model_identity"]
    assert ident["files"] >= 3 and ident["bytes"] > (ckpt / "model.safetensors").stat().st_size
    assert second["ppl"] == first["ppl"] and second["model_identity"]["digest"] != ident["digest"]
    assert second["model_identity"]["names_digest"] == ident["names_digest"]  # what copies on other nodes share
    assert json.loads(json.dumps(first))["model_identity"] == ident


def _damage(store: Path, how: str) -> None:
    import numpy as np

    if how == "documents length":
        docs = np.load(store / "documents.npy")
        docs[0, 0] -= 7
        np.save(store / "documents.npy", docs)
    elif how == "dtype":
        meta = json.loads((store / "meta.json").read_text())
        (store / "meta.json").write_text(json.dumps({**meta, "dtype": "uint8"}))
    elif how == "truncated tokens":
        data = (store / "tokens.bin").read_bytes()
        (store / "tokens.bin").write_bytes(data[: len(data) // 2])
    elif how == "broken meta":
        (store / "meta.json").write_text('{"version": "2", "dtype": ')
    elif how == "deleted documents":
        (store / "documents.npy").unlink()


@pytest.mark.parametrize("how", ["documents length", "dtype", "truncated tokens", "broken meta", "deleted documents"])
def test_a_damaged_token_store_is_one_line_naming_it(compose, tmp_path, how):
    from lit_ppl.run import evaluate

    require_shared()
    args = ("model=hf", f"model.path={STORIES}", "data=text", f"data.path={TINYSTORIES}", "eval.seq_len=128")
    cache = tmp_path / "cache"
    evaluate(compose(*args, f"data.cache_dir={cache}"))
    (store,) = [p for p in (cache / "tokens").iterdir() if p.is_dir()]
    _damage(store, how)
    with pytest.raises(ValueError, match=rf"the token store {store} is damaged \(.+\); delete that directory"):
        evaluate(compose(*args, f"data.cache_dir={cache}"))


def test_a_same_size_edit_with_its_mtime_put_back_is_tokenized_again(compose, tmp_path):
    from lit_ppl.run import evaluate

    require_shared()
    text = tmp_path / "text.txt"
    original = TINYSTORIES.read_text()
    text.write_text(original)
    args = ("model=hf", f"model.path={STORIES}", "data=text", f"data.path={text}", f"data.cache_dir={tmp_path / 'c'}")
    before = evaluate(compose(*args))
    st = text.stat()
    text.write_text(original[::-1])  # the same size, other text
    os.utime(text, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -d: the old mtime back
    after = evaluate(compose(*args))
    assert after["tokens"] != before["tokens"] or after["ppl"] != before["ppl"]
    assert len([p for p in (tmp_path / "c" / "tokens").iterdir() if p.is_dir()]) == 2


def test_a_builder_removes_only_its_own_lock(tmp_path):
    from lit_ppl.data import store

    lock = tmp_path / "key.lock"
    mine = store._take(lock)
    assert mine is not None and store._take(lock) is None
    lock.write_text("other-host pid 7 at 1\n")  # taken over by a second builder that thought this one stale
    store._release(lock, mine)
    assert lock.read_text().startswith("other-host")
    store._release(lock, "other-host pid 7 at 1")
    assert not lock.exists()


def test_the_lock_is_touched_during_one_long_batch(tmp_path, monkeypatch):
    """One batch that outlasts the timeout (a large file read as one document): before, the lock went stale."""
    from lit_ppl.data import store

    lock, final = tmp_path / "key.lock", tmp_path / "key"
    assert store._take(lock) is not None
    os.utime(lock, (0, 0))
    seen = []

    def slow_build(spec, tokenizer, directory, progress):
        directory.mkdir()
        for _ in range(6):
            time.sleep(0.1)
            seen.append(lock.stat().st_mtime)
        (directory / "meta.json").write_text("{}")

    monkeypatch.setattr(store, "build", slow_build)
    store._build_locked(None, None, final, lock, progress=False, timeout_s=0.2)
    assert seen[-1] > 0 and (final / "meta.json").is_file()


@pytest.mark.slow
def test_a_killed_builder_takes_its_workers_and_leaves_no_temporary_directory(tmp_path):
    require_shared()
    text = tmp_path / "big.jsonl"
    row = json.dumps({"text": TINYSTORIES.read_text()}) + "\n"
    text.write_text(row * (24_000_000 // len(row)))
    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "lit_ppl.fetch", "model=hf", f"model.path={STORIES}", "data=text"]
    args += [f"data.path={text}", "data.num_proc=2", f"data.cache_dir={cache}", f"hydra.run.dir={tmp_path / 'h'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, workers = time.time() + 120, []
    while len(workers) < 2 and time.time() < deadline:
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
        workers = [int(p) for p in out.split()]
        time.sleep(0.1)
    assert len(workers) >= 2, "the builder started no workers"
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{w}") for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    alive = [w for w in workers if os.path.exists(f"/proc/{w}") and "Z" not in Path(f"/proc/{w}/stat").read_text()]
    assert not alive, f"workers {alive} outlived their builder"
    assert list((cache / "tokens").glob("*.tmp-*")), "the killed builder left no temporary directory to test"
    (lock,) = (cache / "tokens").glob("*.lock")
    lock.unlink()  # as a waiting process does once the dead builder's lock is stale
    from lit_ppl.data.store import _remove_stale_builds

    final = lock.with_suffix("")
    _remove_stale_builds(final, timeout_s=300)
    assert not list((cache / "tokens").glob("*.tmp-*"))


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"text": "hello world"}, {"text": 5}], r"row 1 of .*: data.text_field='text' is int '5', not text"),
        ([{"text": "hello world"}, {"text": None}], r"row 1 of .*: data.text_field='text' is missing or null"),
        ([{"text": ["a", "b"]}], r"row 0 of .*: data.text_field='text' is list"),
        ([{"text": "hello"}, {"other": "x"}], r"row 1 of .*: data.text_field='text' is missing or null"),
        ('{"text": "hello"}\n{"text": "cut', r"data.path file .*rows.jsonl cannot be read as json: "),
    ],
)
def test_bad_json_rows_are_one_line_naming_the_row(compose, tmp_path, rows, message):
    from lit_ppl.run import evaluate

    path = tmp_path / "rows.jsonl"
    path.write_text(rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        evaluate(compose("data=text", f"data.path={path}", f"data.cache_dir={tmp_path / 'c'}"))


def test_a_corrupt_parquet_file_is_one_line_naming_it(compose, tmp_path):
    from lit_ppl.run import evaluate

    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1" + b"not a parquet file" + b"PAR1")
    with pytest.raises(ValueError, match=rf"data.path file {path} cannot be read as parquet: "):
        evaluate(compose("data=text", f"data.path={path}", f"data.cache_dir={tmp_path / 'c'}"))


def test_an_unwritable_cache_dir_is_one_line(compose, tmp_path):
    from lit_ppl.run import evaluate

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=rf"cannot write the token store under {blocker}/c .*set data.cache_dir"):
        evaluate(compose(f"data.cache_dir={blocker / 'c'}"))


def test_quantized_weights_in_float64_are_refused_before_loading(compose):
    from lit_ppl.run import evaluate

    with pytest.raises(ValueError, match=r"quant=int4 with precision=64-true: torchao's quantized weights take"):
        evaluate(compose("quant=int4", "quant.group_size=32", "precision=64-true"))


def test_output_dir_alone_keeps_hydra_out_of_the_working_directory():
    from lit_ppl.report.results import DEFER_HYDRA_FILES as D
    from lit_ppl.validate import with_run_dir

    assert with_run_dir(["output_dir=/o", "x=1"]) == ["hydra.run.dir=/o", D, "output_dir=/o", "x=1"]
    assert with_run_dir(["output_dir=/o", "hydra.run.dir=/h"]) == [D, "output_dir=/o", "hydra.run.dir=/h"]
    assert with_run_dir(["-m", "output_dir=/o"]) == ["-m", "output_dir=/o"] and with_run_dir(["x=1"]) == [D, "x=1"]
    assert with_run_dir(["hydra.output_subdir=h"]) == ["hydra.output_subdir=h"]  # the user's choice: Hydra writes
    assert with_run_dir(["--cfg", "job", "x=1"]) == ["--cfg", "job", D, "x=1"]
    assert with_run_dir(["--help"]) == ["--help", D]


def test_an_autobatch_cache_that_is_another_file_is_refused_untouched(compose, tmp_path):
    from lit_ppl.run import evaluate

    precious = tmp_path / "notes.txt"
    precious.write_text("not a cache\n")
    with pytest.raises(ValueError, match=r"autobatch.cache='.*notes.txt' exists and is not lit-ppl's batch-size"):
        evaluate(compose("batch_size=auto", f"autobatch.cache={precious}"))
    assert precious.read_text() == "not a cache\n"


def test_a_progress_file_with_objects_weights_only_refuses_is_skipped_in_one_line(tmp_path, capsys):
    import torch

    from lit_ppl.evaluation.resume import ResumeCallback

    path = tmp_path / "rank0-step5.pt"
    torch.save({"fingerprint": "x", "payload": Path("/etc")}, path)  # a Path: not an allowed global
    assert ResumeCallback._read(path) is None
    err = capsys.readouterr().err
    assert err.startswith(f"lit-ppl: ignoring progress file {path}: it cannot be read") and err.count("\n") == 1


class _PrefixPerCall:
    """Bytes, with a mark before every text it is called on: no cut can keep its tokens."""

    context_id, vocab_size, fingerprint = 257, 258, "prefix-per-call"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [[256, *t.encode("utf-8")] for t in texts]


def _trained_bpe(text: str, prefix_per_call: bool = False):
    """A small BPE tokenizer trained on ``text``: byte-level (GPT-2's scheme, as Llama 3 and SmolLM2 use), or one
    that puts a word-start mark before every text it is called on (SentencePiece's ``prepend_scheme=always``)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lit_ppl.model.tokenizer import HFTokenizer

    rust = RustTokenizer(models.BPE())
    if prefix_per_call:
        rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        rust.decoder = decoders.Metaspace(prepend_scheme="always")
    else:
        rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"]))
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>"))


@pytest.mark.parametrize("tokenizer_kind", ["bytes", "byte-level bpe", "stories260K", "metaspace", "prefix per call"])
@pytest.mark.parametrize("separator", [None, r"\n\n\n"])
def test_a_large_text_in_parts_gives_the_one_shot_tokens(tmp_path, monkeypatch, tokenizer_kind, separator):
    """Read and tokenized a few characters at a time (the sizes shrunk here), a plain-text corpus's store equals the
    store of its documents tokenized whole: the tokens, words and bytes of every document."""
    import numpy as np

    from lit_ppl.data import reading, tokenize
    from lit_ppl.data.sources import DataSpec
    from lit_ppl.data.store import Corpus, prepare
    from lit_ppl.model.spec import ModelSpec
    from lit_ppl.model.tokenizer import ByteTokenizer

    require_shared()
    stories = TINYSTORIES.read_text()
    text = "\n\n\n".join(stories[i::7] + "\r\n" + stories[: 500 + 97 * i] for i in range(7))  # \r\n: read as \n
    path = tmp_path / "book.txt"
    path.write_text(text, newline="")
    tokenizer = {
        "bytes": ByteTokenizer(),
        "byte-level bpe": _trained_bpe(stories),
        "stories260K": ModelSpec(path=str(STORIES)).tokenizer(),
        "metaspace": _trained_bpe(stories, prefix_per_call=True),  # a cut before a space keeps its tokens
        "prefix per call": _PrefixPerCall(),  # its tokens change at any cut: never cut
    }[tokenizer_kind]
    monkeypatch.setattr(reading, "CHUNK_CHARS", 1500)
    monkeypatch.setattr(reading, "SEPARATOR_LOOKAHEAD", 40)
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 1000)
    cuts: list[int | None] = []
    real_cut = tokenize._cut
    monkeypatch.setattr(tokenize, "_cut", lambda text, tok: cuts.append(real_cut(text, tok)) or cuts[-1])
    spec = DataSpec(path=str(path), document_separator=separator, cache_dir=str(tmp_path / "cache"))
    corpus = Corpus.open(prepare(spec, tokenizer, progress=False))
    whole = text.replace("\r\n", "\n")
    docs = [d for d in whole.split("\n\n\n") if d.strip()] if separator else [whole]
    ids = tokenizer.encode(docs)
    expected = np.concatenate([[tokenizer.context_id, *x] for x in ids])
    assert np.array_equal(np.asarray(corpus.tokens), expected)
    assert corpus.doc_lengths.tolist() == [len(x) for x in ids]
    assert corpus.doc_words.tolist() == [len(re.split(r"\s+", d)) for d in docs]
    assert corpus.doc_bytes.tolist() == [len(d.encode()) for d in docs]
    made = [c for c in cuts if c is not None]
    if tokenizer_kind == "prefix per call":
        assert not made and (cuts or separator)  # tried, refused: such documents are tokenized whole, as before
    elif separator is None:
        assert len(made) >= 5, cuts  # the one document really was tokenized in pieces


def test_a_second_run_into_a_busy_output_dir_is_refused(compose, tmp_path):
    """Two runs into one output_dir raced (the last writer won): the second is now refused while the first lives;
    a lock left by a process that is gone is taken over."""
    import socket

    from lit_ppl.run import evaluate

    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        lock = out / ".lit_ppl.lock"
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": other.pid, "slurm_job": None}))
        with pytest.raises(ValueError, match=rf"output_dir='{out}' is in use by another run \(.* pid {other.pid}\)"):
            evaluate(compose(f"output_dir={out}"))
        assert not (out / "results.json").exists() and lock.exists()
    finally:
        other.kill()
        other.wait()
    r = evaluate(compose(f"output_dir={out}"))  # its holder is gone: taken over, and released at the end
    assert (out / "results.json").is_file() and r["ppl"] > 0 and not lock.exists()
