"""Where this process sits in the job: rank, world size and rendezvous, from torchrun, Slurm or nothing."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from lit_ppl.errors import UserError


class DistEnvError(UserError, ValueError):
    """Raised when the launcher's environment variables are incomplete or contradictory."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as told by the launcher.

    Attributes:
        rank: Global rank, ``0 <= rank < world_size``.
        world_size: Total number of processes.
        local_rank: Rank among the processes on this node.
        node_rank: Index of this node.
        master_addr: Rendezvous host, or ``None`` for a lone process (no rendezvous needed).
        master_port: Rendezvous port, or ``None`` for a lone process.
        launcher: ``"torchrun"``, ``"slurm"`` or ``"single"``.
    """

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str


def _require_int(environ: Mapping[str, str], name: str, context: str) -> int:
    """Reads an integer variable, failing with a message that names it.

    Args:
        environ: The environment to read.
        name: Variable name.
        context: What kind of launch needed it, for the error message.

    Returns:
        The parsed value.

    Raises:
        DistEnvError: If the variable is missing or not an integer.
    """
    if name not in environ:
        raise DistEnvError(f"{context} launch detected but {name} is not set")
    try:
        return int(environ[name])
    except ValueError:
        raise DistEnvError(f"{name}={environ[name]!r} is not an integer") from None


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    """Reads an integer variable that may be absent.

    Args:
        environ: The environment to read.
        name: Variable name.

    Returns:
        The parsed value, or ``None`` if the variable is not set.

    Raises:
        DistEnvError: If the variable is set but not an integer.
    """
    if name not in environ:
        return None
    return _require_int(environ, name, "any")


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Expands a compressed Slurm nodelist (``node[01-03]``) the way Slurm itself does.

    Args:
        nodelist: Value of ``SLURM_JOB_NODELIST``.

    Returns:
        The host names, in Slurm's order.

    Raises:
        DistEnvError: If ``scontrol`` is unavailable or fails.
    """
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise DistEnvError(
            f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with `scontrol show hostnames` ({err}); "
            "set MASTER_ADDR explicitly"
        ) from err
    return out.split()


@contextmanager
def _process_environ(environ: Mapping[str, str]) -> Iterator[None]:
    """Makes ``os.environ`` exactly ``environ`` inside the block and restores it afterwards.

    Lightning's cluster environments read only the process environment, and ``main_port`` also writes
    ``MASTER_PORT`` into it; the doctor must answer for the environment it was given and leave no trace.
    """
    wanted, saved = dict(environ), dict(os.environ)  # copy first: ``environ`` may be ``os.environ`` itself
    os.environ.clear()
    os.environ.update(wanted)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def slurm_master_port(environ: Mapping[str, str]) -> int:
    """The rendezvous port Lightning's ``SLURMEnvironment`` picks for this job.

    Lightning's rule (``MASTER_PORT`` if set, else one derived from ``SLURM_JOB_ID``) is asked for rather than
    restated, so the doctor checks the port the real run will use; the sbatch templates in ``slurm/`` follow it.

    Args:
        environ: A Slurm task's environment.

    Returns:
        The port.

    Raises:
        DistEnvError: If Lightning cannot derive a port from ``SLURM_JOB_ID`` or rejects the launch outright (as
            it would the real run, e.g. ``--ntasks`` without ``--ntasks-per-node``).
    """
    # Imported here: lightning takes seconds to import and only a Slurm launch needs it.
    from lightning.fabric.plugins.environments import SLURMEnvironment

    with _process_environ(environ):
        try:
            return SLURMEnvironment(auto_requeue=False).main_port
        except ValueError as err:
            job_id = environ.get("SLURM_JOB_ID")
            raise DistEnvError(f"Lightning cannot derive MASTER_PORT from SLURM_JOB_ID={job_id!r}: {err}") from err
        except RuntimeError as err:
            raise DistEnvError(f"Lightning's SLURMEnvironment rejects this launch: {err}") from err


def _torchrun(environ: Mapping[str, str]) -> DistEnv:
    """A torchrun-style launch: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address."""
    context = "torchrun-style"
    rank = _require_int(environ, "RANK", context)
    world_size = _require_int(environ, "WORLD_SIZE", context)
    local_rank = _require_int(environ, "LOCAL_RANK", context)
    if "MASTER_ADDR" not in environ:
        raise DistEnvError(f"{context} launch detected but MASTER_ADDR is not set")
    master_port = _require_int(environ, "MASTER_PORT", context)
    # torchrun exports GROUP_RANK; other launchers use NODE_RANK or only LOCAL_WORLD_SIZE.
    node_rank = _optional_int(environ, "GROUP_RANK")
    if node_rank is None:
        node_rank = _optional_int(environ, "NODE_RANK")
    if node_rank is None:
        local_world_size = _optional_int(environ, "LOCAL_WORLD_SIZE")
        node_rank = rank // local_world_size if local_world_size else 0
    return DistEnv(rank, world_size, local_rank, node_rank, environ["MASTER_ADDR"], master_port, "torchrun")


def _slurm(environ: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> DistEnv:
    """A Slurm launch: ``SLURM_PROCID`` and its peers; the address from ``MASTER_ADDR`` or the node list."""
    context = "Slurm"
    rank = _require_int(environ, "SLURM_PROCID", context)
    world_size = _require_int(environ, "SLURM_NTASKS", context)
    local_rank = _require_int(environ, "SLURM_LOCALID", context)
    node_rank = _require_int(environ, "SLURM_NODEID", context)
    if "MASTER_ADDR" in environ:
        master_addr = environ["MASTER_ADDR"]
    else:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise DistEnvError("Slurm launch without MASTER_ADDR needs SLURM_JOB_NODELIST, which is not set")
        hosts = hostnames(nodelist)
        if not hosts:
            raise DistEnvError(f"SLURM_JOB_NODELIST={nodelist!r} expands to no hosts")
        master_addr = hosts[0]
    if "MASTER_PORT" in environ:
        _require_int(environ, "MASTER_PORT", context)  # Lightning's own parse would not name the variable
    elif "SLURM_JOB_ID" not in environ:
        # Lightning would fall back to one fixed port, which every job sharing a node would then fight over.
        raise DistEnvError("Slurm launch without MASTER_PORT needs SLURM_JOB_ID, which is not set")
    return DistEnv(rank, world_size, local_rank, node_rank, master_addr, slurm_master_port(environ), "slurm")


def resolve_dist_env(
    environ: Mapping[str, str],
    hostnames: Callable[[str], list[str]] = scontrol_hostnames,
) -> DistEnv:
    """Works out rank, world size and rendezvous address from torchrun, Slurm or nothing.

    torchrun variables win over Slurm ones, because ``srun torchrun ...`` sets both and torchrun's
    describe the actual worker processes.

    Args:
        environ: The environment, usually ``os.environ``.
        hostnames: Expands a Slurm nodelist; only called under Slurm without ``MASTER_ADDR``.

    Returns:
        The resolved placement of this process.

    Raises:
        DistEnvError: If variables are missing, malformed or contradictory; the message names the
            offending variable.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        env, rank_name, world_name = _torchrun(environ), "RANK", "WORLD_SIZE"
    elif "SLURM_PROCID" in environ:
        env, rank_name, world_name = _slurm(environ, hostnames), "SLURM_PROCID", "SLURM_NTASKS"
    else:
        return DistEnv(0, 1, 0, 0, None, None, "single")
    if env.world_size < 1:
        raise DistEnvError(f"{world_name}={env.world_size} must be at least 1")
    if not 0 <= env.rank < env.world_size:
        raise DistEnvError(f"{rank_name}={env.rank} is outside [0, {world_name}={env.world_size})")
    if env.local_rank < 0 or env.node_rank < 0:
        raise DistEnvError(f"local rank {env.local_rank} and node rank {env.node_rank} must be non-negative")
    return env
