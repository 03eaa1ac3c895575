"""The run's quantizer: the one object the model's placement calls, built once from the typed ``quant`` config.

:func:`build` turns a ``quant`` node into a :class:`Quantizer`, or ``None`` when nothing is quantized: the choices'
rules are checked now, and a calibrated method's text is tokenized now, before any process group exists. The
placement (:func:`lit_ppl.model.placement.place`) hands the reader's whole checkpoint to :meth:`Quantizer.read`
and every rank's model to :meth:`Quantizer.quantize`. A checkpoint stored in torchao's INT8 under a split layout
has a quantizer of its own, :class:`lit_ppl.quant.stored_int8.StoredInt8`, which restores its codes on each
rank's slice instead of quantizing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from lit_ppl.config.quant import QuantConfig, quant_config
from lit_ppl.config.schema import DistributedConfig
from lit_ppl.config.values import calibrated_method
from lit_ppl.errors import LitPplError
from lit_ppl.quant.apply import quantize_model
from lit_ppl.quant.assign import assign, rules_from_cfg
from lit_ppl.quant.report import QuantReport


class Quantizer:
    """What a model's weights become once loaded. The base quantizes by a typed ``quant`` config; see
    :class:`lit_ppl.quant.stored_int8.StoredInt8` for a checkpoint's own INT8."""

    def __init__(self, config: QuantConfig, calibration: Any = None) -> None:
        self.config, self.calibration = config, calibration

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def calibrates(self) -> bool:
        """Whether it observes the model on calibration text before quantizing."""
        return self.calibration is not None

    @property
    def streams(self) -> bool:
        """Whether it can quantize each weight as it is read (:meth:`quantize`'s ``stream``): round to nearest,
        which needs no other layer; not calibration, which runs the whole model first, nor ``quant.source=rank0``,
        whose ranks receive rank 0's weights once all are quantized."""
        return not self.calibrates and self.config.name != "auto" and self.config.source != "rank0"

    def layers(self, lm: nn.Module, device: Any) -> set[str]:
        """The modules its rules quantize in ``lm`` (a tied pair by both names), known before any weight is read
        (``device``: where the weights will be)."""
        cfg = self.config
        todo, report, _ = assign(lm, rules_from_cfg(cfg), cfg.backend, cfg.group_fallback, device)
        return set(todo) | {n for n, entry in report.items() if entry.get("tied_to") in todo}

    def held_by_rows(self, lm: nn.Module, device: Any) -> list[str]:
        """The decoder ``nn.Linear`` layers its calibrated methods quantize (``quant=auto``: every one some scheme
        can take, measured as candidates): under FSDP their float weights are held by rows while it calibrates
        (:mod:`lit_ppl.parallel.float_rows`)."""
        from lit_ppl.quant.calibrated.stream import block_of

        if not self.calibrates:
            return []
        cfg, modules = self.config, dict(lm.named_modules())
        if cfg.name == "auto":
            from lit_ppl.quant.auto.candidates import kind_rules

            kinds = [k for k in cfg.schemes if k != "none"]
            rules = [kind_rules(lm, cfg, k) for k in kinds]
            todo = {n: True for r in rules for n in assign(lm, r, cfg.backend, cfg.group_fallback, device)[0]}
        else:
            todo = assign(lm, rules_from_cfg(cfg), cfg.backend, cfg.group_fallback, device)[0]
            todo = {n: c.method.calibrated for n, c in todo.items()}
        return sorted(n for n, held in todo.items() if held and block_of(n) and type(modules.get(n)) is nn.Linear)

    def read(self, full: dict[str, Any]) -> Any:
        """The reader's part (rank 0, on the whole checkpoint as read), handed to every rank's :meth:`quantize`."""
        return None

    def quantize(
        self,
        lm: nn.Module,
        tp: Any = None,
        splits: Any = None,
        read: Any = None,
        stream: Any = None,
        release: Any = None,
        device: Any = None,
        rows: Any = None,
    ) -> QuantReport:
        """Quantize ``lm`` in place (this rank's tensor-parallel slices under ``tp``); the report. ``stream``,
        ``release``, ``device`` and ``rows``: as :func:`lit_ppl.quant.apply.quantize_model` takes them (``stream``
        when :attr:`streams`, ``rows`` for :meth:`held_by_rows`)."""
        from lit_ppl.quant.calibrated.split import TpView

        view = TpView(tp, splits or {}) if tp is not None else None
        return quantize_model(lm, self.config, self.calibration, view, stream, release, device, rows)

    def __call__(self, lm: nn.Module) -> QuantReport:
        return self.quantize(lm)


def build(
    cfg: Any,
    tokenizer: Any = None,
    evaluated: Any = None,
    timeout_s: float = DistributedConfig.timeout_s,
    model: Any = None,
    split: bool = False,
) -> Quantizer | None:
    """The :class:`Quantizer` of a ``quant`` node, or ``None`` when nothing is quantized.

    The rules are parsed now, so a bad config fails before any model is loaded. A calibrated method needs the
    model's ``tokenizer``; its calibration text is checked against ``evaluated`` (the evaluated
    :class:`~lit_ppl.data.sources.DataSpec`) and tokenized now, before any process group exists (as the evaluated
    text is), so that no rank waits inside a collective while another tokenizes (``timeout_s``: how long it waits
    for another process that tokenizes it). ``model``: the :class:`~lit_ppl.model.spec.ModelSpec`, whose checkpoint
    may hold quantized weights of its own: transformers restores them in one process, :mod:`lit_ppl.quant.stored_int8`
    under a ``split`` layout.
    """
    cfg = quant_config(cfg)
    if model is not None:
        from lit_ppl.quant.stored_int8 import StoredInt8

        if StoredInt8.holds(model, cfg):
            return StoredInt8(model) if split else None
    if cfg.name == "none":
        return None
    if cfg.name != "auto":
        rules_from_cfg(cfg)  # a bad rule fails now
    method = calibrated_method(dataclasses.asdict(cfg)) or ("auto" if cfg.name == "auto" else None)
    if method is None:
        return Quantizer(cfg)
    from lit_ppl.quant.calibrated.text import Calibration, CalibrationSpec, prepare_calibration

    spec = CalibrationSpec.from_cfg(cfg.calibration, method)
    if tokenizer is None:
        raise LitPplError(f"quant.method={method} needs the model's tokenizer to read quant.calibration.path")
    store = prepare_calibration(spec, tokenizer, evaluated, timeout_s)
    return Quantizer(cfg, Calibration(spec, store))


def check_layout(cfg: QuantConfig, layout: Any) -> None:
    """What quantization cannot do when the layout splits the model (:mod:`lit_ppl.parallel.layout`), refused at
    once. Calibrated methods run under every layout (:mod:`lit_ppl.quant.calibrated.stream`: batches over the
    data-parallel ranks, split layers observed and solved whole; ``quant=auto`` measures with a tensor-parallel
    group run as one process: :func:`lit_ppl.quant.calibrated.split.as_one_process`)."""
    if cfg.name == "none" or not layout.sharded:
        return
    if cfg.source == "rank0":
        raise LitPplError(
            f"quant.source=rank0 with strategy layout {layout.kind}: ranks hold different slices, so rank 0's "
            "cannot be broadcast; use quant.source=local"
        )
