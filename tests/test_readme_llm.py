"""The language-model studies of the README's table (docs/language-models.md: LoRA and
QLoRA), run as tests/test_readme.py runs every other command, with its helpers and in a
fresh directory of their own: a file of its own so that pytest-xdist (--dist loadfile, one
file per worker) runs these minutes beside the quick starts, not after them."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from tests.test_guide import shell
from tests.test_readme import _check_study, _run_study, commands_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's working directory: fresh, outside the repository."""
    return tmp_path_factory.mktemp("readme-llm")


def test_llm_lora_study(workdir: Path) -> None:
    """The LoRA study of "Fine-tuning a language model": a tiny Llama built from its config,
    its adapters trained on bytes of Python; each trial logs val loss, tokens/s, MFU and the
    prediction error (0 on a CPU: the prediction is the measurement)."""
    (command,) = commands_of("test_llm_lora_study")
    ran = _run_study(command, workdir)
    _check_study(ran, "llm_lora-text")
    assert ran.study.metric_names == ["val/loss", "throughput/tokens_per_sec"]
    # Trained to their end: complete, or pruned as diverged where a few steps left one no
    # better than a uniform guess over the 256 bytes (search/trial/objective.py learning_failure)
    done = [
        t
        for t in ran.study.trials
        if t.state == TrialState.COMPLETE or t.user_attrs.get("reason") == "diverged"
    ]
    assert len(done) == 3 and any(t.state == TrialState.COMPLETE for t in done), ran.out
    searched = {
        "trainer.batch_size", "trainer.accum_steps", "trainer.precision", "data.seq_len",
        "trainer.activation_checkpointing", "model.lora.r", "optimizer.lr",
    }  # fmt: skip
    for t in done:
        assert set(t.params) == searched
        assert 1 <= t.params["trainer.batch_size"] <= 8
        figures = t.user_attrs["metrics"]
        # Below a uniform guess when complete; the first trials are the fit report's largest
        # batches, a few optimizer steps over this text, and one left at chance level is
        # pruned as diverged (test_hf: the tiny models learn; the full study reaches ~3.0).
        if t.state == TrialState.COMPLETE:
            assert math.isfinite(figures["val/loss"]) and figures["val/loss"] < math.log(256)
        else:
            assert t.user_attrs["message"].startswith("did not learn: val/loss")
        # Target tokens: seq_len - 1 of each packed sequence (the task shifts the labels).
        assert figures["throughput/tokens_per_sec"] == pytest.approx(
            figures["throughput/samples_per_sec"] * (t.params["data.seq_len"] - 1), rel=1e-6
        )
        assert t.user_attrs["prediction_error"] == 0.0
    client = MlflowClient(f"sqlite:///{workdir}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name(ran.study.study_name)
    runs = client.search_runs([experiment.experiment_id], "tags.`batchfit.role` = 'trial'")
    completed = [r for r in runs if r.data.tags["batchfit.state"] == "COMPLETE"]
    assert len(completed) == sum(t.state == TrialState.COMPLETE for t in done)
    trained = [
        r for r in runs if r.data.tags.get("batchfit.trial") in {str(t.number) for t in done}
    ]
    assert len(trained) == 3
    for run in trained:  # the diverged one's figures are logged as a complete one's
        metrics = run.data.metrics
        for name in ("val/loss", "throughput/tokens_per_sec", "perf/mfu"):
            assert metrics[name] > 0, name
        assert metrics["memory/prediction_error"] == 0.0
        assert run.data.params["data_info.tokenizer"] == "bytes"


def test_llm_qlora_study(workdir: Path) -> None:
    """The QLoRA study of "Fine-tuning language models": the tiny Llama's linear layers in
    NF4 (bitsandbytes on the CPU) or fp32, searched with the LoRA levers; each trial's
    quantization in its parameters and its MLflow run, its prediction the measurement to the
    byte. Then one run of `python -m train` in NF4, its predicted peak the measured one."""
    study, train = commands_of("test_llm_qlora_study")
    ran = _run_study(study, workdir)
    _check_study(ran, "llm_qlora-text")
    done = [
        t
        for t in ran.study.trials
        if t.state == TrialState.COMPLETE or t.user_attrs.get("reason") == "diverged"
    ]
    assert len(done) == 3 and any(t.state == TrialState.COMPLETE for t in done), ran.out
    for t in done:
        assert t.params["model.quantization"] in {"none", "nf4"}
        assert t.user_attrs["prediction_error"] == 0.0
        assert f"quantization={t.params['model.quantization']}" in ran.out
    client = MlflowClient(f"sqlite:///{workdir}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name(ran.study.study_name)
    runs = client.search_runs([experiment.experiment_id], "tags.`batchfit.role` = 'trial'")
    logged = {r.data.tags["batchfit.trial"]: r.data.params for r in runs}
    for t in done:
        assert logged[str(t.number)]["model.quantization"] == t.params["model.quantization"]

    out = shell(train, workdir, timeout=600).stdout
    assert "Training on cpu: batch 4 x 1 = 4, fp32" in out, out
    predicted = re.search(r"predicted peak ([\d.]+ \w+);", out)
    last = out.splitlines()[-1]
    assert predicted and last.endswith(f"| peak {predicted.group(1)}"), out
    assert re.search(r"^val/acc 0\.\d+ \| val/loss \d\.\d+ \|", last), out
