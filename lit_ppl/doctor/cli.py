"""Environment doctor: checks that every rank of a (possibly multi-node) launch sees a sane setup.

Run it exactly like a real job (alone, under ``torchrun`` or under Slurm ``srun``)::

    python -m lit_ppl.doctor
    torchrun --nproc_per_node 2 -m lit_ppl.doctor --json doctor.json
    srun --ntasks-per-node 4 python -m lit_ppl.doctor

Every rank collects facts about itself (host, devices, library versions), all ranks exchange them
with ``all_gather_object``, and rank 0 prints one table row per rank plus the outcome of the
consistency checks and of a live ``all_reduce`` / ``barrier``. The exit status is 0 only if every
check passed, on every rank, so a launcher's own exit status is meaningful too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from lit_ppl.doctor.checks import build_report, default_backend, gather_all, join_process_group, run_live_checks
from lit_ppl.doctor.env import DistEnvError, resolve_dist_env
from lit_ppl.doctor.facts import collect_rank_info
from lit_ppl.doctor.report import print_report, print_verdict, write_report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(prog="python -m lit_ppl.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="process-group backend (default: nccl with CUDA, else gloo)")
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="rendezvous/collective timeout in seconds (default: 60)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the gathered report here (rank 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the doctor on this rank.

    Args:
        argv: Command-line arguments; ``None`` means ``sys.argv[1:]``.

    Returns:
        0 if every check passed on every rank, 1 otherwise.
    """
    args = parse_args(argv)
    try:
        env = resolve_dist_env(os.environ)
    except DistEnvError as err:
        print(f"FAILED: launch environment: {err}", file=sys.stderr)
        return 1
    backend = args.backend or default_backend()

    stage = "init_process_group"
    try:
        device = join_process_group(env, backend, args.timeout_s)
        stage = "collect"
        info = collect_rank_info(env, backend)
        stage = "all_gather_object"
        infos = gather_all(info, env.world_size)
        stage = "all_reduce/barrier"
        live = gather_all(run_live_checks(env, device), env.world_size)
    except Exception as err:
        # Print on every rank: the rank that broke may not be rank 0.
        where = f"{env.launcher} rank {env.rank}/{env.world_size}"
        if env.master_addr is not None:
            where += f" via {env.master_addr}:{env.master_port}"
        print(f"FAILED: {stage} on {where}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

    # Every rank builds the same report from the same gathered data, so all exit codes agree.
    report = build_report(infos, live, backend)
    if env.rank == 0:
        print_report(report)
        if args.json is not None:
            write_report(args.json, report)
        print_verdict(report)
    return 0 if report["ok"] else 1
