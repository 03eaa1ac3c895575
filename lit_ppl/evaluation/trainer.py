"""The Lightning ``Trainer`` of one evaluation: the layout's strategy, the precision's arguments, the callbacks."""

from __future__ import annotations

from typing import Any

import lightning as L

from lit_ppl.evaluation.module import PerplexityModule
from lit_ppl.parallel import strategies
from lit_ppl.parallel.layout import Layout


def build_trainer(
    trainer_args: dict[str, Any],
    layout: Layout,
    precision: str,
    timeout_s: float,
    module: PerplexityModule,
    callbacks: list[L.Callback],
    logger: Any,
) -> L.Trainer:
    """``L.Trainer(**trainer_args)`` with what lit-ppl owns set for ``layout`` and ``precision``."""
    args = strategies.precision_args(layout, precision, str(trainer_args["accelerator"]))
    # lit-ppl saves its own progress and requeues itself under Slurm, instead of Lightning's SIGUSR1 handler.
    plugins = [*args.pop("plugins", []), *strategies.cluster_plugins()]
    return L.Trainer(
        **trainer_args,
        strategy=strategies.strategy_for(layout, timeout_s),
        **args,
        plugins=plugins or None,
        logger=logger,
        callbacks=callbacks,
        use_distributed_sampler=False,  # ours is exact: Lightning's repeats samples to even out ranks
        # Same numbers either way; inference_mode is faster, but torchao's tensors and the split layouts' DTensors
        # need no_grad (benchmarks/README.md, "inference_mode").
        inference_mode=not layout.sharded and not module.holds_quantized_weights(),
        enable_checkpointing=False,
        enable_model_summary=False,
    )
