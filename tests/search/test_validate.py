"""Bad input stops the study before any trial, with one message per problem naming the key
and the fix, and nothing already recorded is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from rich.console import Console

from search.driver import StudyDriver
from train.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
FAST = ["model=small_cnn", "model.width=4", "data=digits", "trainer.max_epochs=1"]


def _prepare(hydra_conf, overrides: list[str]) -> StudyDriver:
    overrides = [*FAST, "search.study_name=v", *overrides]
    return StudyDriver.prepare(
        hydra_conf(overrides), overrides, {}, Console(record=True, width=200)
    )


CASES = {
    "unknown precision": (
        ["trainer.precision=fp8"],
        r"trainer.precision must be one of fp32, tf32, bf16, fp16, got 'fp8'; "
        r"override with trainer.precision=bf16",
    ),
    "unknown precision in the space": (
        ["+search.params={trainer.precision:'choice(fp32,fp8)'}"],
        r"search.params.trainer.precision: value fp8 is invalid: trainer.precision must be one of",
    ),
    "low > high": (
        ["+search.params={optimizer.lr:'interval(0.5,0.1)'}"],
        r"search.params.optimizer.lr: interval\(0.5,0.1\) has low 0.5 > high 0.1; swap the bounds",
    ),
    "non-positive log bound": (
        ["+search.params={optimizer.lr:'tag(log, interval(0, 0.1))'}"],
        r"search.params.optimizer.lr: .* log scale but its low bound 0.0 is not positive",
    ),
    "batch size 0": (
        ["trainer.batch_size=0"],
        r"trainer.batch_size must be an integer >= 1, got 0; override with trainer.batch_size=1",
    ),
    "batch size 0 in the space": (
        ["+search.params={trainer.batch_size:'choice(0,16)'}"],
        r"search.params.trainer.batch_size: value 0 is invalid: trainer.batch_size must be an "
        r"integer >= 1",
    ),
    "accumulation 0": (
        ["+search.params={trainer.accum_steps:'range(0,4)'}"],
        r"search.params.trainer.accum_steps: value 0 is invalid: trainer.accum_steps must be",
    ),
    "unparsable budget": (
        ["search.memory_budget='8GB?'"],
        r"search.memory_budget: '8GB\?' is not a memory size; use bytes .*8GiB, 512MiB.*90%",
    ),
    "budget below the parameters": (
        # small_cnn(width=4): 1.8 KiB of parameters, x3 with gradients and momentum, plus the
        # BatchNorm buffers
        ["search.memory_budget=1KiB"],
        r"search.memory_budget=1.0 KiB is below the 5.4 KiB that the parameters, gradients and "
        r"optimizer state alone \(predicted\) need; the smallest step \(batch size 1 in fp32\) "
        r"needs \d+\.\d KiB\. Raise it",
    ),
    "unknown search key": (
        ["+search.params={trainer.batchsize:'choice(1,2)'}"],
        r"search.params.trainer.batchsize: 'trainer.batchsize' is not a key of the composed "
        r"config; did you mean trainer.batch_size\?",
    ),
    "storage that cannot be opened": (
        ["search.storage=sqlite:////proc/batchfit/optuna.db"],
        r"search.storage='sqlite:////proc/batchfit/optuna.db' cannot be opened",
    ),
    "unknown objective": (
        ["search.objectives=[val/accuracy]"],
        r"search.objectives: unknown metric 'val/accuracy'; this task reports val/acc, val/loss",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_message(hydra_conf, stores, case: str) -> None:
    overrides, message = CASES[case]
    with pytest.raises(ConfigError, match=message):
        _prepare(hydra_conf, [*stores["overrides"], *overrides])


def test_every_problem_is_reported_at_once(hydra_conf, stores) -> None:
    with pytest.raises(ConfigError) as error:
        _prepare(
            hydra_conf,
            [
                *stores["overrides"],
                "trainer.precision=fp8",
                "search.memory_budget='8GB?'",
                "+search.params={optimizer.lr:'interval(0.5,0.1)'}",
            ],
        )
    text = str(error.value)
    assert "trainer.precision" in text and "search.memory_budget" in text
    assert "search.params.optimizer.lr" in text
    assert len(error.value.problems) == 3


def test_bad_input_loses_nothing_already_recorded(hydra_conf, stores) -> None:
    _prepare(hydra_conf, [*stores["overrides"], "search.n_trials=1"]).run()
    db = Path(stores["optuna"].removeprefix("sqlite:///"))
    before = db.read_bytes()
    with pytest.raises(ConfigError):
        _prepare(hydra_conf, [*stores["overrides"], "search.n_trials=3", "trainer.batch_size=0"])
    assert db.read_bytes() == before
    study = optuna.load_study(study_name="v", storage=stores["optuna"])
    assert len(study.trials) == 1 and study.trials[0].state.name == "COMPLETE"


def _run_search(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    return subprocess.run(
        [sys.executable, "-m", "search", *args, f"search.storage=sqlite:///{tmp_path}/o.db"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_cli_reports_problems_without_traceback(tmp_path: Path) -> None:
    done = _run_search([*FAST, "trainer.precision=fp8", "search.memory_budget=8GB?"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Configuration error" in done.stderr
    assert "trainer.precision must be one of" in done.stderr
    assert "'8GB?' is not a memory size" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.slow
def test_cli_unknown_group_option_uses_hydra_message(tmp_path: Path) -> None:
    done = _run_search(["model=resnet999"], tmp_path)
    assert done.returncode != 0
    assert "Could not find 'model/resnet999'" in done.stderr
    done = _run_search(["+experiment=nope"], tmp_path)
    assert done.returncode != 0
    assert "Could not find 'experiment/nope'" in done.stderr
