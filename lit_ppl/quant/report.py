"""What quantization did: the report ``results.json`` keeps under ``quant`` and the log's one-line summaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lit_ppl.config.values import GROUP_SIZES


@dataclass
class QuantReport:
    """What quantization did; ``to_dict()`` goes into ``results.json`` under ``quant``."""

    name: str
    source: str
    backend: dict[str, str] = field(default_factory=dict)  # scheme label -> torchao config and tensor type
    modules: dict[str, dict[str, Any]] = field(default_factory=dict)
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    weight_bytes_packed: int = 0  # as the schemes store them packed (int4: two a byte), whatever the kernel's layout
    quantized_params: list[str] = field(default_factory=list)  # names in lm.named_parameters()
    full_precision_bytes: int = 0  # parameters left unquantized (norms, biases, skipped and excluded layers)
    converted: dict[str, str] = field(default_factory=dict)  # modules made nn.Linear first: name -> former class
    consistency: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None  # the quantized weights as one model, the same at any layout (lit_ppl.quant.consistency)
    calibration: dict[str, Any] | None = (
        None  # calibrated methods: the text, its tokens, the time (lit_ppl.quant.calibrated.text)
    )
    auto: dict[str, Any] | None = None  # quant=auto: budget, sensitivities, the choice (lit_ppl.quant.auto.search)

    @property
    def quantized_modules(self) -> int:
        return sum(m["config"] is not None for m in self.modules.values())

    @property
    def full_precision_fraction(self) -> float:
        """Share of the original parameter bytes that stayed in full precision."""
        return self.full_precision_bytes / self.weight_bytes_before if self.weight_bytes_before else 0.0

    @property
    def skipped(self) -> dict[str, str]:
        """Modules a rule asked to quantize that could not be, with the reason."""
        return {n: m["reason"] for n, m in self.modules.items() if m.get("requested") and m["config"] is None}

    @property
    def adapted(self) -> dict[str, dict[str, Any]]:
        """int4 layers that took a smaller group size than requested (``quant.group_fallback``), with both."""
        adapted = {n: m for n, m in self.modules.items() if "adapted" in m}
        return {n: {"requested": m["requested"], "config": m["config"]} for n, m in adapted.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "backend": self.backend,
            "weight_bytes_before": self.weight_bytes_before,
            "weight_bytes_after": self.weight_bytes_after,
            "weight_bytes_packed": self.weight_bytes_packed,
            "quantized_modules": self.quantized_modules,
            "full_precision_bytes": self.full_precision_bytes,
            "full_precision_fraction": self.full_precision_fraction,
            "skipped": self.skipped,
            "adapted": self.adapted,
            "converted": self.converted,
            "modules": self.modules,
            "consistency": self.consistency,
            "digest": self.digest,
            "calibration": self.calibration,
            **({"auto": self.auto} if self.auto is not None else {}),
        }


def summary_lines(report: QuantReport) -> list[str]:
    """One short line each for the adapted and the skipped layers: counts, the reasons, the fix; the full lists are
    in ``results.json`` (``quant.adapted``, ``quant.skipped``, per module ``quant.modules``)."""
    asked = sum(bool(m["config"] or m.get("requested")) for m in report.modules.values())
    lines = []
    for key, names in (("adapted", report.adapted), ("skipped", report.skipped)):
        if not names:
            continue
        entries = [report.modules[n] for n in names]
        reasons: dict[str, int] = {}
        for m in entries:
            why = m["adapted"] if key == "adapted" else m["reason"]
            reasons[why] = reasons.get(why, 0) + 1
        shown = "; ".join(f"{why} ({k})" if len(reasons) > 1 else why for why, k in list(reasons.items())[:3])
        shown += "; ..." if len(reasons) > 3 else ""
        widths = {m["in_features"] for m in entries if "in_features" in m}
        fits = [g for g in GROUP_SIZES if widths and all(w % g == 0 for w in widths)]
        if key == "adapted":
            used = sorted({m["config"] for m in entries})
            fix = f"they use {', '.join(used)}" + (f"; quant.group_size={max(fits)} divides all" if fits else "")
            what = f"{len(names)} of {asked} layers took a smaller int4 group"
        elif all(m["reason"].startswith("in_features") for m in entries):
            none = f"no int4 group size in {GROUP_SIZES} divides in_features {', '.join(map(str, sorted(widths)))}"
            fix = f"quant.group_size={max(fits)} divides all" if fits else f"{none}: a policy rule can give them int8"
        else:
            fix = "a quant=policy rule can give them another config (e.g. int8)"
        if key == "skipped":
            what = f"{len(names)} of {asked} layers stay in full precision"
        lines.append(f"quantization: {what}: {shown}; {fix} (list: results.json quant.{key})")
    return lines
