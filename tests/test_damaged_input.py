"""Damaged files and mistakes in quantization settings (issue 34, items 7 and 8): one line naming the file or value
and what is wrong, before anything loads where nothing needs to — never a traceback, nor "raise the budget"."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from conftest import STORIES, require_shared, run_entry
from helpers.gguf_files import write_gguf

from lit_ppl.config import ConfigError, check
from lit_ppl.errors import LitPplError
from lit_ppl.quant.auto.table import load_table
from lit_ppl.run import evaluate


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """A whole GGUF file, and one with a tensor of the wrong shape (half the rows of a projection)."""
    require_shared()
    root = tmp_path_factory.mktemp("gguf")
    whole, _ = write_gguf(root / "whole", STORIES, "Q8_0")
    halved, _ = write_gguf(root / "halved", STORIES, "Q8_0", halve="model.layers.1.mlp.down_proj.weight")
    return {"whole": whole, "halved": halved}


def _damaged(whole: Path, tmp_path: Path, how: str) -> Path:
    data = bytearray(whole.read_bytes())
    if how == "truncated header":
        data = data[:2000]
    elif how == "truncated tensors":
        data = data[: len(data) * 2 // 3]
    elif how == "corrupt tensor count":  # transformers called it "not a valid JSON file"
        data[8:16] = struct.pack("<Q", 1 << 62)
    else:
        data[:4] = b"GGUX"
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(data))
    return path


RUN = ["eval.seq_len=32", "data.limit=2", "trainer.accelerator=cpu"]


@pytest.mark.parametrize("how", ["truncated header", "truncated tensors", "corrupt tensor count", "bad magic"])
def test_a_damaged_gguf_is_one_line_naming_it(ggufs, tmp_path, compose, how):
    path = _damaged(ggufs["whole"], tmp_path, how)
    with pytest.raises(LitPplError) as err:
        evaluate(compose(f"model.path={path}", *RUN))
    line = str(err.value)
    assert line.startswith(f"{path} is not a readable GGUF file ({path.stat().st_size} bytes; gguf: "), line
    assert line.endswith("its header is damaged or the file is cut short; download it again") and "\n" not in line
    assert not (tmp_path / "out" / ".lit_ppl.lock").exists(), "refused in preflight, before the lock"


def test_a_gguf_tensor_of_the_wrong_shape_is_one_line(ggufs, compose):
    with pytest.raises(LitPplError) as err:
        evaluate(compose(f"model.path={ggufs['halved']}", *RUN))
    assert str(err.value) == (
        f"model.path='{ggufs['halved']}': the checkpoint has tensors of the wrong shape: "
        "model.layers.1.mlp.down_proj.weight (checkpoint [128, 512], model [256, 512]); give a complete checkpoint of "
        "this architecture"
    )


@pytest.mark.slow
def test_a_gguf_tensor_of_the_wrong_shape_under_fsdp_is_one_line_per_rank(ggufs, tmp_path):
    """Rank 0 reads the file for both; the other rank hears why instead of a dead peer's broken collective."""
    proc, results = run_entry([f"model.path={ggufs['halved']}", *RUN, "strategy=fsdp", "trainer.devices=2"], tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-ppl:")]
    assert proc.returncode == 1 and results is None, proc.stderr[-3000:]
    assert len(errors) == 2 and all("has tensors of the wrong shape: model.layers.1.mlp" in e for e in errors), errors
    assert "Traceback" not in proc.stderr and "LOAD REPORT" not in proc.stderr


@pytest.mark.parametrize("keep", [0.5, 100])  # bytes kept: half the file, or the header cut short
def test_a_truncated_safetensors_file_is_one_line_before_loading(tmp_path, compose, keep):
    """An interrupted download: refused from the header, before any weight is read."""
    require_shared()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(STORIES, ckpt)
    weights = ckpt / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(weights.read_bytes()[: int(keep * weights.stat().st_size) if keep < 1 else keep])
    with pytest.raises(LitPplError) as err:
        evaluate(compose(f"model.path={ckpt}", *RUN))
    assert str(err.value).startswith(
        f"model.path='{ckpt}': model.safetensors is not a complete safetensors file ({weights.stat().st_size} bytes: "
    )
    assert str(err.value).endswith("an interrupted download? fetch it again")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["quant=auto", "quant.budget.kld=inf", "quant.calibration.path=x.txt"],
            "quant.budget.kld=inf must be a finite number > 0",
        ),
        (
            ["quant=policy", "quant.rules=[{match: 'q_proj(', config: int8}]"],
            "quant.rules[0].match='q_proj(' is not a valid regular expression (missing ), unterminated subpattern",
        ),
    ],
)
def test_quantization_values_that_cannot_work_are_refused_by_the_config_check(compose, overrides, message):
    """An infinite budget ran everything, then failed writing results.json; a bad regex was a traceback."""
    with pytest.raises(ConfigError) as err:
        check(compose(*overrides))
    assert str(err.value).startswith(message)


def test_a_policy_rule_is_checked_without_the_config_check_too(compose):
    """The API (a composed config handed to evaluate): the rule is refused before the model loads."""
    with pytest.raises(ValueError, match=r"quant.rules\[1\].match='\[' is not a valid regular expression"):
        evaluate(compose("quant=policy", "quant.rules=[{role: mlp, config: int8}, {match: '[', config: int8}]"))


def test_a_policy_rule_that_matches_no_layer_is_one_line(compose):
    """It was silently ignored: the layers it meant stayed in full precision."""
    rules = "quant.rules=[{role: mlp, config: int8}, {match: 'q_projection', config: int8}]"
    with pytest.raises(LitPplError) as err:
        evaluate(compose("quant=policy", rules, "eval.seq_len=32"))
    assert str(err.value).startswith(
        "quant.rules[1] (match='q_projection') matches no layer of LlamaForCausalLM (its layers are named like "
    )


@pytest.mark.slow
def test_a_policy_file_with_a_yaml_syntax_error_is_one_line(tmp_path):
    """A quant_policy.yaml reused through hydra.searchpath, edited by hand: a traceback of Hydra's internals."""
    conf = tmp_path / "conf" / "quant"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("name: policy\nrules:\n  - {match: q_proj, config: int8\n  - role: mlp\n")
    proc, results = run_entry([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "quant=mine"], tmp_path)
    assert proc.returncode == 2 and results is None
    assert proc.stderr.strip().splitlines() == [
        f"lit-ppl: error: {conf / 'mine.yaml'}, line 4, column 9: not valid YAML (expected ',' or '}}', but got ':')"
    ]


FINGERPRINT = {"schemes": ["none", "int8", "int4"], "method": "rtn", "group_size": 32, "layers": ["a", "b"]}
MEASURED = {"a": ["int8", "int4"], "b": ["int8"]}


def _table(tmp_path: Path, table: object, fingerprint: object = FINGERPRINT) -> str:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"quant": {"auto": {"fingerprint": fingerprint, "sensitivity": table}}}))
    return str(path)


def _row(kld: object = 1e-3, delta: object = 2e-3) -> dict:
    return {"kld": kld, "nll_delta": delta}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"a": {"int8": _row("0.001"), "int4": _row()}, "b": {"int8": _row()}}, "a int8 kld='0.001' is not a finite"),
        ({"a": {"int8": _row(), "int4": _row(delta="x")}, "b": {"int8": _row()}}, "a int4 nll_delta='x' is not a"),
        (
            {"a": {"int8": _row(-1.0), "int4": _row()}, "b": {"int8": _row()}},
            "a int8 kld=-1.0 is not a finite number >= 0",
        ),
        ({"a": {"int8": _row(), "int4": _row()}, "b": {"int8": _row(float("inf"))}}, "b int8 kld=inf is not a finite"),
        ({"a": {"int8": _row(), "int4": _row()}, "b": {"int8": _row(float("nan"))}}, "b int8 kld=nan is not a finite"),
        ({"a": {"int8": _row()}, "b": {"int8": _row()}}, "holds ['int8'] for a, not one measurement per scheme"),
        ({"a": {"int8": _row(), "int4": _row()}, "b": "x"}, "holds 'x' for b, not one measurement per scheme"),
        ({"a": {"int8": _row(), "int4": _row()}, "c": {"int8": _row()}}, "measures c, which is no candidate layer"),
    ],
)
def test_a_damaged_or_edited_sensitivity_table_is_one_line(tmp_path, table, message):
    """String values were a traceback in the knapsack, and forged numbers "raise the budget"."""
    path = _table(tmp_path, table)
    with pytest.raises(LitPplError) as err:
        load_table(path, FINGERPRINT, MEASURED)
    assert message in str(err.value) and str(err.value).startswith(f"quant.sensitivity={path!r}")


def test_a_sensitivity_table_is_read_when_whole(tmp_path):
    table = {"a": {"int8": _row(), "int4": _row(0.0, -1e-3)}, "b": {"int8": _row()}}
    assert load_table(_table(tmp_path, table), FINGERPRINT, MEASURED) == table
    with pytest.raises(LitPplError, match=r"is not the results.json of a quant=auto run .*must be objects"):
        load_table(_table(tmp_path, table, fingerprint="forged"), FINGERPRINT, MEASURED)
