"""In-process runs of the Hydra config: compose the overrides as ``python -m lit_ppl.validate`` would, evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def evaluate_overrides(overrides: list[str], output_dir: Path) -> dict[str, Any]:
    """``results.json``'s content of one run in this process (the single-process reference of a multi-rank test)."""
    from hydra import compose, initialize_config_dir

    from lit_ppl.run import evaluate
    from lit_ppl.validate import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose("validate", overrides=[*overrides, f"output_dir={output_dir}"])
    return evaluate(cfg)
