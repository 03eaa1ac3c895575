"""Experiment loggers: Lightning's own classes from the ``logger`` config group, and what lit-ppl logs to them.

Each run logs the resolved config as hyperparameters, rank 0's scored tokens per second every
``trainer.log_every_n_steps`` steps (Lightning's knob, default 50) as ``progress/tokens_per_s``, and at the end the
scalar statistics of ``results.json`` under the same names (``compare/...`` for a comparison)::

    python -m lit_ppl.validate logger=tensorboard      # ${output_dir}/tensorboard/events.out.tfevents.*
    python -m lit_ppl.validate logger=csv              # ${output_dir}/csv/metrics.csv, hparams.yaml
    python -m lit_ppl.validate logger=mlflow           # ${output_dir}/mlruns (file store, offline)
    python -m lit_ppl.validate logger=wandb            # ${output_dir}/wandb (offline; `wandb sync` uploads it)
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import lightning as L
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger

from lit_ppl.config.guard import construct
from lit_ppl.errors import UserError

# Logger class -> (any of these importable modules, the lit-ppl extra that installs one of them).
# Checked before instantiating: Lightning's own errors for a missing package name Lightning's extras, not ours.
REQUIRES: dict[str, tuple[tuple[str, ...], str]] = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
    "MLFlowLogger": (("mlflow",), "mlflow"),
    "WandbLogger": (("wandb",), "wandb"),
}


class MissingPackageError(UserError, ImportError):
    """A logger was chosen whose package is not installed."""


def missing_package_message(option: str, packages: tuple[str, ...], extra: str) -> str:
    """The one line for ``logger=OPTION`` when none of ``packages`` can be imported."""
    return f"logger={option} needs the {packages[0]} package, which is not installed: pip install 'lit-ppl[{extra}]'"


def build(node: dict[str, Any] | None, config: dict[str, Any]) -> Logger | bool:
    """The logger of the ``logger`` node (its ``_target_`` allowed by :mod:`lit_ppl.config.guard`) for
    ``L.Trainer(logger=...)``, or ``False`` for ``logger=none``; ``config`` is the run's, logged at once."""
    target = None if node is None else node.get("_target_")
    if target is None:
        return False
    packages, extra = REQUIRES.get(str(target).rsplit(".", 1)[-1], ((), ""))
    if packages and not any(importlib.util.find_spec(p) is not None for p in packages):
        option = _chosen_option() or extra
        raise MissingPackageError(missing_package_message(option, packages, extra))
    logger = construct(node)
    # The config now, before the Trainer's first save (which writes TensorBoard's hparams.yaml once) and before
    # any model loads: a run that fails still says what it was. The loggers log on rank 0 only.
    logger.log_hyperparams(config)
    return logger


def _chosen_option() -> str | None:
    """The option name the user typed (``logger=mlflow``), when Hydra knows it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("logger")


def final_scalars(results: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``results.json`` worth a chart: top-level scalars, the 95% interval, comparison statistics."""
    out = {k: float(v) for k, v in results.items() if _is_number(v) and k != "schema_version"}
    if isinstance(results.get("ppl_ci95"), list) and len(results["ppl_ci95"]) == 2:
        out["ppl_ci95_low"], out["ppl_ci95_high"] = (float(x) for x in results["ppl_ci95"])
    for k, v in (results.get("compare") or {}).items():
        if _is_number(v):
            out[f"compare/{k}"] = float(v)
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def log_final(trainer: L.Trainer, config: dict[str, Any], results: dict[str, Any], step: int) -> None:
    """Rank 0: log the final statistics to every logger of ``trainer``, then close each run.

    ``config`` (already logged by :func:`build`) goes again to TensorBoard, whose HParams summary needs the metrics.
    """
    if not trainer.is_global_zero:
        return
    scalars = final_scalars(results)
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            # Given the metrics, TensorBoard also writes its HParams summary (the config beside the scores);
            # without them it would only save hparams.yaml.
            logger.log_hyperparams(config, metrics=scalars, step=step)
        else:
            logger.log_metrics(scalars, step=step)
        logger.finalize("success")
        if isinstance(logger, WandbLogger):
            # wandb keeps one global run per process: without finish() the next job of a -m sweep would log into it.
            logger.experiment.finish()


class TokensPerSecondLogger(L.Callback):
    """Logs rank 0's scored tokens per second every ``trainer.log_every_n_steps`` steps.

    The count is the module's host-side ``tokens_seen`` (from batch shapes), so the step loop gains no device sync.
    The clock and count start at the epoch start, after a resumed run's progress is restored (so place this
    callback after ``ResumeCallback``): a resumed run's earlier tokens do not inflate the rate.
    """

    def __init__(self) -> None:
        self._start = (0.0, 0)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = (time.perf_counter(), pl_module.tokens_seen)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        step = pl_module.steps
        if step % max(int(trainer.log_every_n_steps), 1) != 0:
            return
        now, tokens = time.perf_counter(), pl_module.tokens_seen
        t0, tokens0 = self._start
        rate = (tokens - tokens0) / max(now - t0, 1e-9)
        for logger in trainer.loggers:
            logger.log_metrics({"progress/tokens_per_s": rate, "progress/tokens": float(tokens)}, step=step)
