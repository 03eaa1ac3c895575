"""Tests for ``lit_ppl.doctor``: pure checks in-process, the real CLI in real (multi-)process launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.nodes import free_port

from lit_ppl.doctor import DistEnv, DistEnvError, check_consistency, resolve_dist_env
from lit_ppl.runtime.files import write_json_atomic

REPO_ROOT = Path(__file__).resolve().parents[1]

# Variables that would make a subprocess believe it is part of some outer launch.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
_LAUNCH_VARS += ("MASTER_ADDR", "MASTER_PORT")


def _info(rank: int, world_size: int = 2, node_rank: int = 0, local_rank: int | None = None) -> dict[str, Any]:
    """A minimal rank report, shaped like ``collect_rank_info`` output."""
    return {
        "rank": rank,
        "local_rank": rank if local_rank is None else local_rank,
        "node_rank": node_rank,
        "world_size": world_size,
        "hostname": f"host{node_rank}",
        "versions": {"python": "3.11.7", "torch": "2.13.0", "lightning": "2.6.6"},
    }


def _clean_env() -> dict[str, str]:
    """The current environment minus any launcher variables, with the source tree importable."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def test_check_consistency_clean_set_passes() -> None:
    assert check_consistency([_info(0), _info(1)]) == []


def test_check_consistency_flags_version_mismatch() -> None:
    odd = _info(1)
    odd["versions"]["torch"] = "2.12.0"
    problems = check_consistency([_info(0), odd])
    assert len(problems) == 1
    assert "torch" in problems[0]
    assert "2.12.0" in problems[0] and "2.13.0" in problems[0]


def test_check_consistency_flags_duplicate_rank() -> None:
    # Two processes both think they are rank 0 (on different nodes), so rank 1 is missing.
    problems = check_consistency([_info(0, node_rank=0), _info(0, node_rank=1, local_rank=1)])
    assert any("global rank 0 reported by 2" in p for p in problems)
    assert any("[1] missing" in p for p in problems)


def test_check_consistency_flags_world_size_and_slot_clash() -> None:
    infos = [_info(0, local_rank=0), _info(1, local_rank=0), _info(2, world_size=4, local_rank=2)]
    problems = check_consistency(infos)
    assert any("world size mismatch" in p for p in problems)
    assert any("node 0 local rank 0 claimed by global ranks [0, 1]" in p for p in problems)


def test_resolve_dist_env_plain() -> None:
    env = resolve_dist_env({"PATH": "/usr/bin"})
    assert env == DistEnv(0, 1, 0, 0, None, None, "single")


def test_resolve_dist_env_torchrun() -> None:
    environ = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        # torchrun vars must win over an enclosing srun's.
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }
    assert resolve_dist_env(environ) == DistEnv(5, 8, 1, 1, "10.0.0.1", 29500, "torchrun")


def test_resolve_dist_env_torchrun_node_rank_from_local_world_size() -> None:
    environ = {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "1",
    }
    assert resolve_dist_env(environ).node_rank == 1


def test_resolve_dist_env_torchrun_missing_variable_is_named() -> None:
    with pytest.raises(DistEnvError, match="WORLD_SIZE"):
        resolve_dist_env({"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    with pytest.raises(DistEnvError, match="MASTER_PORT"):
        resolve_dist_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "a"})
    with pytest.raises(DistEnvError, match="RANK=2"):
        resolve_dist_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"})


def test_resolve_dist_env_slurm() -> None:
    environ = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123456",
    }
    seen: list[str] = []

    def hostnames(nodelist: str) -> list[str]:
        # Stands in for `scontrol show hostnames`, which needs a Slurm installation.
        seen.append(nodelist)
        return ["gpu07", "gpu08"]

    env = resolve_dist_env(environ, hostnames=hostnames)
    assert seen == ["gpu[07-08]"]
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (3, 4, 1, 1)
    assert env.master_addr == "gpu07"
    assert env.launcher == "slurm"
    # Every task of the job must derive the same port from the job id alone.
    assert env.master_port == resolve_dist_env(dict(environ, SLURM_PROCID="0"), hostnames=hostnames).master_port
    assert 1024 < env.master_port < 65536

    explicit = resolve_dist_env(dict(environ, MASTER_ADDR="10.1.1.1", MASTER_PORT="29400"), hostnames=hostnames)
    assert (explicit.master_addr, explicit.master_port) == ("10.1.1.1", 29400)
    assert len(seen) == 2  # no nodelist expansion when MASTER_ADDR is given


def test_resolve_dist_env_slurm_missing_variable_is_named() -> None:
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    with pytest.raises(DistEnvError, match="SLURM_JOB_NODELIST"):
        resolve_dist_env(environ)
    with pytest.raises(DistEnvError, match="SLURM_JOB_ID"):
        resolve_dist_env(dict(environ, MASTER_ADDR="a"))
    with pytest.raises(DistEnvError, match="SLURM_LOCALID"):
        resolve_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"})


# A task of a 2-node, 4-task srun step, as Slurm exports it. Job id 17890: the doctor's former rule
# (15000 + id % 20000 = 32890) and Lightning's (15000 + last four digits = 22890) disagree on it.
_SLURM_TASK = {
    "SLURM_JOB_ID": "17890",
    "SLURM_JOB_NAME": "ppl",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "MASTER_ADDR": "gpu07",
}


@pytest.mark.parametrize("master_port", [None, "29411"], ids=["derived", "MASTER_PORT"])
def test_slurm_port_is_lightnings(monkeypatch: pytest.MonkeyPatch, master_port: str | None) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for name in [*_LAUNCH_VARS, *(k for k in os.environ if k.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    for name, value in _SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    if master_port is not None:
        monkeypatch.setenv("MASTER_PORT", master_port)

    env = resolve_dist_env(os.environ)
    # The doctor must not leave Lightning's MASTER_PORT behind: Lightning below would then just read it back.
    assert os.environ.get("MASTER_PORT") == master_port
    assert env.launcher == "slurm"
    assert env.master_port == SLURMEnvironment(auto_requeue=False).main_port
    if master_port is not None:
        assert env.master_port == int(master_port)


def test_slurm_launch_lightning_rejects_is_reported() -> None:
    # srun --ntasks=4 without --ntasks-per-node: Lightning refuses to run, so the doctor must not pass it.
    environ = {k: v for k, v in _SLURM_TASK.items() if k != "SLURM_NTASKS_PER_NODE"}
    before = dict(os.environ)
    with pytest.raises(DistEnvError, match="ntasks-per-node"):
        resolve_dist_env(environ)
    assert dict(os.environ) == before
    with pytest.raises(DistEnvError, match="MASTER_PORT='x'"):
        resolve_dist_env(dict(_SLURM_TASK, MASTER_PORT="x"))


def test_write_json_atomic_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "report.json"
    write_json_atomic(target, {"ok": True})
    write_json_atomic(target, {"ok": False})
    assert json.loads(target.read_text()) == {"ok": False}
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]


def test_doctor_single_process(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lit_ppl.doctor", "--timeout-s", "30", "--json", str(report_path)],
        cwd=REPO_ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["world_size"] == 1


def test_doctor_launch_error_exits_1() -> None:
    # RANK without WORLD_SIZE: must fail fast with the missing variable named, never hang.
    proc = subprocess.run(
        [sys.executable, "-m", "lit_ppl.doctor"],
        cwd=REPO_ROOT,
        env=dict(_clean_env(), RANK="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "WORLD_SIZE" in proc.stderr


@pytest.mark.slow
def test_doctor_under_torchrun(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "lit_ppl.doctor",
        "--timeout-s",
        "60",
        "--json",
        str(report_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"]
    assert [info["rank"] for info in report["ranks"]] == [0, 1]
    assert {info["world_size"] for info in report["ranks"]} == {2}
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["all_reduce"]["ok"]
    assert all(r["all_reduce"]["ok"] and r["all_reduce"]["got"] == [3.0] for r in report["live"])
