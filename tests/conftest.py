"""Shared fixtures: the real Hydra config, composed in-process, and outputs under tmp_path."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

# A tiny, fast setup: small CNN on scikit-learn's digits, one epoch.
FAST = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=1",
    "trainer.batch_size=64",
    "trainer.device=cpu",
]


# `pytest` runs the suite on pytest-xdist workers (pyproject's addopts: -n auto, one file
# per worker at a time): most of a test's time is a subprocess's imports, SQLite and MLflow
# calls, waits on servers and SLURM, which leave a core idle. A worker's own torch takes its
# share of the cores (subprocesses plan theirs: train/parallel/threads.py), not every core each.
MAX_WORKERS = 4  # each holds a torch, MLflow and Optuna process, ~1.5 GB


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    from batchfit.train.parallel.threads import usable_cores

    return max(1, min(usable_cores(), MAX_WORKERS))


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" in os.environ and workers > 1:
        from batchfit.train.parallel.threads import usable_cores

        torch.set_num_threads(max(1, usable_cores() // workers))


# The files that take longest (minutes, on 2 cores beside another worker), started first so
# that no worker is left with one of them at the end while the other idles.
LONGEST_FIRST = (
    "tests/test_readme.py",  # 15-25: the quick starts and every README command but
    "tests/test_readme_llm.py",  # 6-9: the LoRA and QLoRA studies
    "tests/cluster/test_slurm.py",  # 7
    "tests/faults/test_journal.py",  # 6.5 with all of its kill chain; split in two files:
    "tests/faults/test_journal_kills.py",  # each about 3
    "tests/search/test_driver.py",  # 5
    "tests/test_workers.py",  # 5
    "tests/test_end_to_end.py",  # 3.5
    "tests/test_cli.py",  # 2: the quick start from a user's folder, the subcommands' help
    "tests/test_python_guide.py",  # 1.5: docs/python.md as one script
    "tests/test_browser.py",  # 3.3
    "tests/test_guide.py",  # 3
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.relative_to(REPO).as_posix()
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def hydra_conf() -> Iterator[Callable[..., DictConfig]]:
    """compose(overrides) with conf/ initialised, as the entry points see it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):

        def _compose(overrides: list[str] | None = None) -> DictConfig:
            return compose(config_name="config", overrides=list(overrides or []))

        yield _compose


@pytest.fixture
def prepare_study(hydra_conf: Callable[..., DictConfig]) -> Callable[..., object]:
    """prepare(overrides, width=200): the StudyDriver `python -m search model=small_cnn
    data=digits OVERRIDES` would run, in this process, printing to a recording console
    (`driver.console.export_text()` is what it said)."""
    from rich.console import Console

    from batchfit.search.study.driver import StudyDriver

    def prepare(overrides: list[str], width: int = 200) -> StudyDriver:
        console = Console(record=True, width=width)
        choices = {"model": "small_cnn", "data": "digits"}
        return StudyDriver.prepare(hydra_conf(overrides), overrides, choices, console)

    return prepare


@pytest.fixture(scope="session")
def mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, made once by MLflow itself: its ~40 schema migrations
    take 2-3 s, which every test that opens a store of its own would pay again."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()  # creates and migrates it
    return path


@pytest.fixture
def stores(tmp_path: Path, mlflow_db: Path) -> dict:
    """Optuna and MLflow stores under tmp_path, and the overrides that select them. The
    MLflow store starts as a copy of `mlflow_db` (an empty store at MLflow's schema)."""
    optuna_url = f"sqlite:///{tmp_path}/optuna.db"
    mlflow_url = f"sqlite:///{tmp_path}/mlflow.db"
    shutil.copyfile(mlflow_db, tmp_path / "mlflow.db")
    artifacts = str(tmp_path / "artifacts")
    return {
        "optuna": optuna_url,
        "mlflow": mlflow_url,
        "artifacts": artifacts,
        "overrides": [
            f"search.storage={optuna_url}",
            f"mlflow.tracking_uri={mlflow_url}",
            f"mlflow.artifact_root={artifacts}",
        ],
    }
