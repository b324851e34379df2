"""The "Bring your own training" guide (docs/byo.md), run exactly as written: its files are
written to a fresh directory outside the package, its commands run there in a shell, and
each study's printed rerun command trains the recommended configuration again."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from tests.faults import forkserver

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "byo.md"  # the whole page is the guide
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)
RERUN = "Train it again: "
# "Recommended: trial 3, ..." or, for a fit report cell no trial trained, "Recommended:
# 64x2 fp32, ... its learning rate is trial 3's ...": the trial is the (last) group
RECOMMENDED = re.compile(r"Recommended: (?:trial |\S+ .*?its learning rate is trial )(\d+)")


def guide_blocks() -> list[tuple[str, str]]:
    """(language, text) of every code block of the guide, in order."""
    return BLOCK.findall(GUIDE.read_text())


# Outside quotes, these make bash do more than split words (expansions, globs, operators).
SHELL_SYNTAX = set("$`\\*?[{~!&|;<>()#\n")


def python_module(command: str) -> list[str] | None:
    """[MODULE, *ARGS] of `python -m MODULE ARGS` where bash would only split it into words
    (no unquoted expansion, glob or operator); None for any other command."""
    quote = ""
    for char in command:
        if quote:
            if quote == '"' and char in "$`\\":  # expanded within double quotes too
                return None
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in SHELL_SYNTAX:
            return None
    words = shlex.split(command)
    if len(words) < 3 or words[:2] != ["python", "-m"]:
        return None
    return words[2:]


def shell(command: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """A command as a user types it: bash, `python` the test's interpreter, the repository
    not on the import path (batchfit is installed). `python -m MODULE ARGS` where bash would
    only split its words runs as a child of tests/faults/forkserver.py (the same argv, cwd
    and environment, without 10-30 s of imports each; BATCHFIT_FORKSERVER=0: a fresh python -m)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    module = python_module(command)
    if module is not None:  # (forkserver.run itself honours BATCHFIT_FORKSERVER=0)
        done = forkserver.run(module[0], module[1:], cwd, env, timeout)
    else:
        done = subprocess.run(
            ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    assert done.returncode == 0, f"$ {command}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The guide's files written where their first line says, and its commands."""
    root = tmp_path_factory.mktemp("guide")
    commands = []
    for language, text in guide_blocks():
        if language == "bash":
            commands.append(text.replace("\\\n", " ").strip())
            continue
        first = text.splitlines()[0]
        assert first.startswith("# "), f"a file block names its path first: {first!r}"
        path = root / first.removeprefix("# ").strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert (root / "myproject" / "signals.py").is_file()
    assert (root / "myconf" / "task" / "focal.yaml").is_file()
    assert len(commands) == 2, commands
    return root, commands


def _study(root: Path, out: str) -> optuna.Study:
    name = re.search(r"^Study (\S+):", out, re.M).group(1)
    storage = JournalStorage(JournalFileBackend(str(root / "mlruns" / "optuna.journal")))
    return optuna.load_study(study_name=name, storage=storage)


def _rerun(root: Path, out: str, metric: str) -> tuple[float, float]:
    """The recommended trial's `metric`, and the one its printed rerun command measured."""
    study = _study(root, out)
    trial = study.trials[int(RECOMMENDED.search(out).group(1))]
    command = next(line for line in out.splitlines() if line.startswith(RERUN))
    command = command.removeprefix(RERUN)
    assert "hydra.searchpath=" in command and "--config-dir" not in command
    again = shell(command, root)
    # python -m train ends with "val/acc 0.9720 | val/top2 ... | ..."
    value = re.search(rf"{re.escape(metric)} ([0-9.]+)", again.stdout.splitlines()[-1])
    assert value, again.stdout
    return trial.user_attrs["metrics"][metric], float(value.group(1))


def test_own_dataset_and_model(project: tuple[Path, list[str]]) -> None:
    root, commands = project
    out = shell(commands[0], root).stdout
    study = _study(root, out)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4, out
    # Dict samples through a DataLoader with 2 workers; the signal is learnable.
    assert max(t.user_attrs["metrics"]["val/acc"] for t in done) > 0.6
    for t in done:
        assert 0 <= t.user_attrs["metrics"]["time/data_wait_share"] < 1
    client = MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name(study.study_name)
    runs = client.search_runs([experiment.experiment_id], "tags.`batchfit.role` = 'trial'")
    assert len(runs) == 4
    for run in runs:
        config = yaml.safe_load(
            Path(client.download_artifacts(run.info.run_id, "config.yaml")).read_text()
        )
        assert config["loader"]["num_workers"] == 2
        assert config["model"]["_target_"] == "myproject.signals.ConvNet"
        assert "time/data_wait_share" in run.data.metrics
    recorded, again = _rerun(root, out, "val/acc")
    assert again == pytest.approx(recorded, abs=1e-4)


def test_own_loss_and_metric(project: tuple[Path, list[str]]) -> None:
    root, commands = project
    out = shell(commands[1], root).stdout
    study = _study(root, out)
    assert study.metric_names == ["val/top2", "throughput/samples_per_sec"]
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done, out
    for t in done:
        figures = t.user_attrs["metrics"]
        assert t.values[0] == figures["val/top2"]
        assert figures["val/top2"] >= figures["val/acc"]  # top-2 counts every top-1 hit
    assert "val/top2 is within" in out
    recorded, again = _rerun(root, out, "val/top2")
    assert again == pytest.approx(recorded, abs=1e-4)


def test_unknown_objective_is_refused_with_the_task_metrics(
    project: tuple[Path, list[str]],
) -> None:
    root, _ = project
    command = (
        "python -m search --config-dir myconf task=focal model=small_cnn data=digits "
        "'search.objectives=[val/top3]'"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        shlex.split(command), cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stdout + done.stderr
    message = done.stdout + done.stderr
    assert "search.objectives: unknown metric 'val/top3'" in message
    assert "val/acc, val/top2, val/loss" in message
    assert "Configuration error" in message and "#0" not in message  # before any trial
