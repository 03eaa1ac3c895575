"""The run's precision and device type, decoded once: what every later step reads instead of the config's strings.

Lightning names precisions several ways (``bf16`` is ``bf16-mixed``, ``32`` is ``32-true``); :class:`Precision`
holds its unified name and what follows from it for the weights. :func:`device_type` is where ``accelerator=auto``
runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A "*-true" precision loads the weights in the dtype it computes in (a 70B checkpoint must not pass through
# float32 first); mixed precisions keep float32 weights and autocast.
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


@dataclass(frozen=True)
class Precision:
    """One of Lightning's precisions, by its unified name (``bf16-true``, ``32-true``, ``bf16-mixed``, ...).

    Examples:
        >>> Precision.of("16").name, Precision.of(64).weights
        ('16-mixed', torch.float64)
    """

    name: str

    @classmethod
    def of(cls, given: str | int) -> Precision:
        from lightning.fabric.connector import _convert_precision_to_unified_args

        return cls(str(_convert_precision_to_unified_args(str(given))))

    @property
    def weights(self) -> torch.dtype:
        """The dtype the weights are loaded in."""
        return TRUE_DTYPES.get(self.name, torch.float32)

    @property
    def casts_weights(self) -> bool:
        """Whether the precision casts every weight to its dtype (``*-true`` other than 32)."""
        return self.name in TRUE_DTYPES

    @property
    def full(self) -> bool:
        """Whether the model computes in float32 or float64 throughout."""
        return self.name in ("32-true", "64-true")


def device_type(accelerator: str) -> str:
    """``cuda`` or ``cpu``: where a run with ``trainer.accelerator`` computes (``auto``: a GPU if one is visible)."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "cuda" if on_gpu else "cpu"
