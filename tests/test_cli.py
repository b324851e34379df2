"""The `batchfit` console command and the `python -m` names, from a user's folder that holds a
`train.py`, `common/` and `tracking/` of its own (each fails if imported), and a model of
its own for `_target_`: batchfit's modules are never the folder's, the folder's modules are
still found."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHADOWS = {
    "train.py": "raise SystemExit('the user train.py was imported')\n",
    "common/__init__.py": "raise SystemExit('the user common/ was imported')\n",
    "tracking/__init__.py": "raise SystemExit('the user tracking/ was imported')\n",
}
# A model of the user's own, found through _target_ in the working folder
USER_MODEL = """
from torch import nn


def tiny(num_classes: int, in_channels: int = 1) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, num_classes))
"""
FAST = ["data=digits", "trainer.max_epochs=1", "trainer.device=cpu"]


def _command() -> str:
    found = shutil.which("batchfit", path=str(Path(sys.executable).parent))
    assert found, "the batchfit console script is installed beside this Python"
    return found


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ""}  # as a user's shell has it: nothing of the repo
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    for name, text in SHADOWS.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "mymodels.py").write_text(USER_MODEL)
    return tmp_path


def test_help_and_usage_errors(tmp_path: Path) -> None:
    done = _run([_command(), "--help"], tmp_path)
    assert done.returncode == 0 and "usage: batchfit {search,fit,train}" in done.stdout
    for command in ("search", "fit", "train"):
        assert f"  {command}" in done.stdout
    nothing = _run([_command()], tmp_path)
    assert nothing.returncode == 2 and "usage: batchfit" in nothing.stderr
    typo = _run([_command(), "serch"], tmp_path)
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "batchfit: unknown command 'serch'; use one of search, fit, train (batchfit --help)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", ["search", "fit", "train"])
def test_each_subcommand_has_its_help(tmp_path: Path, command: str) -> None:
    done = _run([_command(), command, "--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("batchfit is powered by Hydra")
    assert "== Configuration groups ==" in done.stdout and "experiment:" in done.stdout


@pytest.mark.slow
def test_a_users_folder_runs_the_fit_report_and_a_run_of_its_own_model(user_folder: Path) -> None:
    own = ["model._target_=mymodels.tiny", "~model.width", *FAST]
    fit = _run([_command(), "fit", "model=small_cnn", *own, "search.memory_budget=1GiB"],
               user_folder)  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "Fit report for cpu" in fit.stdout and "largest that fits" in fit.stdout
    # `python -m train` would run the folder's train.py (Python's rule for -m): the command
    run = _run([_command(), "train", "model=small_cnn", *own], user_folder)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "val/acc" in run.stdout + run.stderr


@pytest.mark.slow
def test_the_quick_start_runs_in_a_users_folder(user_folder: Path) -> None:
    """The issue's own command: it printed the user's train.py output, then a traceback."""
    done = _run(
        [sys.executable, "-m", "search", "+experiment=resnet", "data=digits", "search.n_trials=1"],
        user_folder,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Train it again: python -m train +experiment=resnet" in done.stdout
    assert (user_folder / "mlruns" / "mlflow.db").is_file()


def test_a_search_py_in_the_folder_is_what_python_m_search_runs(tmp_path: Path) -> None:
    """Python's rule for -m, which nothing installed can change: the docs say so and
    point to `batchfit search`, which the folder's search.py does not stand in for."""
    (tmp_path / "search.py").write_text("print('the user search.py')\n")
    done = _run([sys.executable, "-m", "search"], tmp_path)
    assert done.stdout.strip() == "the user search.py"
    fit = _run([sys.executable, "-m", "search.fit"], tmp_path)
    assert fit.returncode != 0 and len(fit.stderr.strip().splitlines()) == 1  # Python's line
    ours = _run([_command(), "search", "--help"], tmp_path)
    assert ours.returncode == 0 and "the user search.py" not in ours.stdout
