"""What a composed config may make Hydra or lit-ppl call, load or write: checked before anything is built.

A ``_target_`` is an import and a call, and so are a logging factory ``()`` and a handler's ``class``: Hydra builds
``hydra.callbacks``, the launcher and the sweeper, and hands ``hydra.job_logging``/``hydra_logging`` to
``logging.config.dictConfig``, all before the task (and lit-ppl's own check) runs. :func:`guarded_composition`
makes Hydra's composer check every config it composes (the run's, each sweep job's, ``--cfg``'s) whatever put a
value there: an override's key or dict value, a file on ``hydra.searchpath`` or ``--config-dir``, an interpolation
(``${oc.create:...}``, a reference to another node). Allowed:

* a ``_target_`` only where :data:`ALLOWED` has a position for it, naming one of that position's classes. A dotted
  name reaches any object through a module's imports (``lightning.pytorch.loggers.csv_logs.os.open`` is ``os.open``),
  so a name that is not one of them as written must come from the position's packages and resolve to the same
  object;
* logging: the standard handler and formatter classes, no factories or attribute setters, streams
  ``ext://sys.stdout``/``stderr``, log files named ``*.log`` directly in the run directory;
* ``hydra.job.env_set`` that leaves alone the variables the loader and interpreters read (``LD_*``, ``PYTHON*``...);
  ``hydra.output_subdir`` and ``hydra.sweep.subdir`` inside the run directory; no run directory that is a
  filesystem root or a system directory.

``allow_any_target=true`` lifts the first three, and only from the command line: a config file on the search path
is exactly what must not be able to switch the check off.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from lit_ppl.config.values import ConfigError

_LOGGERS = ("CSVLogger", "TensorBoardLogger", "MLFlowLogger", "WandbLogger")
_SUBMITIT = "hydra_plugins.hydra_submitit_launcher.submitit_launcher"
# position -> (the packages its targets' modules may come from, the classes it may build, what the error calls them);
# ``*`` stands for any one key (each callback's name).
ALLOWED: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "model": (("lit_ppl.",), ("lit_ppl.model.spec.ModelSpec",), "lit_ppl"),
    "data": (("lit_ppl.",), ("lit_ppl.data.sources.DataSpec",), "lit_ppl"),
    "logger": (
        ("lightning.pytorch.loggers.", "pytorch_lightning.loggers."),
        tuple(f"lightning.pytorch.loggers.{name}" for name in _LOGGERS),
        "lightning.pytorch.loggers",
    ),
    "hydra.callbacks.*": (("lit_ppl.",), ("lit_ppl.report.sweep.SweepSummary",), "Hydra callback"),
    "hydra.launcher": (
        ("hydra._internal.core_plugins.", "hydra_plugins.hydra_submitit_launcher."),
        (
            "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
            f"{_SUBMITIT}.SlurmLauncher",
            f"{_SUBMITIT}.LocalLauncher",
        ),
        "Hydra launcher",
    ),
    "hydra.sweeper": (
        ("hydra._internal.core_plugins.",),
        ("hydra._internal.core_plugins.basic_sweeper.BasicSweeper",),
        "Hydra sweeper",
    ),
}
LOGGING_NODES = ("hydra.job_logging", "hydra.hydra_logging")
LOG_HANDLERS = ("logging.StreamHandler", "logging.FileHandler", "logging.NullHandler")
LOG_FORMATTERS = ("logging.Formatter",)
LOG_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
# Environment variables through which a process, or the ranks it launches, would load code it was not given.
LOADER_VARIABLES = re.compile(r"(LD_|DYLD_|PYTHON).*|BASH_ENV|ENV|PATH|PERL5OPT|NODE_OPTIONS|JAVA_TOOL_OPTIONS")
# Where results never go: the root, and directories the system owns.
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/sbin",
    "/sys",
    "/usr",
)
TOP_LEVEL = ("/", "/home", "/mnt", "/media", "/opt", "/root", "/run", "/srv", "/tmp", "/var")
# Stands for the run directory, which Hydra fixes only when the job starts.
_RUN_DIR = "/<run directory>"


class _Unresolved(str):
    """The text of an interpolation that cannot be resolved before the job starts."""


def _plain(node: Any, depth: int = 0) -> Any:
    """``node`` as plain dicts and lists with every interpolation resolved that can be; the others as
    :class:`_Unresolved`. Interpolations into other nodes are followed (a value may *be* another node)."""
    if depth > 64:
        raise ConfigError("the config nests deeper than 64 levels (an interpolation into itself?)")
    if isinstance(node, DictConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return None
        return {str(k): _value(node, k, depth) for k in node}
    if isinstance(node, ListConfig):
        if node._is_none() or node._is_missing() or node._is_interpolation():
            return None
        return [_value(node, i, depth) for i in range(len(node))]
    return node


def _value(node: DictConfig | ListConfig, key: Any, depth: int) -> Any:
    try:
        value = node[key]
    except OmegaConfBaseException:
        return _Unresolved(str(node._get_node(key)._value()))
    return _plain(value, depth + 1)


def _walk(node: Any, path: str, key: Any = None) -> Iterator[tuple[str, Any, Any]]:
    """Every ``(dotted path, key, value)`` in ``node``, containers included, depth first."""
    yield path, key, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for name, value in items:
        where = f"{path}[{name}]" if isinstance(node, list) else f"{path}.{name}" if path else str(name)
        yield from _walk(value, where, name)


def _position(path: str) -> str:
    """The :data:`ALLOWED` key for the node at ``path``: each callback's name stands as ``*``."""
    parts = path.split(".")
    if parts[:2] == ["hydra", "callbacks"] and len(parts) == 3:
        return "hydra.callbacks.*"
    return path


def _resolve(target: str) -> Any:
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception:  # not importable: certainly not an allowed class
        return None


def _refuse_target(where: str, target: Any) -> None:
    position = where.rsplit(".", 1)[0]
    packages, allowed, what = ALLOWED.get(_position(position), ((), (), "lit_ppl"))
    ok = isinstance(target, str) and not isinstance(target, _Unresolved) and target.startswith(packages)
    if ok and target not in allowed:  # an allowed name as written is accepted without importing anything
        obj = _resolve(target)
        ok = obj is not None and any(obj is _resolve(name) for name in allowed)
    if not ok:
        names = ", ".join(allowed) if allowed else f"none: {position or 'the top level'} builds nothing"
        raise ConfigError(
            f"{where}={target!r} is not a {what} class this config may build (allowed: {names}); "
            "set allow_any_target=true on the command line to instantiate it"
        )


def check_targets(config: dict[str, Any], allow_any: bool = False) -> None:
    """Refuse any ``_target_`` in the plain ``config`` that is not one of its position's allowed classes."""
    if allow_any:
        return
    for path, key, value in _walk(config, ""):
        if key == "_target_":
            _refuse_target(path, value)


def _check_logging(config: dict[str, Any], where: str) -> None:
    """What ``logging.config.dictConfig`` would import, call, open or set from ``config``."""

    def refuse(path: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{path}={value!r}: {why}; set allow_any_target=true on the command line to allow it")

    for path, key, value in _walk(config, where):
        if isinstance(value, _Unresolved):
            raise refuse(path, value, "a logging setting must resolve before the job starts")
        if key in ("()", "."):
            raise refuse(path, value, "logging factories and attribute setters are not allowed")
        if isinstance(value, str) and value.startswith("ext://") and value not in LOG_STREAMS:
            raise refuse(path, value, f"a logging stream must be one of {', '.join(LOG_STREAMS)}")
    for section, allowed in (("handlers", LOG_HANDLERS), ("formatters", LOG_FORMATTERS)):
        for name, spec in (config.get(section) or {}).items():
            cls = spec.get("class", allowed[0]) if isinstance(spec, dict) else None
            if cls not in allowed:
                raise refuse(f"{where}.{section}.{name}.class", cls, f"allowed: {', '.join(allowed)}")
            if cls == "logging.FileHandler":
                _check_log_file(f"{where}.{section}.{name}.filename", spec.get("filename"))
    for name, spec in (config.get("filters") or {}).items():
        if not isinstance(spec, dict) or set(spec) - {"name"}:
            raise refuse(f"{where}.filters.{name}", spec, "a logging filter may only name a logger")


def _check_log_file(where: str, filename: Any) -> None:
    name = filename.removeprefix(f"{_RUN_DIR}/") if isinstance(filename, str) else ""
    if filename != f"{_RUN_DIR}/{name}" or not name.endswith(".log") or "/" in name or name.startswith("."):
        raise ConfigError(
            f"{where}={filename!r}: a log file must be a *.log file directly in the run directory "
            "(${hydra.runtime.output_dir}/NAME.log); set allow_any_target=true on the command line to allow it"
        )


def _check_environment(env_set: Any) -> None:
    for name, value in (env_set or {}).items():
        if LOADER_VARIABLES.fullmatch(str(name)) and os.environ.get(str(name)) != str(value):
            raise ConfigError(
                f"hydra.job.env_set.{name}={value!r}: {name} makes the run (or the ranks it launches) load code it "
                "was not given; set it in the environment, or allow_any_target=true on the command line"
            )


def _check_subdir(where: str, value: Any) -> None:
    if value is None or isinstance(value, _Unresolved):
        return
    path = Path(str(value))
    if path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"{where}={str(value)!r} must be a path inside the run directory (relative, without '..')")


def check_output_location(where: str, path: str | Path) -> None:
    """Refuse a directory for results that is a filesystem root or a system directory (``/``, ``/etc``, ``/usr/...``):
    lit-ppl writes, and on resume replaces, files in it."""
    real = os.path.realpath(os.path.expanduser(str(path)))
    if real in TOP_LEVEL or any(real == tree or real.startswith(f"{tree}/") for tree in SYSTEM_TREES):
        raise ConfigError(
            f"{where}={str(path)!r} is {'a filesystem root' if real == '/' else 'a system directory'} ({real}); "
            "give a directory of its own for the run's results"
        )


def _allow_any(cfg: DictConfig, overrides: Sequence[str]) -> bool:
    """``allow_any_target``, refused where a config file rather than the command line turned it on."""
    if not cfg.get("allow_any_target", False):
        return False
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [
        o for o in OverridesParser.create().parse_overrides(list(overrides)) if o.key_or_group == "allow_any_target"
    ]
    if not given:
        raise ConfigError(
            "allow_any_target=true comes from a config file, not the command line; a file (one on "
            "hydra.searchpath, say) may not lift the check of what a config builds: give it on the command line"
        )
    return True


def _probe(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with the values Hydra sets only when a job starts standing in."""
    probe = copy.deepcopy(cfg)
    with read_write(probe.hydra), open_dict(probe.hydra):
        runtime, job = probe.hydra.runtime, probe.hydra.job
        if OmegaConf.is_missing(runtime, "output_dir") or "output_dir" not in runtime:
            runtime.output_dir = _RUN_DIR
        for key, value in (("num", 0), ("id", "0")):
            if key not in job or OmegaConf.is_missing(job, key):
                job[key] = value
    return probe


def check_composed(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Check the whole composed ``cfg`` (the ``hydra`` node included) as :mod:`this module <lit_ppl.config.guard>`
    says; ``overrides`` are the command line's. Raises :class:`ConfigError`."""
    from hydra.core.hydra_config import HydraConfig

    allow_any = _allow_any(cfg, overrides)
    probe, saved = _probe(cfg), HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(copy.deepcopy(probe))  # so that ${hydra:...} resolves as in the job
        plain = _plain(probe)
    finally:
        HydraConfig.instance().cfg = saved
    hydra = plain.get("hydra") or {}
    if not allow_any:
        check_targets(plain)
        for where in LOGGING_NODES:
            node = hydra.get(where.split(".")[1])
            if isinstance(node, dict):
                _check_logging(node, where)
        _check_environment((hydra.get("job") or {}).get("env_set"))
    _check_subdir("hydra.output_subdir", hydra.get("output_subdir"))
    _check_subdir("hydra.sweep.subdir", (hydra.get("sweep") or {}).get("subdir"))
    for where in ("hydra.run.dir", "hydra.sweep.dir"):
        value = (hydra.get(where.split(".")[1]) or {}).get("dir")
        if isinstance(value, str) and not isinstance(value, _Unresolved):
            check_output_location(where, value)


@contextlib.contextmanager
def guarded_composition() -> Iterator[None]:
    """Within: every config Hydra's composer returns has passed :func:`check_composed` (its overrides standing for
    the command line: a sweep job's are the sweep's), before Hydra configures logging or builds anything from it."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    original = ConfigLoaderImpl.load_configuration

    def load_configuration(self: ConfigLoaderImpl, config_name: Any, overrides: list[str], *args: Any, **kw: Any):
        cfg = original(self, config_name, overrides, *args, **kw)
        check_composed(cfg, overrides)
        return cfg

    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl.load_configuration = original  # type: ignore[method-assign]


def construct(node: dict[str, Any]) -> Any:
    """Instantiate a node whose ``_target_`` :func:`check_targets` has accepted, without Hydra's recursion: its other
    keys are the constructor's keyword arguments as they are."""
    args = {k: v for k, v in node.items() if k != "_target_"}
    return _resolve(node["_target_"])(**args)
