"""Environment doctor: checks that every rank of a (possibly multi-node) launch sees a sane setup.

``python -m lit_ppl.doctor`` runs it (see :mod:`lit_ppl.doctor.cli`). The package is split by concern:
:mod:`~lit_ppl.doctor.env` resolves the launch environment, :mod:`~lit_ppl.doctor.facts` gathers what each
rank knows about itself, :mod:`~lit_ppl.doctor.checks` holds the consistency and live checks, and
:mod:`~lit_ppl.doctor.report` renders and writes the result.
"""

from lit_ppl.doctor.checks import (
    ALL_REDUCE_NUMEL,
    build_report,
    check_consistency,
    default_backend,
    gather_all,
    join_process_group,
    run_live_checks,
)
from lit_ppl.doctor.cli import main, parse_args
from lit_ppl.doctor.env import DistEnv, DistEnvError, resolve_dist_env, scontrol_hostnames, slurm_master_port
from lit_ppl.doctor.facts import PACKAGES, collect_rank_info
from lit_ppl.doctor.report import GIB, print_report, print_verdict, write_report

__all__ = [
    "ALL_REDUCE_NUMEL",
    "GIB",
    "PACKAGES",
    "DistEnv",
    "DistEnvError",
    "build_report",
    "check_consistency",
    "collect_rank_info",
    "default_backend",
    "gather_all",
    "join_process_group",
    "main",
    "parse_args",
    "print_report",
    "print_verdict",
    "resolve_dist_env",
    "run_live_checks",
    "scontrol_hostnames",
    "slurm_master_port",
    "write_report",
]
