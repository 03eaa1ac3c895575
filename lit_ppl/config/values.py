"""What the config's keys may hold: allowed values, Lightning's Trainer and logger arguments, per-value checks.

The allowed values are defined here once: the schema (:mod:`lit_ppl.config.schema`, :mod:`lit_ppl.config.quant`)
knows them without importing torch, and the modules that act on the keys import them from here. The ``check_*``
functions are the ``check`` metadata of the schema's fields: what OmegaConf
cannot type (unions, Trainer and logger arguments, a calibrated method without its text), raising
:class:`ConfigError`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from lit_ppl.errors import EXIT_CONFIG, LitPplError

# Allowed values: the one definition, imported by the modules that act on each key (named after the #).
STRATEGY_NAMES = (
    "auto",
    "ddp",
    "fsdp",
    "hsdp",
    "tp",
    "fsdp_tp",
)  # conf/strategy/: one preset each
EVAL_MODES = ("rolling", "sliding", "block", "llamacpp")  # lit_ppl.data.windows
DATA_FORMATS = ("auto", "text", "json", "parquet")  # lit_ppl.data.sources
ENCODING_ERRORS = ("strict", "replace", "ignore")  # lit_ppl.data.sources
QUANT_SCHEMES = ("none", "int8", "int8dq", "int4")  # lit_ppl.quant.schemes.Scheme: what one rule applies
QUANT_NAMES = (*QUANT_SCHEMES, "policy", "auto")  # quant.name: one scheme, per-module rules, or chosen by a budget
AUTO_SCHEMES = ("none", "int8", "int4")  # quant=auto: the schemes quant.schemes may list
SENSITIVITY_METHODS = ("fisher", "exact")  # quant=auto: a gradient estimate per window, or each candidate measured
QUANT_METHODS = ("rtn", "awq", "gptq", "hqq")  # one entry each in lit_ppl.quant.methods.METHODS
CALIBRATED_METHODS = ("awq", "gptq")  # the entries with calibrated=True
QUANT_SOURCES = ("local", "rank0")  # lit_ppl.quant.apply: every rank quantizes, or rank 0 broadcasts
INT4_BACKENDS = ("auto", "tinygemm", "prototype", "intx")  # lit_ppl.quant.schemes.int4_backend
GROUP_SIZES = (32, 64, 128, 256)  # lit_ppl.quant.schemes.Scheme
QUANT_ROLES = ("attention", "mlp", "experts", "head", "embeddings", "linear")  # lit_ppl.quant.targets.ROLES
REFERENCE_DTYPES = ("float32", "float64", "bfloat16", "float16")  # lit_ppl.evaluation.compare.DTYPES
BALANCES = ("tokens", "weights", "measured")  # lit_ppl.data.balance.BALANCES
PER_DOCUMENT_FORMATS = ("csv", "parquet")
LOGGERS = ("none", "csv", "tensorboard", "mlflow", "wandb")  # conf/logger/*.yaml
# Lightning's _PRECISION_INPUT (str, alias and int forms; an int given as precision=32 arrives as "32").
PRECISIONS = (
    *("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed"),
    *("32-true", "64-true", "64", "32", "16", "bf16"),
)

# Lightning Trainer arguments a config may set under ``trainer.``, and the plain types each takes (what a YAML
# value can be; Lightning's own objects such as a Profiler instance cannot come from a config). evaluate() sets
# strategy, precision, plugins, logger and callbacks itself and owns the rest of OWNED_TRAINER_ARGS: given here
# they would clash or be ignored. Mirrors inspect.signature(lightning.pytorch.Trainer): tests/test_config.py.
OWNED_TRAINER_ARGS = (
    "strategy",
    "precision",
    "plugins",
    "logger",
    "callbacks",
    "use_distributed_sampler",
    "enable_checkpointing",
    "enable_model_summary",
    "inference_mode",
)
_OPT_INT, _OPT_BOOL, _OPT_STR = (int, type(None)), (bool, type(None)), (str, type(None))
_LIMIT = (int, float, type(None))
TRAINER_ARGS: dict[str, tuple[type, ...]] = {
    "accelerator": (str,),
    "devices": (list, str, int),
    "num_nodes": (int,),
    "fast_dev_run": (int, bool),
    "max_epochs": _OPT_INT,
    "min_epochs": _OPT_INT,
    "max_steps": (int,),
    "min_steps": _OPT_INT,
    "max_time": (str, dict, type(None)),
    "limit_train_batches": _LIMIT,
    "limit_val_batches": _LIMIT,
    "limit_test_batches": _LIMIT,
    "limit_predict_batches": _LIMIT,
    "overfit_batches": (int, float),
    "val_check_interval": (int, float, str, dict, type(None)),
    "check_val_every_n_epoch": _OPT_INT,
    "num_sanity_val_steps": _OPT_INT,
    "log_every_n_steps": _OPT_INT,
    "enable_progress_bar": _OPT_BOOL,
    "accumulate_grad_batches": (int,),
    "gradient_clip_val": _LIMIT,
    "gradient_clip_algorithm": _OPT_STR,
    "deterministic": (bool, str, type(None)),
    "benchmark": _OPT_BOOL,
    "profiler": _OPT_STR,
    "detect_anomaly": (bool,),
    "barebones": (bool,),
    "sync_batchnorm": (bool,),
    "reload_dataloaders_every_n_epochs": (int,),
    "default_root_dir": _OPT_STR,
    "enable_autolog_hparams": (bool,),
    "model_registry": _OPT_STR,
}

# Keyword arguments of the Lightning loggers under conf/logger/ (their named __init__ parameters, tested against
# the signatures), plus what TensorBoardLogger and WandbLogger pass on through **kwargs to SummaryWriter and
# wandb.init: the backend's own settings, which users set here too.
LOGGER_ARGS: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.loggers.CSVLogger": ("save_dir", "name", "version", "prefix", "flush_logs_every_n_steps"),
    "lightning.pytorch.loggers.TensorBoardLogger": (
        *("save_dir", "name", "version", "log_graph", "default_hp_metric", "prefix", "sub_dir"),
        *("comment", "purge_step", "max_queue", "flush_secs", "filename_suffix"),  # SummaryWriter's
    ),
    "lightning.pytorch.loggers.MLFlowLogger": (
        *("experiment_name", "run_name", "tracking_uri", "tags", "save_dir", "log_model", "prefix"),
        *("artifact_location", "run_id", "synchronous"),
    ),
    "lightning.pytorch.loggers.WandbLogger": (
        *("name", "save_dir", "version", "offline", "dir", "id", "anonymous", "project", "log_model", "prefix"),
        *("checkpoint_name", "add_file_policy"),
        *("entity", "group", "tags", "job_type", "notes", "mode"),  # wandb.init's (the config is logged by lit-ppl)
    ),
}


class ConfigError(LitPplError):
    """A value the schema refuses, reported by the entry as one line."""

    exit_code = EXIT_CONFIG


# Field metadata: ``choices`` (allowed values), ``check`` (a function of (key, value) for what OmegaConf cannot
# type), ``union`` (that type, for the Lightning CLI's jsonargparse, which has unions), ``schema`` (the dataclass an
# untyped field's nodes are checked against), ``shown`` (the type as --help prints it when the annotation says
# less), ``doc`` (one line of --help and of the CLI's help).
PATHS = str | list[str] | None


def meta(doc: str = "", *, choices: tuple[Any, ...] = (), **more: Any) -> dict[str, Any]:
    """A field's metadata: its ``doc`` line, allowed ``choices``, and any of the keys above."""
    return {"doc": doc, "choices": choices, **more}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_batch_size(key: str, value: Any) -> None:
    if value != "auto" and not (_is_int(value) and value >= 1):
        raise ConfigError(f"{key}={value!r} must be a positive integer or auto")


def check_rank_count(key: str, value: Any) -> None:
    if not _is_int(value) or (value < 1 and value != -1):
        raise ConfigError(f"{key}={value!r} must be a positive integer or -1 (the rest of the world size)")


def check_paths(key: str, value: Any) -> None:
    if not (
        value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(p, str) for p in value))
    ):
        raise ConfigError(f"{key}={value!r} must be a path, a glob, a list of them, or null")


# Trainer arguments that score part of the corpus while the run reports the whole corpus's words, bytes and
# documents: their value when they change nothing.
PARTIAL_TRAINER_ARGS = {"limit_val_batches": (None, 1.0), "fast_dev_run": (False, 0), "overfit_batches": (0, 0.0)}


def check_positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{key}={value!r} must be a number of seconds > 0")


def check_non_negative(key: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ConfigError(f"{key}={value!r} must be an integer >= 0 (0: never)")


def check_step_count(key: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{key}={value!r} must be a positive integer")


def check_trainer(key: str, value: Any) -> None:
    for name, given in (value or {}).items():
        if name in OWNED_TRAINER_ARGS:
            raise ConfigError(f"{key}.{name} is set by lit-ppl itself; leave it out")
        if name not in TRAINER_ARGS:
            raise ConfigError(unknown_key(f"{key}.{name}", TRAINER_ARGS))
        kinds = TRAINER_ARGS[name]
        # bool is an int to Python, not to Lightning; an int is a valid float.
        ok = (
            bool in kinds
            if isinstance(given, bool)
            else isinstance(given, kinds) or (float in kinds and _is_int(given))
        )
        if not ok:
            wanted = " | ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ConfigError(f"{key}.{name}={given!r} is not of type {wanted}")
        if name in PARTIAL_TRAINER_ARGS and not any(
            given == unset and isinstance(given, bool) == isinstance(unset, bool)
            for unset in PARTIAL_TRAINER_ARGS[name]
        ):
            raise ConfigError(
                f"{key}.{name}={given!r} would score part of the corpus and still report the whole corpus's words, "
                "bytes and documents; use data.limit=N (the first N documents, each scored whole)"
            )


def check_logger(key: str, value: Any) -> None:
    target = (value or {}).get("_target_")
    valid = LOGGER_ARGS.get(str(target))
    if valid is None:  # no logger, or a class of the user's own (allow_any_target): its signature is its business
        return
    for name in value:
        if name != "_target_" and name not in valid:
            raise ConfigError(unknown_key(f"{key}.{name}", ("_target_", *valid)))


def calibrated_method(quant: dict[str, Any] | None) -> str | None:
    """``awq`` or ``gptq`` when a whole ``quant`` node (every key present) calibrates any layer, else ``None``: the
    one answer to "which calibrated method?" for the config check, the layout check and the quantizer."""
    if not quant or quant["name"] == "none":
        return None
    if quant["name"] == "policy":
        used = {r.get("method") or quant["method"] for r in quant["rules"] or [] if r.get("config", "none") != "none"}
    else:
        used = {quant["method"]}
    return next((m for m in CALIBRATED_METHODS if m in used), None)


def check_calibration(key: str, value: Any) -> None:
    """A calibrated method without calibration text fails now, not after the evaluated text is tokenized.

    The presets' ``quant.calibration.path: ???`` cannot say so: merged into the schema's ``null`` it stays null.
    """
    method = calibrated_method(value)
    if value and value["name"] == "auto":
        check_auto(key, value)
        method = method or "auto"
    if method and not (value["calibration"] or {}).get("path"):
        who = f"{key}=auto measures each layer on calibration text" if method == "auto" else f"{key}.method={method}"
        raise ConfigError(f"{who} needs calibration text: set {key}.calibration.path=FILE (not the evaluated text)")


def check_auto(key: str, value: dict[str, Any]) -> None:
    """``quant=auto``: exactly one positive budget, and schemes among :data:`AUTO_SCHEMES`."""
    budget = {k: v for k, v in (value.get("budget") or {}).items() if v is not None}
    if len(budget) != 1:
        raise ConfigError(
            f"{key}=auto needs exactly one budget: {key}.budget.kld=X (mean KL divergence from the unquantized "
            f"model), {key}.budget.ppl_increase=X (0.01: perplexity within 1%) or {key}.budget.bits=X (4.5: the "
            f"least KLD within 4.5 bits per weight); got {budget or 'none'}"
        )
    ((name, limit),) = budget.items()
    if not limit > 0:
        raise ConfigError(f"{key}.budget.{name}={limit!r} must be a positive number")
    if limit == math.inf:
        raise ConfigError(f"{key}.budget.{name}={limit!r} must be a finite number > 0")
    if (value.get("gptq") or {}).get("sequential"):
        raise ConfigError(
            f"{key}=auto with {key}.gptq.sequential=true: each layer is measured alone, on the float model's inputs; "
            f"use {key}.gptq.sequential=false"
        )
    calibration = value.get("calibration") or {}
    tokens, seq_len = calibration.get("tokens"), calibration.get("seq_len")
    if isinstance(tokens, int) and isinstance(seq_len, int) and tokens <= seq_len:
        raise ConfigError(
            f"{key}.calibration.tokens={tokens} with {key}.calibration.seq_len={seq_len} is one calibration window: "
            f"quant=auto bounds its measurement over windows and needs at least two (tokens above seq_len)"
        )
    schemes = list(value.get("schemes") or [])
    bad = [s for s in schemes if s not in AUTO_SCHEMES]
    if bad or not schemes or len(set(schemes)) != len(schemes) or schemes == ["none"]:
        raise ConfigError(
            f"{key}.schemes={schemes!r} must list distinct schemes among {', '.join(AUTO_SCHEMES)}, "
            "at least one of them quantized"
        )


def check_regex(key: str, value: Any) -> None:
    """A regex ``re`` compiles (``None`` passes: not given)."""
    if value is None:
        return
    try:
        re.compile(value)
    except (re.error, TypeError) as err:
        raise ConfigError(f"{key}={value!r} is not a valid regular expression ({err})") from None


def unknown_key(key: str, valid: Iterable[str]) -> str:
    return f"unknown key {key} (valid keys: {', '.join(valid)})"
