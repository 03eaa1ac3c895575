"""Experiment loggers (conf/logger/) written by real runs and read back; the quiet console of a plain run."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest
from conftest import run_entry

from lit_ppl.report import loggers
from lit_ppl.run import evaluate

# Many short steps, a tokens/s point after each: the demo text is ~1,940 tokens, 64-token windows, one per step.
SMALL_STEPS = ("eval.seq_len=64", "batch_size=1", "+trainer.log_every_n_steps=1")


def test_csv_logger_writes_progress_final_stats_and_config(compose, tmp_path):
    r = evaluate(compose("logger=csv", *SMALL_STEPS))
    log_dir = tmp_path / "out" / "csv"
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    progress = [row for row in rows if row.get("progress/tokens_per_s")]
    steps = r["rank_steps"][0]
    assert steps > 10 and len(progress) == steps  # one point per step at log_every_n_steps=1
    assert all(float(row["progress/tokens_per_s"]) > 0 for row in progress)
    assert [int(float(row["progress/tokens"])) for row in progress][-1] == r["tokens"]
    final = [row for row in rows if row.get("word_ppl")]
    assert len(final) == 1 and int(final[0]["step"]) == steps
    for key in ("ppl", "nll_mean", "word_ppl", "byte_ppl", "bits_per_byte", "tokens", "tokens_per_s"):
        assert float(final[0][key]) == pytest.approx(r[key], rel=1e-12), key
    assert float(final[0]["ppl_ci95_low"]) == pytest.approx(r["ppl_ci95"][0], rel=1e-12)
    hparams = (log_dir / "hparams.yaml").read_text()
    assert "seq_len: 64" in hparams and "path: builtin" in hparams


def test_tensorboard_event_file_reads_back(compose, tmp_path):
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    evaluate(compose("logger=tensorboard", *SMALL_STEPS))
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    log_dir = tmp_path / "out" / "tensorboard"
    assert list(log_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(log_dir))
    events.Reload()
    scalars = events.Tags()["scalars"]
    # Event files store float32: equal to results.json's float64 to float32 precision.
    assert events.Scalars("ppl")[-1].value == pytest.approx(saved["ppl"], rel=1e-6)
    assert events.Scalars("bits_per_byte")[-1].value == pytest.approx(saved["bits_per_byte"], rel=1e-6)
    assert events.Scalars("tokens")[-1].value == saved["tokens"]
    assert len(events.Scalars("progress/tokens_per_s")) >= 1 and "word_ppl" in scalars
    # The HParams plugin's summary (the config beside the final statistics) is in the same file.
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["eval/seq_len"].number_value == 64 and hparams["model/path"].string_value == "builtin"
    assert "seq_len: 64" in (log_dir / "hparams.yaml").read_text()


def test_each_run_logs_to_its_own_directory(compose, tmp_path):
    """What keeps the jobs of a -m sweep apart: the save dir follows output_dir, which Hydra makes per job."""
    for job in ("0", "1"):
        evaluate(compose("logger=csv", f"output_dir={tmp_path / job}", f"eval.seq_len={64 * (1 + int(job))}"))
    first, second = (tmp_path / job / "csv" / "metrics.csv" for job in ("0", "1"))
    assert first.is_file() and second.is_file()
    assert "seq_len: 64" in (tmp_path / "0" / "csv" / "hparams.yaml").read_text()
    assert "seq_len: 128" in (tmp_path / "1" / "csv" / "hparams.yaml").read_text()


def test_missing_package_is_one_line_naming_the_extra(compose):
    absent = [
        (option, module)
        for option, module in (("mlflow", "mlflow"), ("wandb", "wandb"), ("tensorboard", "tensorboard"))
        if importlib.util.find_spec(module) is None
        and (option != "tensorboard" or not importlib.util.find_spec("tensorboardX"))
    ]
    if not absent:  # every package installed: the message itself
        message = loggers.missing_package_message("mlflow", ("mlflow",), "mlflow")
        assert (
            message == "logger=mlflow needs the mlflow package, which is not installed: pip install 'lit-ppl[mlflow]'"
        )
        return
    option, module = absent[0]
    with pytest.raises(loggers.MissingPackageError) as err:
        evaluate(compose(f"logger={option}"))
    assert str(err.value) == (
        f"logger={option} needs the {module} package, which is not installed: pip install 'lit-ppl[{option}]'"
    )


def test_untrusted_logger_target_is_refused(compose):
    with pytest.raises(ValueError, match=r"logger._target_='os.system' is not a lightning.pytorch.loggers class"):
        evaluate(compose("logger=csv", "logger._target_=os.system"))


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_mlflow_file_store_reads_back(compose, tmp_path):
    from mlflow.tracking import MlflowClient

    r = evaluate(compose("logger=mlflow", *SMALL_STEPS))
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'out' / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lit-ppl").experiment_id])
    assert run.data.metrics["ppl"] == pytest.approx(r["ppl"], rel=1e-12)
    assert run.data.params["eval/seq_len"] == "64"
    assert client.get_metric_history(run.info.run_id, "progress/tokens_per_s")


# What a plain run must not print (each from Lightning or torch, not from lit-ppl).
NOISE = (
    "GPU available:",
    "TPU available:",
    "💡 Tip",
    "isinstance(treespec, LeafSpec)` is deprecated",
    "The `srun` command is available",
)


@pytest.mark.slow
def test_plain_run_prints_only_lit_ppl_lines_unless_verbose(tmp_path):
    proc, results = run_entry([], tmp_path / "quiet")
    assert proc.returncode == 0 and results is not None, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert [line for line in NOISE if line in output] == []
    assert "token perplexity" in output and "results:" in output

    proc, results = run_entry(["verbose=true"], tmp_path / "verbose")
    assert proc.returncode == 0 and results is not None, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert "GPU available:" in output and "💡 Tip" in output
    assert "isinstance(treespec, LeafSpec)` is deprecated" in output


def test_quiet_console_hides_only_the_listed_lines(caplog):
    """The filters match by logger and message: lit-ppl's own warnings, and other libraries' warnings, still show."""
    import logging
    import warnings

    from lit_ppl.runtime.verbosity import set_verbose

    banner = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    try:
        set_verbose(False)
        set_verbose(False)  # idempotent: no second filter
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
            warnings.simplefilter("always")  # what catch_warnings resets is re-applied below
            set_verbose(False)
            warnings.warn("The `srun` command is available on your system but is not used.", UserWarning, stacklevel=1)
            warnings.warn("some other library warning", UserWarning, stacklevel=1)
            banner.info("GPU available: False, used: False")
            banner.info("LOCAL_RANK: 0 - some other Lightning line")
            logging.getLogger("lit_ppl.quant.apply").warning("quantization skipped 3 layers")
        assert [str(w.message) for w in caught] == ["some other library warning"]
        assert [r.getMessage() for r in caplog.records] == [
            "LOCAL_RANK: 0 - some other Lightning line",
            "quantization skipped 3 layers",
        ]
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
            warnings.simplefilter("always")
            set_verbose(True)
            warnings.warn("The `srun` command is available on your system but is not used.", UserWarning, stacklevel=1)
            banner.info("GPU available: False, used: False")
        assert len(caught) == 1 and [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
    finally:
        set_verbose(True)
