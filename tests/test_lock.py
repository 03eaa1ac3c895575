"""The run lock holds (issue 34): a live run keeps its output_dir, a dead one's lock is taken over by exactly one
process, a full disk leaves no lock behind, and a run deletes no file it cannot prove it wrote."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from helpers.lock_race import race

from lit_ppl.errors import LitPplError
from lit_ppl.runtime.files import write_json_atomic
from lit_ppl.runtime.lock import RUN_LOCK, STALE_S, holder_record, run_lock


def _stale(lock: Path, kind: str) -> None:
    """A lock whose holder is gone, as each rule sees it."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    record = {**holder_record(), "pid": dead.pid}
    if kind == "another host":
        record["host"] = "node-a"
    lock.write_text("" if kind == "unreadable" else json.dumps(record))
    if kind != "this host, pid gone":
        os.utime(lock, (time.time() - 2 * STALE_S,) * 2)


def _held_elsewhere(out: Path, env: dict[str, str]) -> subprocess.Popen:
    """A live run (another process) holding ``out``'s lock until its stdin closes."""
    code = (
        "import sys; from pathlib import Path; from lit_ppl.runtime.lock import run_lock\n"
        f"with run_lock(Path({str(out)!r}), True):\n    print('held', flush=True); sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline() == b"held\n"
    return proc


def test_a_second_run_of_the_same_slurm_job_is_refused_while_the_first_lives(tmp_path, monkeypatch):
    """srun steps of one allocation share SLURM_JOB_ID: that alone took a live run's lock. Now only an earlier
    attempt of a requeued job (higher SLURM_RESTART_COUNT), a gone pid on this host, a reused pid, or a heartbeat
    stopped on another host give it up."""
    lock = tmp_path / RUN_LOCK
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    holder = _held_elsewhere(tmp_path, {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"})
    try:
        owner = json.loads(lock.read_text())
        busy = rf"is in use by another run \(.* pid {holder.pid}\), Slurm job 4242"
        with pytest.raises(LitPplError, match=busy), run_lock(tmp_path, True):
            pass
        assert json.loads(lock.read_text()) == owner, "the live run's lock is untouched"
    finally:
        holder.communicate(b"")
    assert holder.returncode == 0 and not lock.exists(), "its holder removed it on the way out"

    def lock_of(**fields) -> None:
        lock.write_text(json.dumps({**holder_record(), "host": "node-a", "slurm_job": "4242", **fields}))

    lock_of(slurm_restart=0)  # another node of this allocation, heartbeat fresh: alive
    with pytest.raises(LitPplError, match="in use by another run"), run_lock(tmp_path, True):
        pass
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # this job requeued: Slurm ended attempt 0 everywhere
    with run_lock(tmp_path, True):
        assert json.loads(lock.read_text())["slurm_restart"] == 1
    sleeper = subprocess.Popen(["sleep", "60"])
    try:  # this host, pid alive but started at another time: the pid was reused
        lock_of(host=socket.gethostname(), pid=sleeper.pid, started="1", slurm_restart=1)
        with run_lock(tmp_path, True):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not lock.exists()


def test_six_processes_racing_for_a_stale_lock_give_exactly_one_holder(tmp_path):
    """Each took over by unlinking the stale lock and creating its own, so one could unlink another's fresh lock:
    two holders in 1 of 20 trials. A takeover is now a claim only one process can create."""
    kinds = ["this host, pid gone", "another host", "unreadable"]
    trials, workers = 20 * len(kinds), 6
    ctx = multiprocessing.get_context("spawn")
    barrier, answers = ctx.Barrier(workers + 1, timeout=120), ctx.Queue()
    args = (str(tmp_path), "lit_ppl.runtime.lock", barrier, answers, trials)
    procs = [ctx.Process(target=race, args=args) for _ in range(workers)]
    for p in procs:
        p.start()
    holders = []
    try:
        for trial in range(trials):
            _stale(tmp_path / RUN_LOCK, kinds[trial % len(kinds)])
            barrier.wait()  # go
            barrier.wait()  # all tried
            got = [answers.get(timeout=60) for _ in range(workers)]
            won = [pid for _, pid, took in got if took]
            holders.append(len(won))
            if len(won) == 1:
                assert json.loads((tmp_path / RUN_LOCK).read_text())["pid"] == won[0]
            barrier.wait()  # the holder releases
            barrier.wait()  # released (else the next trial's stale lock could be the one its release removes)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert holders == [1] * trials, holders
    assert not list(tmp_path.iterdir()), "no lock, claim or temp file left"


@contextlib.contextmanager
def _tiny_filesystem(directory: Path):
    """A 64 KiB tmpfs at ``directory``, filled up (root only); unmounted on the way out."""
    directory.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)]).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        _fill(directory / "filler")
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def _fill(path: Path) -> None:
    """``path`` as large as its filesystem lets it grow."""
    with contextlib.suppress(OSError), open(path, "wb", buffering=0) as f:
        f.write(b"x" * (1 << 20))


def test_a_full_output_dir_is_one_line_and_leaves_no_lock(tmp_path, compose):
    """A full disk left an empty .lit_ppl.lock (blocking every later run) and a traceback; now one line naming the
    directory, nothing left behind, and the next run goes ahead once there is space."""
    from lit_ppl.run import evaluate

    with _tiny_filesystem(tmp_path / "full") as full:
        full_disk = rf"^no space left in {full} \(No space left on device\) while writing \.lit_ppl\.lock; free"
        with pytest.raises(LitPplError, match=full_disk):
            evaluate(compose(f"output_dir={full}", "eval.seq_len=32", "data.limit=2"))
        assert sorted(p.name for p in full.iterdir()) == ["filler"], "no lock, no temp file"
        (full / "filler").unlink()
        write_json_atomic(full / "results.json", {"ppl": 1.5})
        _fill(full / "filler")
        with pytest.raises(LitPplError, match=rf"^no space left in {full} .* while writing results\.json"):
            write_json_atomic(full / "results.json", {"ppl": 2.0, "pad": "x" * 8192})
        assert json.loads((full / "results.json").read_text()) == {"ppl": 1.5}
        (full / "filler").unlink()
        (full / RUN_LOCK).write_text("")  # what an older lit-ppl left on a full disk, long ago
        os.utime(full / RUN_LOCK, (time.time() - 2 * STALE_S,) * 2)
        with run_lock(full, True):
            assert json.loads((full / RUN_LOCK).read_text())["pid"] == os.getpid()
        assert sorted(p.name for p in full.iterdir()) == ["results.json"]


def test_progress_files_lit_ppl_did_not_write_are_left_in_place(tmp_path, compose, capsys):
    """output_dir=/ deleted /progress/rank0-step*.pt files it had just called unreadable. Here a directory stands
    for /: a file that cannot be read and one that holds no lit-ppl progress are reported and left as they were."""
    from lit_ppl.run import evaluate

    root = tmp_path / "root"
    (root / "progress").mkdir(parents=True)
    garbage, tensor = root / "progress" / "rank0-step2.pt", root / "progress" / "rank0-step3.pt"
    garbage.write_bytes(b"not a checkpoint")
    torch.save(torch.arange(4), tensor)
    before = {p: p.read_bytes() for p in (garbage, tensor)}
    r = evaluate(compose(f"output_dir={root}", "eval.seq_len=32", "batch_size=1", "resume.save_every=1"))
    assert r["ppl"] > 0 and (root / "results.json").is_file()
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in (root / "progress").iterdir()) == ["rank0-step2.pt", "rank0-step3.pt"]
    err = capsys.readouterr().err
    assert f"ignoring progress file {garbage}: it cannot be read" in err and "left in place" in err
    assert f"ignoring {tensor}: it holds no lit-ppl progress; left in place" in err
    assert f"progress not saved at step 2: {garbage} is not lit-ppl's to replace" in err
    assert "Traceback" not in err


def test_the_holder_keeps_its_lock_fresh_and_says_when_it_lost_it(tmp_path, monkeypatch, capsys):
    """The heartbeat is what another host reads: the holder touches its lock, and stops (saying so) once the lock is
    someone else's."""
    from lit_ppl.runtime import lock as locks

    monkeypatch.setattr(locks, "HEARTBEAT_S", 0.05)
    path = tmp_path / RUN_LOCK
    with run_lock(tmp_path, True):
        os.utime(path, (time.time() - 3600,) * 2)
        time.sleep(0.5)
        assert time.time() - path.stat().st_mtime < 5, "touched again"
        path.write_text(json.dumps({**holder_record(), "host": "node-b", "pid": 7}))
        time.sleep(0.5)
    assert f"{path} was taken over by node-b pid 7 while this run held it" in capsys.readouterr().err
    assert json.loads(path.read_text())["host"] == "node-b", "the new holder's lock is not removed"
