"""The ``quant`` node of the config schema (weight quantization: one scheme, or rules; calibration text), and
``compare``, whose reference may be quantized too.

A rule of ``quant.rules`` and a ``compare.reference`` given as a node are untyped in OmegaConf (a rule stays as
written; a reference may also be a path), so :func:`check_rules` and :func:`check_reference` check them against
:class:`RuleConfig` and :class:`ReferenceConfig` once the config is composed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lit_ppl.config.fields import check_fields, typed_copy
from lit_ppl.config.values import (
    AUTO_SCHEMES,
    DATA_FORMATS,
    ENCODING_ERRORS,
    GROUP_SIZES,
    INT4_BACKENDS,
    PATHS,
    QUANT_METHODS,
    QUANT_NAMES,
    QUANT_ROLES,
    QUANT_SCHEMES,
    QUANT_SOURCES,
    REFERENCE_DTYPES,
    SENSITIVITY_METHODS,
    ConfigError,
    check_calibration,
    check_non_negative,
    check_paths,
    check_regex,
    check_step_count,
    meta,
)


def check_rules(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise ConfigError(f"{key}={value!r} must be a list of rules {{role|match, config[, group_size, method]}}")
    for i, rule in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(rule, dict):
            raise ConfigError(f"{where}={rule!r} must be a rule {{role|match, config[, group_size, method]}}")
        # Validated on a typed copy: lit_ppl.quant.assign.rules_from_cfg reads an absent key as "not given" (the
        # quant node's value), so the rule itself keeps only the keys the user wrote.
        typed = typed_copy(RuleConfig, rule, where)
        if (typed["role"] is None) == (typed["match"] is None):
            raise ConfigError(f"{where} needs exactly one of role (one of {', '.join(QUANT_ROLES)}) or match (a regex)")
        check_fields(RuleConfig, typed, where)


def check_damp(key: str, value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(f"{key}={value} must be in [0, 1): a fraction of mean(diag H)")


def check_block_size(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}={value} must be a positive number of columns")


def check_reference(key: str, value: Any) -> None:
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r} must be null, a checkpoint path, or {{path, dtype, quant, store}}")
    check_fields(ReferenceConfig, typed_copy(ReferenceConfig, value, key), key)


@dataclass
class CalibrationConfig:
    """``quant.calibration``: the calibration text of awq/gptq (:mod:`lit_ppl.quant.calibrated.text`)."""

    path: Any = field(
        default=None,
        metadata=meta(
            "calibration text, read like data.path", check=check_paths, union=PATHS, shown="str | list[str] | null"
        ),
    )
    format: str = field(default="auto", metadata=meta("as data.format", choices=DATA_FORMATS))
    text_field: str = field(default="text", metadata=meta("as data.text_field"))
    document_separator: str | None = field(default=None, metadata=meta("as data.document_separator"))
    encoding_errors: str = field(default="strict", metadata=meta("as data.encoding_errors", choices=ENCODING_ERRORS))
    limit: int | None = field(default=None, metadata=meta("only the first N documents"))
    cache_dir: str | None = field(default=None, metadata=meta("token store"))
    seq_len: int = field(default=512, metadata=meta("tokens per calibration window", check=check_step_count))
    tokens: int = field(default=8192, metadata=meta("calibration tokens", check=check_step_count))
    batch_size: int = field(default=8, metadata=meta("windows per forward pass", check=check_step_count))
    grid: int = field(default=20, metadata=meta("AWQ: candidate scales per layer", check=check_step_count))
    allow_overlap: bool = field(default=False, metadata=meta("accept calibration text identical to the evaluated text"))


@dataclass
class GptqConfig:
    """``quant.gptq``: GPTQ's knobs (:mod:`lit_ppl.quant.calibrated.gptq_solver`)."""

    damp: float = field(
        default=0.01, metadata=meta("fraction of mean(diag XᵀX) added to its diagonal", check=check_damp)
    )
    block_size: int = field(
        default=128, metadata=meta("columns updated together (lazy batch updates)", check=check_block_size)
    )
    act_order: bool = field(default=True, metadata=meta("quantize columns by decreasing XᵀX diagonal"))
    sequential: bool = field(
        default=False, metadata=meta("calibrate each decoder block on the outputs of the quantized blocks before it")
    )


@dataclass
class BudgetConfig:
    """``quant.budget`` (one): what ``quant=auto`` may lose against the unquantized model on the calibration text,
    or the size within which it loses the least."""

    kld: float | None = field(default=None, metadata=meta("mean KL divergence, nats"))
    ppl_increase: float | None = field(default=None, metadata=meta("|PPL(Q)/PPL(base) - 1| (0.01: within 1%)"))
    bits: float | None = field(
        default=None, metadata=meta("mean bits per weight of the candidates, packed: the least KLD within this size")
    )


@dataclass
class RuleConfig:
    """One rule of ``quant.rules`` (``quant=policy``); only used to check a rule, which stays as written."""

    role: str | None = field(default=None, metadata=meta("a role (or match)", choices=QUANT_ROLES))
    match: str | None = field(
        default=None, metadata=meta("a regex searched in the module name (or role)", check=check_regex)
    )
    config: str = field(default="none", metadata=meta("the scheme", choices=QUANT_SCHEMES))
    group_size: int | None = field(
        default=None, metadata=meta("int4 group size (default: quant.group_size)", choices=GROUP_SIZES)
    )
    method: str | None = field(
        default=None, metadata=meta("rtn, awq, gptq or hqq (default: quant.method)", choices=QUANT_METHODS)
    )


@dataclass
class QuantConfig:
    """``quant``: weight quantization."""

    name: str = field(
        default="none",
        metadata=meta("one scheme for every linear layer, policy (rules), or auto (a budget)", choices=QUANT_NAMES),
    )
    method: str = field(
        default="rtn",
        metadata=meta("round-to-nearest, hqq (int4), or calibrated (awq, gptq)", choices=QUANT_METHODS),
    )
    group_size: int | None = field(default=None, metadata=meta("int4 group size", choices=GROUP_SIZES))
    group_fallback: bool = field(
        default=True,
        metadata=meta("int4: a layer the group size does not divide takes the largest one below that does"),
    )
    backend: str = field(default="auto", metadata=meta("int4 kernel", choices=INT4_BACKENDS))
    head: bool = field(default=False, metadata=meta("also quantize the output head"))
    source: str = field(
        default="local", metadata=meta("every rank quantizes, or rank 0 broadcasts", choices=QUANT_SOURCES)
    )
    rules: list[dict[str, Any]] | None = field(
        default=None,
        metadata=meta(
            "policy: ordered rules, first match wins",
            check=check_rules,
            schema=RuleConfig,
            shown="list[{role|match, config, group_size?, method?}] | null",
        ),
    )
    calibration: CalibrationConfig = field(
        default_factory=CalibrationConfig, metadata=meta("awq/gptq/auto calibration text")
    )
    budget: BudgetConfig = field(default_factory=BudgetConfig, metadata=meta("auto: the loss allowed"))
    sensitivity: str | None = field(
        default=None, metadata=meta("auto: reuse the layer measurements of an earlier quant=auto run's results.json")
    )
    sensitivity_method: str = field(
        default="fisher",
        metadata=meta(
            "auto: each candidate's KLD estimated from gradients (fisher: a few passes) or measured alone (exact)",
            choices=SENSITIVITY_METHODS,
        ),
    )
    auto_embeddings: bool = field(
        default=True,
        metadata=meta(
            "auto: the output head and the input embeddings are candidates too (tied: one), by round-to-nearest"
        ),
    )
    schemes: list[str] = field(
        default_factory=lambda: list(AUTO_SCHEMES),
        metadata=meta(f"auto: the schemes a layer may get, among {', '.join(AUTO_SCHEMES)}"),
    )
    gptq: GptqConfig = field(default_factory=GptqConfig, metadata=meta("GPTQ's options"))
    sweep_dir: str | None = field(
        default=None,
        metadata=meta(
            "auto: a -m sweep's directory (set by the sweep): with sensitivity null, a sibling job's table measured "
            "for the same fingerprint is reused"
        ),
    )


@dataclass
class ReferenceConfig:
    """``compare.reference`` given as a node (it may also be a path, so the field itself is untyped)."""

    path: str | None = field(default=None, metadata=meta("null: model.path"))
    store: str | None = field(
        default=None, metadata=meta("compare=saved: a save_reference directory, read for the reference")
    )
    dtype: str | None = field(default=None, metadata=meta("null: the run's precision", choices=REFERENCE_DTYPES))
    quant: QuantConfig = field(
        default_factory=QuantConfig, metadata=meta("the reference's quantization, as quant", check=check_calibration)
    )


@dataclass
class CompareConfig:
    """``compare``: a reference model, compared token by token."""

    reference: Any = field(
        default=None,
        metadata=meta(
            "null, a checkpoint path, or {path, dtype, quant}",
            check=check_reference,
            schema=ReferenceConfig,
            union=str | dict[str, Any] | None,
            shown="str | {path, dtype, quant} | null",
        ),
    )
    noise_floor: int = field(
        default=4,
        metadata=meta(
            "windows re-scored in float64 for the reference's noise floor (its own rounding's KLD); a save_reference "
            "run stores it for compare=saved; 0: off",
            check=check_non_negative,
        ),
    )


def quant_config(value: Any) -> QuantConfig:
    """A ``quant`` node (as written, or already typed) as a :class:`QuantConfig`, every default from the schema:
    what the quantization code reads, so that no default is repeated there (a reference's node may give only a few
    keys). Its field checks run here too, for callers of the Python API."""
    if isinstance(value, QuantConfig):
        return value
    from omegaconf import OmegaConf

    plain = typed_copy(QuantConfig, dict(value or {}), "quant")
    check_fields(CalibrationConfig, plain["calibration"], "quant.calibration")
    check_fields(GptqConfig, plain["gptq"], "quant.gptq")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), plain))
