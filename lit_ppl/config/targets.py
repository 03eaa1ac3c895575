"""Which classes a config may instantiate: an exact allow-list per group, compared as resolved objects.

A ``_target_`` is an import and a call. Hydra follows a dotted name through a module's own imports
(``lightning.pytorch.loggers.csv_logs.os.open`` is ``os.open``), so a name prefix proves nothing: a target is
allowed only if it *resolves to* one of its group's classes. Before resolving, its module must lie in the group's
packages, so that an override cannot make lit-ppl import an arbitrary module either. ``_target_`` anywhere else in
the config (a nested node, a group that builds nothing) is refused. ``allow_any_target=true`` lifts all of this.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lit_ppl.config.values import ConfigError

# group -> (the packages its targets' modules may come from, the classes it may build, what the error calls them)
ALLOWED: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "model": (("lit_ppl.",), ("lit_ppl.model.spec.ModelSpec",), "lit_ppl"),
    "data": (("lit_ppl.",), ("lit_ppl.data.sources.DataSpec",), "lit_ppl"),
    "logger": (
        ("lightning.pytorch.loggers.", "pytorch_lightning.loggers."),
        tuple(
            f"lightning.pytorch.loggers.{name}"
            for name in ("CSVLogger", "TensorBoardLogger", "MLFlowLogger", "WandbLogger")
        ),
        "lightning.pytorch.loggers",
    ),
}


def _targets(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Every ``(dotted key, value)`` of a ``_target_`` in ``node``, at any depth."""
    if isinstance(node, dict):
        for name, value in node.items():
            where = f"{key}.{name}" if key else str(name)
            if name == "_target_":
                yield where, value
            else:
                yield from _targets(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{key}[{i}]")


def _resolve(target: str) -> Any:
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception:  # not importable: certainly not an allowed class
        return None


def check_targets(config: dict[str, Any]) -> None:
    """Refuse any ``_target_`` in the resolved ``config`` that is not one of its group's allowed classes."""
    if config.get("allow_any_target", False):
        return
    for key, target in _targets({k: v for k, v in config.items() if k != "hydra"}, ""):
        group = key.rsplit(".", 1)[0]
        packages, allowed, what = ALLOWED.get(group, ((), (), "lit_ppl"))
        ok = isinstance(target, str) and target.startswith(packages)
        if ok and target not in allowed:  # an allowed name as written is accepted without importing anything
            obj = _resolve(target)
            ok = obj is not None and any(obj is _resolve(name) for name in allowed)
        if not ok:
            names = ", ".join(allowed) if allowed else f"none: {group} builds nothing"
            raise ConfigError(
                f"{key}={target!r} is not a {what} class this config may build (allowed: {names}); "
                "set allow_any_target=true to instantiate it"
            )


def construct(node: dict[str, Any]) -> Any:
    """Instantiate a node whose ``_target_`` :func:`check_targets` has accepted, without Hydra's recursion: its other
    keys are the constructor's keyword arguments as they are."""
    args = {k: v for k, v in node.items() if k != "_target_"}
    return _resolve(node["_target_"])(**args)
