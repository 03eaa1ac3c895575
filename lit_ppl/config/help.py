"""``python -m lit_ppl.validate --help``: every key's type, its value in the composed config, allowed values, meaning.

Rendered from the schema (:mod:`lit_ppl.config.schema`) by the ``lit_ppl_help`` resolver that
:func:`lit_ppl.config.register` installs and ``conf/validate.yaml``'s ``hydra.help.template`` calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lit_ppl.config.fields import nested_schema, schema_fields, type_name
from lit_ppl.config.schema import ValidateConfig
from lit_ppl.config.values import LOGGER_ARGS, LOGGERS, TRAINER_ARGS

HELP_HEADER = """\
lit-ppl: exact perplexity of a causal LM.

  python -m lit_ppl.validate [group=option ...] [key=value ...] [+trainer.ARG=value ...]
  python -m lit_ppl.validate --cfg job [...]       # print the composed config; nothing runs
  python -m lit_ppl.validate -m quant=none,int8     # a sweep

== Config groups (group=option) ==
$APP_CONFIG_GROUPS

== Keys: type = value in this config, allowed values, meaning ==
Strict: an unknown key, a value of the wrong type or outside the allowed ones is an error.
"""


def _shown(value: Any) -> str:
    """A value as YAML writes it (null, true, [1, 2]), on one line."""
    return value if isinstance(value, str) else OmegaConf.to_yaml({"v": value}).strip()[3:].replace("\n", " ")


def _help_lines(schema: type, node: dict[str, Any], prefix: str) -> Iterator[str]:
    for f, kind in schema_fields(schema):
        key, value = f"{prefix}{f.name}", node.get(f.name)
        inner = nested_schema(kind)
        if inner is not None:
            yield from _help_lines(inner, value if isinstance(value, dict) else {}, f"{key}.")
        elif key == "trainer":
            given = value or {}
            shown = ", ".join(f"{k}={_shown(v)}" for k, v in given.items())
            yield f"  trainer: Lightning Trainer arguments; set: {shown}"
            yield f"      +trainer.ARG=value for any of: {', '.join(a for a in TRAINER_ARGS if a not in given)}"
        elif key == "logger":
            target = (value or {}).get("_target_")
            yield f"  logger: {' | '.join(LOGGERS)} (logger=NAME) = {target or 'none'}"
            if target in LOGGER_ARGS:
                yield f"      logger.KEY for: {', '.join(LOGGER_ARGS[target])}"
        else:
            doc = f.metadata.get("doc", "")
            yield f"  {key}: {type_name(f, kind)} = {_shown(value)}" + (f"   # {doc}" if doc else "")


def help_text(cfg: DictConfig) -> str:
    """The body of ``--help`` for the composed ``cfg``: each key's type, its value here, allowed values, meaning."""
    return HELP_HEADER + "\n".join(_help_lines(ValidateConfig, OmegaConf.to_container(cfg), ""))


def help_resolver(*, _root_: DictConfig) -> str:
    # Hydra renders hydra.help.template with string.Template: a literal $ (e.g. ${hydra:...} values) is $$.
    text = help_text(_root_)
    return text.replace("$", "$$").replace("$$APP_CONFIG_GROUPS", "$APP_CONFIG_GROUPS")
