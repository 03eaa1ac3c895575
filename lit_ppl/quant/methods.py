"""The quantization methods, one entry each: the table every other module reads instead of a method's name.

A :class:`Method` says which schemes and targets it can take (:meth:`Method.problem`), the torchao config a layer
ends up as (:meth:`Method.config`), and, for a calibrated method, the statistics it takes from the float model
(:meth:`Method.observe`, reduced over the ranks) and how it turns them into quantized layers
(:meth:`Method.quantize`) or into one layer's candidate for ``quant=auto`` (:meth:`Method.candidate`). Adding a
method is one entry in :data:`METHODS`, its name among the allowed values (``lit_ppl.config.values.QUANT_METHODS``)
and, if it calibrates, its statistics under :mod:`lit_ppl.quant.calibrated`.

A plan's entry for one layer is a :class:`Choice`: the scheme (its int4 group size fitted), the int4 kernel and
the method.
"""

from __future__ import annotations

import abc
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lit_ppl.quant.schemes import Scheme, gptq_base_config, torchao_config

if TYPE_CHECKING:
    from lit_ppl.config.quant import QuantConfig
    from lit_ppl.quant.calibrated.stream import Where
    from lit_ppl.quant.calibrated.text import Calibration
    from lit_ppl.quant.targets import Target

# One layer's statistics (its float64 sums, reduced over the ranks), by layer name.
Statistics = dict[str, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Choice:
    """What one layer gets: ``scheme`` (group size fitted), the int4 ``kernel`` (``None`` for other schemes) and the
    ``method`` that chooses its quantized values."""

    scheme: Scheme
    kernel: str | None
    method: Method

    @property
    def label(self) -> str:
        """The scheme with its kernel, as the report's ``backend`` names it."""
        return f"{self.scheme.label} ({self.kernel})" if self.kernel else self.scheme.label

    def config(self) -> tuple[Any, str]:
        """The torchao config the layer ends up as, and its description."""
        return self.method.config(self.scheme, self.kernel)


@dataclass(frozen=True)
class Method:
    """Round-to-nearest: torchao's own rounding of every scheme, on any target (the base of the other methods)."""

    name: str
    calibrated: bool = False
    preset: bool = False  # its own conf/quant/NAME.yaml, which --quant.method NAME selects in the Lightning CLI
    options: str | None = None  # the quant node holding its options (results.json's calibration lists them)
    costly: bool = False  # a layer's candidate takes seconds: quant=auto builds each once and keeps it

    def problem(self, scheme: Scheme, kernel: str | None, target: Target, tied: bool, rule: str) -> str | None:
        """Why this method cannot give ``scheme`` to ``target`` here (``None`` if it can): torchao's own limits.
        ``rule``: which rule asked for it, for the message."""
        return None

    def config(self, scheme: Scheme, kernel: str | None) -> tuple[Any, str]:
        """The torchao config a layer quantized by this method holds, and its description."""
        return torchao_config(scheme, kernel)

    def backend_key(self, choice: Choice) -> str:
        """The report's ``backend`` key for layers of ``choice``."""
        return choice.label

    def describe(self, choice: Choice) -> str:
        """The report's ``backend`` value for layers of ``choice``."""
        return choice.config()[1]

    def candidate(
        self, weight: torch.Tensor, choice: Choice, stats: dict[str, torch.Tensor] | None, cfg: QuantConfig
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(quantized weight, input pre-scale or None)`` of one layer under ``choice`` (``quant=auto``)."""
        from lit_ppl.quant.calibrated.awq import quantize_weight

        return quantize_weight(weight, choice.config()[0]), None

    def info(self, cfg: QuantConfig) -> dict[str, Any]:
        """What ``results.json``'s ``quant.calibration`` records of this method's options."""
        return {}


class _Calibrated(Method, abc.ABC):
    """A method that observes the float model's inputs of the layers it quantizes (the others are applied by
    torchao's ``quantize_`` with :meth:`Method.config`)."""

    @abc.abstractmethod
    def observe(
        self, lm: nn.Module, layers: dict[str, Choice], calibration: Calibration, at: Where, cfg: QuantConfig
    ) -> Statistics | None:
        """Statistics of ``layers`` on the float model, reduced over the data-parallel ranks of ``at`` (whole layers
        under its tensor parallelism; ``None``: the method takes them while it quantizes)."""

    @abc.abstractmethod
    def quantize(
        self,
        lm: nn.Module,
        layers: dict[str, Choice],
        stats: Statistics | None,
        calibration: Calibration,
        at: Where,
        cfg: QuantConfig,
    ) -> dict[str, dict[str, Any]]:
        """Replace ``layers``' weights by their quantization from ``stats``; per layer, the facts for the report."""

    def backend_key(self, choice: Choice) -> str:
        return f"{self.name} {choice.label}"

    def problem(self, scheme: Scheme, kernel: str | None, target: Target, tied: bool, rule: str) -> str | None:
        where = f"quant.method={self.name} ({rule})"
        if target.kind != "linear" or tied:
            what = "a tied head/embedding table" if tied else f"an {target.kind} weight"  # embedding or experts
            return f"{where} calibrates on a linear layer's inputs; {what} has none: give it method={RTN.name}"
        if scheme.kind == "int8dq":
            return (
                f"{where} is weight-only in torchao; int8dq also quantizes activations: use config int8, or "
                f"method={RTN.name}"
            )
        return None


class _Hqq(Method):
    """HQQ: torchao's half-quadratic choice of the int4 group scales instead of round-to-nearest's; no calibration."""

    def problem(self, scheme: Scheme, kernel: str | None, target: Target, tied: bool, rule: str) -> str | None:
        # Calibration-free: any int4 target, on every backend (torchao's HQQ grids).
        if scheme.kind != "int4":
            return f"quant.method={self.name} ({rule}) chooses int4 group scales: use config int4, or {RTN.name}"
        return None

    def config(self, scheme: Scheme, kernel: str | None) -> tuple[Any, str]:
        return torchao_config(scheme, kernel, int4_qparams=self.name)

    def backend_key(self, choice: Choice) -> str:
        return f"{self.name} {choice.label}"


class _Awq(_Calibrated):
    """AWQ: a per-input-channel scale chosen from the activations, then round-to-nearest (:mod:`...calibrated.awq`)."""

    def describe(self, choice: Choice) -> str:
        return f"AWQ scales (lit_ppl.quant.calibrated.awq) over {torchao_config(choice.scheme, choice.kernel)[1]}"

    def observe(self, lm, layers, calibration, at, cfg):
        from lit_ppl.quant.calibrated.awq import awq_statistics

        return awq_statistics(lm, {n: c.config()[0] for n, c in layers.items()}, calibration, at.rank, at.size, at.tp)

    def quantize(self, lm, layers, stats, calibration, at, cfg):
        from lit_ppl.quant.calibrated.awq import apply_awq

        configs = {n: c.config()[0] for n, c in layers.items()}
        return apply_awq(lm, configs, stats, calibration.spec.config.grid, at.tp)

    def candidate(self, weight, choice, stats, cfg):
        from lit_ppl.quant.calibrated.awq import best_scale, quantize_weight

        s = best_scale(stats)[1]
        return quantize_weight(weight * s, choice.config()[0]), 1.0 / s


class _Gptq(_Calibrated):
    """GPTQ: each layer's rounding errors fed forward through its inputs' Hessian (:mod:`...calibrated.gptq`)."""

    def problem(self, scheme: Scheme, kernel: str | None, target: Target, tied: bool, rule: str) -> str | None:
        refused = super().problem(scheme, kernel, target, tied, rule)
        if refused or scheme.kind != "int4":
            return refused
        where = f"quant.method={self.name} ({rule})"
        if kernel == "prototype":
            return (
                f"{where} sets the codes of IntxWeightOnlyConfig's int4 tensor; the CPU bf16 prototype packing has "
                "none to set: use quant.backend=intx, or precision=32-true"
            )
        if kernel == "tinygemm" and importlib.util.find_spec("mslk") is None:
            return (
                f"{where} on tinygemm int4 is torchao's CUDA GPTQ, which needs the mslk package: install it, or use "
                "quant.backend=intx (lit-ppl's GPTQ on torch ops)"
            )
        return None

    def config(self, scheme: Scheme, kernel: str | None) -> tuple[Any, str]:
        # tinygemm's int4 layouts: torchao's own CUDA GPTQ builds its tensor (lit-ppl's solver does not set its codes)
        return gptq_base_config(scheme) if kernel == "tinygemm" else torchao_config(scheme, kernel)

    def describe(self, choice: Choice) -> str:
        if choice.kernel == "tinygemm":
            return f"{gptq_base_config(choice.scheme)[1]}, Hessians reduced by lit_ppl.quant.calibrated.gptq"
        return f"GPTQ on torch ops (lit_ppl.quant.calibrated.gptq_solver) to {choice.config()[1]}"

    def observe(self, lm, layers, calibration, at, cfg):
        if cfg.gptq.sequential:  # each block's statistics come after the blocks before it are quantized
            return None
        from lit_ppl.quant.calibrated.gptq import gptq_hessians

        return gptq_hessians(lm, sorted(layers), calibration, at.rank, at.size, at.tp)

    def quantize(self, lm, layers, stats, calibration, at, cfg):
        from lit_ppl.quant.calibrated.gptq import run_gptq

        configs = {n: (c.config()[0], c.kernel == "tinygemm") for n, c in layers.items()}
        return run_gptq(lm, configs, calibration, at.rank, at.size, cfg.gptq, stats, at.tp)

    def candidate(self, weight, choice, stats, cfg):
        from lit_ppl.quant.calibrated.gptq import layer_gptq

        return layer_gptq(stats, weight, choice.config()[0], choice.kernel == "tinygemm", cfg.gptq)[0], None

    def info(self, cfg: QuantConfig) -> dict[str, Any]:
        import dataclasses

        return {self.options: dataclasses.asdict(cfg.gptq)}


RTN = Method("rtn")
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        RTN,
        _Awq("awq", calibrated=True, preset=True),
        _Gptq("gptq", calibrated=True, preset=True, options="gptq", costly=True),
        _Hqq("hqq"),
    )
}


def method(name: str, where: str = "rule") -> Method:
    """The table's entry ``name``; an unknown name is one line naming ``where`` it was given."""
    from lit_ppl.errors import LitPplError

    if name not in METHODS:
        raise LitPplError(f"quant.method={name!r} ({where}) is not one of {', '.join(METHODS)}")
    return METHODS[name]
