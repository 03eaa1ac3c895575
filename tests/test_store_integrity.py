"""Stores that mix or rot (issue 34): a saved reference is one run's, whole and checked; the per-token outputs too.

Each test reproduces cases of the second hostile battery; before, each gave exit 0 with a wrong number, a store
marked complete with rows nobody wrote, a traceback, or a "Bus error".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, STORIES, TINYSTORIES, WIKITEXT, require_shared
from helpers.nodes import launch, wait
from helpers.runs import evaluate_overrides, stories_overrides

from lit_ppl.errors import LitPplError


def _files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir()) if p.is_file()}


def _record(pid: int, host: str | None = None) -> str:
    """A lock naming process ``pid`` on ``host`` (this one by default) as its holder."""
    return json.dumps({"token": f"t{pid}", "host": host or socket.gethostname(), "pid": pid})


@pytest.fixture(scope="module")
def stores(docs_file, tmp_path_factory):
    """Two complete stores of one model and text, at seq_len 64 and 128 (the same rows: rolling windows score every
    token once), and a per-token run."""
    require_shared()
    root = tmp_path_factory.mktemp("stores")
    base = stories_overrides(docs_file, root / "cache")
    seq128 = [*(a for a in base if not a.startswith("eval.seq_len")), "eval.seq_len=128"]
    evaluate_overrides([*base, f"save_reference={root / 's64'}"], root / "out64")
    evaluate_overrides([*seq128, f"save_reference={root / 's128'}"], root / "out128")
    return {"root": root, "base": base, "seq128": seq128, "s64": root / "s64", "s128": root / "s128"}


def _unfinished(store: Path, to: Path) -> Path:
    """A copy of ``store`` as it is while its run writes it."""
    shutil.copytree(store, to)
    manifest = json.loads((to / "manifest.json").read_text())
    (to / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    return to


def test_one_writer_per_store_and_one_run_per_store(stores, tmp_path):
    """Item 2 and 5: a second writer while one writes is refused (before, two runs mixed 9,856 rows of another
    model); a lock whose owner is gone is taken over (the run lock's rules: tests/test_lock.py); another model,
    seq_len or a complete store is never written."""
    base, s64 = stores["base"], stores["s64"]
    lock = ".lit_ppl.store.lock"
    busy, dead = _unfinished(s64, tmp_path / "busy"), _unfinished(s64, tmp_path / "dead")
    live = subprocess.Popen(["sleep", "60"])
    try:
        (busy / lock).write_text(_record(live.pid))  # a store this host's live process is writing
        before = _files(busy)
        with pytest.raises(LitPplError, match="is in use by another run"):
            evaluate_overrides([*base, f"save_reference={busy}"], tmp_path / "o1")
        assert _files(busy) == before, "the refused run changed nothing"
        # Another node's lock, touched recently, is live; one untouched for long (a node that died) is taken over.
        (busy / lock).write_text(_record(live.pid, "other-node"))
        with pytest.raises(LitPplError, match="in use by another run"):
            evaluate_overrides([*base, f"save_reference={busy}"], tmp_path / "o2")
        os.utime(busy / lock, (time.time() - 3600, time.time() - 3600))
        evaluate_overrides([*base, f"save_reference={busy}"], tmp_path / "o3")
        assert json.loads((busy / "manifest.json").read_text())["complete"] and not (busy / lock).exists()
    finally:
        live.kill()
        live.wait()
    (dead / lock).write_text(_record(live.pid))  # this host's process, gone: taken over
    evaluate_overrides([*base, f"save_reference={dead}"], tmp_path / "o4")
    assert json.loads((dead / "manifest.json").read_text())["complete"]

    before = _files(s64)
    other = tmp_path / "other_checkpoint"
    shutil.copytree(STORIES, other)
    (other / "model.safetensors").touch()  # a checkpoint whose weight files are others (their identity)
    other_model = [*(a for a in base if not a.startswith("model.path")), f"model.path={other}"]
    with pytest.raises(LitPplError, match=r"complete reference of another run \(another model"):
        evaluate_overrides([*other_model, f"save_reference={s64}"], tmp_path / "o5")
    with pytest.raises(LitPplError, match=r"another run \(.*another quantization"):
        evaluate_overrides([*base, "quant=int8", f"save_reference={s64}"], tmp_path / "o6")
    with pytest.raises(LitPplError, match="already holds this model's complete reference"):
        evaluate_overrides([*base, f"save_reference={s64}"], tmp_path / "o7")
    # An unfinished store of seq_len 64 is not continued at seq_len 128 (before, two seq_lens at once mixed rows).
    unfinished = _unfinished(s64, tmp_path / "unfinished")
    with pytest.raises(LitPplError, match=r"unfinished reference of another run \(other windows"):
        evaluate_overrides([*stores["seq128"], f"save_reference={unfinished}"], tmp_path / "o8")
    assert _files(s64) == before


def test_store_damage_is_one_line_naming_the_file(stores, tmp_path):
    """Item 4: damage anywhere, not only in the first batch (before: mean KLD 2.14 for a true 0.00099 with rows of
    hidden.npy zeroed; 0.086 with hidden.npy and nll.npy of a seq_len-64 store in a seq_len-128 one)."""
    base, seq128 = stores["base"], stores["seq128"]

    def read(store: Path, args: list[str], name: str) -> str:
        with pytest.raises(LitPplError) as err:
            evaluate_overrides(
                [*args, "quant=int8", "compare=saved", f"compare.reference.store={store}"], tmp_path / name
            )
        return str(err.value)

    zeroed = tmp_path / "zeroed"
    shutil.copytree(stores["s64"], zeroed)
    hidden = np.load(zeroed / "hidden.npy", mmap_mode="r+")
    hidden[-500:] = 0
    hidden.flush()
    del hidden
    assert "hidden.npy rows" in read(zeroed, base, "a")
    mixed = tmp_path / "mixed"
    shutil.copytree(stores["s128"], mixed)
    for name in ("hidden.npy", "nll.npy"):
        shutil.copy(stores["s64"] / name, mixed / name)
    assert "hidden.npy rows" in read(mixed, seq128, "b")


@pytest.mark.parametrize(
    "damage,names",
    [
        ("truncated hidden", "hidden.npy cannot be read"),
        ("empty hidden", "hidden.npy cannot be read"),
        ("object nll", "nll.npy cannot be read"),
        ("manifest not JSON", "manifest.json is not JSON"),
        ("no dtype", "gives dtype None"),
        ("unknown dtype", "gives dtype 'float8'"),
        ("float32 labelled bfloat16", "hidden.npy holds a"),
        ("old format", "says format 1"),
        ("pickle head", "head.pt is not the file whose digest"),
        ("pickle head, digest forged", "head.pt is not a head lit-ppl saved"),
    ],
)
def test_a_damaged_store_is_one_line_naming_the_file(stores, tmp_path, damage, names):
    """Item 7 and 8: before, a traceback ("internal error") for each, and advice to load head.pt with
    weights_only=False; the pickle never runs."""
    store = tmp_path / "store"
    shutil.copytree(stores["s64"], store)
    manifest = json.loads((store / "manifest.json").read_text())
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    if damage == "truncated hidden":
        (store / "hidden.npy").write_bytes((store / "hidden.npy").read_bytes()[:5000])
    elif damage == "empty hidden":
        (store / "hidden.npy").write_bytes(b"")
    elif damage == "object nll":
        np.save(store / "nll.npy", np.array([None] * manifest["tokens"], dtype=object), allow_pickle=True)
    elif damage == "manifest not JSON":
        (store / "manifest.json").write_text("{not json")
    elif damage in ("no dtype", "unknown dtype", "old format"):
        changed = {k: v for k, v in manifest.items() if k != "dtype"}
        changed |= {"dtype": "float8"} if damage == "unknown dtype" else {}
        changed = {**manifest, "format": 1} if damage == "old format" else changed
        (store / "manifest.json").write_text(json.dumps(changed))
    elif damage == "float32 labelled bfloat16":
        (store / "manifest.json").write_text(json.dumps({**manifest, "dtype": "bfloat16"}))
    else:
        torch.save(Payload(), store / "head.pt")
        if damage.endswith("forged"):
            import hashlib

            files = {
                **manifest.get("files", {}),
                "head.pt": hashlib.sha256((store / "head.pt").read_bytes()).hexdigest(),
            }
            (store / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
    args = [*stores["base"], "compare=saved", f"compare.reference.store={store}"]
    with pytest.raises(LitPplError) as err:
        evaluate_overrides(args, tmp_path / "out")
    line = str(err.value)
    assert names in line and "\n" not in line and "weights_only=False" not in line, line
    assert not marker.exists()


def _refusal(args: list[str], out: Path) -> str:
    try:
        evaluate_overrides(args, out)
    except LitPplError as err:
        return str(err)
    return "no error"


def _put_refusal(queue: multiprocessing.Queue, args: list[str], out: Path) -> None:
    queue.put(_refusal(args, out))


def _in_child(args: list[str], out: Path) -> tuple[int | None, str]:
    """:func:`_refusal` in a fresh (spawned) process: ``(its exit code, what it returned)`` (a signal's exit code is
    negative). Not forked: a fork of this process, whose OpenMP threads other tests started, can hang in torch."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_put_refusal, args=(queue, args, out))
    child.start()
    child.join(300)
    return child.exitcode, queue.get(timeout=1) if child.exitcode == 0 else ""


def _mounted(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0
    )


def test_a_full_or_read_only_disk_is_one_line(stores, tmp_path):
    """Item 6 and 7: before, a full disk under save_reference or report.per_token ended in "Bus error" (rc 135: the
    files were sparse memory maps), and a read-only store directory was found after the model loaded."""
    from hydra import compose, initialize_config_dir

    from lit_ppl.preflight import preflight
    from lit_ppl.validate import conf_dir

    small, ro, full = tmp_path / "small", tmp_path / "ro", tmp_path / "full"
    if not (_mounted(small, "size=200k") and _mounted(ro, "ro,size=64k") and _mounted(full, "size=64k")):
        pytest.skip("mounting a tmpfs needs root")
    try:
        base = stores["base"]
        (full / "filler").write_bytes(b"\0" * (56 << 10))  # room for the small files, not for per_token.npy
        # Each in a child process: before, each died of SIGBUS.
        for where, name, args in (
            (small, "hidden.npy", [f"save_reference={small}"]),
            (full, "per_token.npy", ["report.per_token=true"]),
        ):
            code, message = _in_child([*base, *args], full if where == full else tmp_path / "o")
            assert code == 0 and f"{where} has no room for {name}: it needs" in message, (code, message)
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            cfg = compose("validate", overrides=[*base, f"save_reference={ro}", f"output_dir={tmp_path / 'o'}"])
        with pytest.raises(LitPplError, match=r"save_reference=.*ro' is not writable: Read-only file system"):
            preflight(cfg)  # before any weight loads
    finally:
        for path in (small, ro, full):
            subprocess.run(["umount", str(path)], capture_output=True)


def test_outputs_say_what_they_are_and_a_stale_per_token_file_is_replaced(stores, docs_file, tmp_path):
    """Item 8: a reference saved under quant=int8 says so (before: "float32"); per_token.npy of another size, which
    lit-ppl wrote, no longer blocks a fresh run (before: "holds N bytes"); one lit-ppl did not write is left alone."""
    base = stores["base"]
    store = tmp_path / "int8"
    evaluate_overrides([*base, "quant=int8", f"save_reference={store}"], tmp_path / "save")
    assert json.loads((store / "manifest.json").read_text())["quant"]["name"] == "int8"
    read = evaluate_overrides([*base, "compare=saved", f"compare.reference.store={store}"], tmp_path / "read")
    assert read["reference_store"]["quant"]["name"] == "int8" and read["reference_store"]["dtype"] == "float32"

    out = tmp_path / "out"
    evaluate_overrides([*base, "report.per_token=true", "data.limit=2"], out)
    small = np.load(out / "per_token.npy").shape
    full = evaluate_overrides([*base, "report.per_token=true"], out)
    assert small[0] < full["tokens"] == np.load(out / "per_token.npy").shape[0]
    assert json.loads((out / "per_token.json").read_text())["complete"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    np.save(foreign / "per_token.npy", np.arange(3.0))
    with pytest.raises(LitPplError, match=r"per_token\.npy was not written by lit-ppl"):
        evaluate_overrides([*base, "report.per_token=true"], foreign)
    assert np.load(foreign / "per_token.npy").tolist() == [0.0, 1.0, 2.0]


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("lit-ppl: error:")]


@pytest.mark.slow
def test_rows_nobody_wrote_are_never_marked_complete(tmp_path):
    """Item 3: two torchrun nodes with node-local output directories (before: exit 0, 6,144 of 12,383 rows of
    per_token.npy zero, the store "complete"); kill -9, the output files deleted, resume (before: exit 0 with 10,240
    zero rows). The right behaviour: one line, and no file marked complete."""
    require_shared()
    args = [f"model.path={STORIES}", "model=hf", "data=text", f"data.path={TINYSTORIES}", "trainer.accelerator=cpu"]
    args += ["eval.seq_len=64", "report.per_token=true", "strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1"]
    local = {n: [f"output_dir={tmp_path / f'node{n}'}", f"save_reference={tmp_path / f'store{n}'}"] for n in (0, 1)}
    results = wait(launch(args, tmp_path, node_args=local), timeout=300)
    for code, err in results:
        lines = _lines(err)
        assert code == 1 and len(lines) == 1, err[-3000:]
        assert "never written" in lines[0] and "not marked complete" in lines[0], lines[0]
    assert not json.loads((tmp_path / "store0" / "manifest.json").read_text())["complete"]
    assert not (tmp_path / "node0" / "results.json").exists()

    text = tmp_path / "wiki.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    common = [f"data.path={text}", "eval.seq_len=256", "batch_size=4", "trainer.accelerator=cpu"]
    common += ["model.hidden_size=256", "model.num_layers=4", "report.per_token=true"]
    out, store = tmp_path / "run", tmp_path / "store"
    cmd = [sys.executable, "-m", "lit_ppl.validate", f"output_dir={out}", f"hydra.run.dir={out}", *common]
    cmd += [f"save_reference={store}", "resume.save_every=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((out / "progress").glob("rank0-step*.pt")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list((out / "progress").glob("rank0-step*.pt")), "no progress saved before the kill"
    for path in (out / "per_token.npy", *store.glob("*.npy")):
        path.unlink()
    with pytest.raises(LitPplError) as err:  # the resumed run, in this process
        evaluate_overrides([*common, f"save_reference={store}", "resume.save_every=2"], out)
    line = str(err.value)
    assert "per_token.npy is missing" in line and "hidden.npy is missing" in line and "progress" in line, line
    assert not json.loads((store / "manifest.json").read_text())["complete"]
    assert not (out / "results.json").exists()


def test_torch_load_of_the_payload_would_have_run_it(tmp_path):
    """The pickle the damaged-store test plants is a real payload: without weights_only it runs."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "head.pt"
    torch.save(Payload(), path)
    torch.load(path, weights_only=False)
    assert marker.exists()
