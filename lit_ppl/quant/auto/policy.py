"""``quant=auto``'s choice as a ``quant=policy`` node, and the file that lets a later run apply it again."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from lit_ppl.config.quant import QuantConfig
from lit_ppl.quant.methods import METHODS
from lit_ppl.quant.schemes import Scheme

POLICY_FILE = "quant_policy.yaml"  # next to results.json


def policy_node(cfg: QuantConfig, chosen: dict[str, tuple[Scheme, str]]) -> dict[str, Any]:
    """The chosen assignment as a ``quant=policy`` node: one rule per quantized layer (full precision: no rule),
    with the calibration text and the options of the calibrated methods it uses."""
    rules = []
    for name, (scheme, method) in chosen.items():
        rule: dict[str, Any] = {"match": f"^{re.escape(name)}$", "config": scheme.kind}
        if scheme.kind == "int4":
            rule["group_size"] = scheme.group_size
        rule["method"] = method
        rules.append(rule)
    node: dict[str, Any] = {k: getattr(cfg, k) for k in ("method", "group_size", "backend", "source")}
    used = [METHODS[m] for m in dict.fromkeys(r["method"] for r in rules)]
    if any(m.calibrated for m in used):
        node["calibration"] = dataclasses.asdict(cfg.calibration)
    for options in [m.options for m in used if m.options]:
        node[options] = dataclasses.asdict(getattr(cfg, options))
    return {"name": "policy", **node, "group_fallback": False, "rules": rules}


def write_policy(path: Path, auto: dict[str, Any]) -> Path:
    """The chosen policy as a ``quant`` config file: with it at ``DIR/quant/NAME.yaml``,
    ``hydra.searchpath=[file://DIR] quant=NAME`` evaluates the same quantization without measuring again."""
    import yaml

    from lit_ppl.runtime.files import write_text_atomic

    ((metric, value),) = auto["budget"].items()
    predicted = "" if auto["predicted"] is None else f" (predicted {auto['predicted']:.4g})"
    header = (
        f"# quant=auto: {metric} budget {value:g}; measured {auto['measured_calibration']:.4g} on "
        f"{auto['calibration_tokens']} calibration tokens{predicted};\n"
        f"# {auto['bytes']} weight bytes of {auto['bytes_full_precision']} in full precision. "
        "Layers no rule matches stay in full precision.\n"
    )
    body = yaml.safe_dump(auto["policy"], sort_keys=False, default_flow_style=None, width=200)
    return write_text_atomic(path, header + body)
