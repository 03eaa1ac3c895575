"""Preemption-safe evaluation: progress saved atomically, resumed bit-identically.

Every ``save_every`` steps each rank writes its metric states and counters to
``output_dir/progress/rank{R}-step{S}.pt`` (temp file, then rename; the last two kept). Every ``check_every``
steps all ranks agree, with one tiny all-reduce, whether any of them got SIGUSR1 or SIGTERM (Slurm's
pre-timeout signal reaches every task; a plain ``kill`` reaches one): if so, all save at that same step and
stop with :class:`Preempted`. Under Slurm the entry point then requeues the job.

A rerun with the same ``output_dir`` restores the newest step that *every* rank saved (FSDP ranks must run
the same steps) and skips the batches done. The float64 states are restored exactly and the remaining
batches are the same batches, so the result is bit-identical to an uninterrupted run. Progress of another
configuration, world size or dataset is refused with a message, never mixed in.

The batches are the same only under the same *batch plan*: the windows per batch and the ranks' weights, saved
with the progress. The rank weights are restored (a measured balance is not measured again). Under
``batch_size=auto`` the probe only checks that the saved size still fits (its ``max_batch`` is capped at it), so
that a requeue onto a node with more memory continues exactly; one where the saved size no longer fits (or a run
given another number) is refused with one line before it scores a batch.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lit_ppl.data.batch_plan import BatchPlan
from lit_ppl.errors import LitPplError, Preempted, first_line
from lit_ppl.parallel.ranks import control_group, peers_alive
from lit_ppl.runtime.files import atomic_path
from lit_ppl.runtime.signals import install_signal_handlers, signalled

_FILE = re.compile(r"rank(\d+)-step(\d+)\.pt$")
PROGRESS_KEYS = {"fingerprint", "world_size", "step", "plan"}  # what every progress file lit-ppl writes holds


def fingerprint(config: dict[str, Any], windows_digest: str) -> str:
    """What must match for progress to be resumable: the configuration and the exact windows."""
    blob = json.dumps({"config": config, "windows": windows_digest}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class ResumeCallback(Callback):
    """Saves and restores the evaluation's progress (see the module docstring).

    Args:
        directory: where progress files go (``output_dir/progress``).
        config: the run's resolved configuration minus what may change between attempts (paths, timeouts).
        plan: the run's batch plan, which the progress files save and a resume restores.
        save_every: steps between periodic saves (0: save only on a signal).
        check_every: steps between the cross-rank checks for a stop signal.
    """

    def __init__(
        self,
        directory: str | Path,
        config: dict[str, Any],
        plan: BatchPlan,
        save_every: int = 200,
        check_every: int = 10,
    ) -> None:
        self.dir = Path(directory)
        self.config, self.save_every, self.check_every = config, save_every, max(1, check_every)
        self.plan = plan
        self.start_step = 0
        self._restored: dict[str, Any] | None = None
        self._own: dict[int, Path] = {}  # step -> lit-ppl's progress file of this rank
        self._foreign: set[int] = set()  # steps whose file is not lit-ppl's progress: never replaced nor deleted

    # -- files ---------------------------------------------------------------------------------------------
    def _files(self, rank: int) -> dict[int, Path]:
        out = {}
        for path in self.dir.glob(f"rank{rank}-step*.pt"):
            m = _FILE.search(path.name)
            if m:
                out[int(m.group(2))] = path
        return out

    def _save(self, trainer: L.Trainer, module: L.LightningModule, step: int) -> None:
        rank = trainer.global_rank
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {
            "fingerprint": self.fp,
            "world_size": trainer.world_size,
            "step": step,
            "plan": self.plan.saved(),
            **module.progress_state(),
        }
        path = self.dir / f"rank{rank}-step{step}.pt"
        if step in self._foreign:
            print(f"lit-ppl: progress not saved at step {step}: {path} is not lit-ppl's to replace", file=sys.stderr)
            return
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
        self._own[step] = path
        for old in sorted(self._own)[:-2]:
            self._own.pop(old).unlink(missing_ok=True)

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        """A progress file's state, or ``None`` (said in one line) for one that cannot be read — truncated, or
        holding objects ``weights_only`` refuses — or that is not lit-ppl's. The older file kept beside it is used
        instead; the file itself is left in place, since nothing proves lit-ppl wrote it."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError... for a bad file
            print(
                f"lit-ppl: ignoring progress file {path}: it cannot be read ({first_line(err)}); left in place",
                file=sys.stderr,
            )
            return None
        if not isinstance(state, dict) or not state.keys() >= PROGRESS_KEYS:
            print(f"lit-ppl: ignoring {path}: it holds no lit-ppl progress; left in place", file=sys.stderr)
            return None
        return state

    # -- hooks ---------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule  # set up already: Lightning runs the datamodule's setup before the callbacks'
        # The token store's key names the files (path, size, mtime) and the tokenizer, wherever the cache is.
        data = f"{dm.store.name if dm.store is not None else ''}:{dm.windows_digest()}"
        self.fp = fingerprint({**self.config, "world_size": trainer.world_size}, data)
        mine, states = {}, {}
        for step, path in self._files(trainer.global_rank).items():
            state = self._read(path)
            if state is not None:
                mine[step], states[step] = path, state
            else:
                self._foreign.add(step)
        self._own = dict(mine)  # lit-ppl's progress (this run's or another's): what it may replace and delete
        group = control_group()
        everyone = [None] * trainer.world_size
        if group is not None:
            with peers_alive("the resume check"):
                dist.all_gather_object(everyone, sorted(mine), group=group)
        else:
            everyone = [sorted(mine)]
        common = set(everyone[0]).intersection(*everyone[1:]) if everyone else set()
        if not common:
            return
        step = max(common)
        state = states[step]
        if state["fingerprint"] != self.fp or state["world_size"] != trainer.world_size:
            raise LitPplError(
                f"{self.dir} holds progress of a different run (configuration, data or world size "
                f"{state['world_size']} differ); use another output_dir or delete {self.dir} to start over"
            )
        self.plan.restore(state["plan"], step, self.dir)
        self.start_step, self._restored = step, state
        if trainer.is_global_zero:
            print(f"lit-ppl: resuming from step {step} (progress in {self.dir})", file=sys.stderr)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The first hook after val_dataloader resolved the plan, and before any step.
        if self._restored is not None:
            self.plan.check(self._restored["plan"], self.plan.saved(), self.dir)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._restored is not None:
            pl_module.load_progress_state(self._restored)
        # Lightning's own signal connector (SIGTERM; SIGUSR1 under Slurm) was set up after ours: take over.
        install_signal_handlers()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        step = self.start_step + batch_idx + 1
        if step % self.check_every == 0 and self._any_rank_stopping(pl_module):
            self._save(trainer, pl_module, step)
            if (group := control_group()) is not None:
                with peers_alive("the preemption save"):
                    dist.barrier(group=group)  # every rank's file is on disk before anyone exits
            raise Preempted(f"stopped by a signal at step {step}; progress saved in {self.dir}")
        if self.save_every and step % self.save_every == 0:
            self._save(trainer, pl_module, step)

    def _any_rank_stopping(self, pl_module: L.LightningModule) -> bool:
        flag = torch.tensor([float(signalled())])  # on the CPU: this all-reduce never syncs a GPU
        if (group := control_group()) is not None:
            with peers_alive("the stop-signal check"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The run is complete and its results are in memory: progress files would only mislead a rerun.
        for path in self._own.values():
            path.unlink(missing_ok=True)
