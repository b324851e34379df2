"""A study's recommendation trained again, as a user runs it: `python -m train +best=PATH`
and the printed `python -m train ...` command, with config groups from the user's own
directory (`--config-dir` or `hydra.searchpath`), in subprocesses; then the Optuna journal
and the MLflow store read back."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from optuna.trial import FrozenTrial

from tests.sweeps import run_module

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# The study of every test but the relative-searchpath one; its config search path (first)
# comes from the command line's --config-dir or hydra.searchpath. model=tiny and
# data=mydigits exist only in the user's directory.
STUDY = [
    "model=tiny",
    "data=mydigits",
    "trainer.max_epochs=1",
    "search.n_trials=3",
    # tiny (small_cnn, width 4) peaks at ~0.66 MB at batch 64, ~2.6 MB at 256 (CPU
    # accounting): 256 is pruned as oom_predicted, 16 and 64 train
    "search.memory_budget=1MiB",
    "mlflow.system_metrics=false",
    "search.objectives=[val/acc,throughput/samples_per_sec]",
    "+search.params={trainer.batch_size:'choice(16,64,256)',"
    "optimizer.lr:'tag(log, interval(0.01, 0.3))'}",
]
# What a run trains with (train/run.py:RunSpec.params), as a trial records it in user_attrs.
TRAINED_WITH = (
    "trainer.batch_size",
    "trainer.accum_steps",
    "trainer.precision",
    "effective_batch_size",
    "lr_scaled",
)
SECTIONS = ("model", "data", "optimizer", "trainer")  # of config.yaml, what a rerun must match
RERUN = "Train it again: "
RERUN_BEST = "or: python -m train +best="
RUN_ID = re.compile(r"MLflow run ([0-9a-f]{32})")


def _line(stdout: str, prefix: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stdout
    return lines[0].removeprefix(prefix)


@dataclass(frozen=True)
class UserConf:
    root: Path  # the working directory: stores under root/mlruns
    path: Path  # root/myconf, absolute and resolved as the search path override gives it

    @property
    def searchpath(self) -> str:
        return f"hydra.searchpath=[file://{self.path}]"

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(f"sqlite:///{self.root}/mlruns/mlflow.db")

    def journal(self) -> optuna.storages.JournalStorage:
        backend = optuna.storages.journal.JournalFileBackend(
            str(self.root / "mlruns" / "optuna.journal")
        )
        return optuna.storages.JournalStorage(backend)


@dataclass(frozen=True)
class Study:
    conf: UserConf
    stdout: str
    best_path: Path
    best: dict
    parent: Run
    trial: FrozenTrial  # the one recommended


@pytest.fixture(scope="module")
def user_conf(tmp_path_factory: pytest.TempPathFactory) -> UserConf:
    """A config directory of the user's, outside the package: a model and a dataset."""
    root = tmp_path_factory.mktemp("rerun").resolve()
    myconf = root / "myconf"
    (myconf / "model").mkdir(parents=True)
    (myconf / "data").mkdir()
    (myconf / "model" / "tiny.yaml").write_text("_target_: train.models.small_cnn\nwidth: 4\n")
    (myconf / "data" / "mydigits.yaml").write_text((REPO / "conf/data/digits.yaml").read_text())
    return UserConf(root, myconf)


@pytest.fixture(scope="module")
def study(user_conf: UserConf) -> Study:
    conf = user_conf
    out = run_module(
        "search", ["--config-dir", str(conf.path), "search.study_name=plug", *STUDY], conf.root
    ).stdout
    shown = Path(_line(out, RERUN_BEST))
    best_path = conf.root / shown
    assert best_path.is_file(), out
    best = yaml.safe_load(best_path.read_text())
    client = conf.client
    runs = client.search_runs([client.get_experiment_by_name("plug").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("batchfit.role") == "study"]
    trial = optuna.load_study(study_name="plug", storage=conf.journal()).trials[best["trial"]]
    return Study(conf, out, shown, best, parent, trial)


def _artifact(client: MlflowClient, run_id: str, path: str, dst: Path) -> str:
    dst.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()


def _trained(client: MlflowClient, stdout: str, dst: Path) -> tuple[Run, dict]:
    """The MLflow run a `python -m train` printed, and its config.yaml."""
    match = RUN_ID.search(stdout)
    assert match, stdout
    run = client.get_run(match.group(1))
    return run, yaml.safe_load(_artifact(client, run.info.run_id, "config.yaml", dst))


def _assert_trains_the_trial(study: Study, run: Run) -> None:
    client = study.conf.client
    assert run.info.experiment_id == client.get_experiment_by_name("train").experiment_id
    assert run.data.tags["batchfit.role"] == "train"
    assert run.data.tags["batchfit.state"] == "COMPLETE"
    trial = study.trial
    expected = {key: str(trial.user_attrs[key]) for key in TRAINED_WITH}
    expected["optimizer.lr"] = str(trial.params["optimizer.lr"])
    assert {key: run.data.params[key] for key in expected} == expected


def test_study_with_a_user_config_dir_prints_and_writes_its_rerun(study: Study) -> None:
    conf, trial = study.conf, study.trial
    command = shlex.split(_line(study.stdout, RERUN))
    assert command[:3] == ["python", "-m", "train"]
    # --config-dir became an explicit, absolute search path, first, in both forms
    assert command[3] == conf.searchpath
    assert study.best["overrides"] == command[3:]
    assert not study.best_path.is_absolute()  # shown relative to the working directory
    assert study.best["study"] == "plug"
    assert study.best["trial"] == trial.number
    for key, value in trial.params.items():
        assert f"{key}={value}" in study.best["overrides"]
    client = conf.client
    assert study.parent.data.tags["batchfit.recommended"] == str(trial.number)
    logged = _artifact(client, study.parent.info.run_id, "best.yaml", conf.root / "logged")
    assert logged == (conf.root / study.best_path).read_text()
    # The trials composed the user's groups: the package's small_cnn is width 32.
    trial_config = _artifact(
        client, trial.user_attrs["mlflow_run_id"], "config.yaml", conf.root / "trial"
    )
    assert yaml.safe_load(trial_config)["model"]["width"] == 4


def test_train_best_yaml_trains_the_recommended_trial_again(study: Study, tmp_path: Path) -> None:
    conf, trial = study.conf, study.trial
    done = run_module("train", [f"+best={study.best_path}"], conf.root)
    run, config = _trained(conf.client, done.stdout, tmp_path / "rerun")
    _assert_trains_the_trial(study, run)
    trial_config = yaml.safe_load(
        _artifact(conf.client, trial.user_attrs["mlflow_run_id"], "config.yaml", tmp_path)
    )
    assert {s: config[s] for s in SECTIONS} == {s: trial_config[s] for s in SECTIONS}
    # Seeded (model init, split and batch order) and the same code path as the trial: the
    # same accuracy, not merely a close one (observed: identical to the last digit on CPU).
    assert run.data.metrics["val/acc"] == pytest.approx(
        trial.user_attrs["metrics"]["val/acc"], abs=1e-6
    )


def test_printed_command_trains_it_from_another_directory(study: Study, tmp_path: Path) -> None:
    conf = study.conf
    command = shlex.split(_line(study.stdout, RERUN))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Only the MLflow store points back; the user's groups come from the absolute search path.
    store = f"mlflow.tracking_uri=sqlite:///{conf.root}/mlruns/mlflow.db"
    done = run_module("train", [*command[3:], store], elsewhere)
    run, config = _trained(conf.client, done.stdout, tmp_path / "rerun")
    _assert_trains_the_trial(study, run)
    assert config["model"]["width"] == 4


def test_a_relative_searchpath_reaches_the_trials_and_best_yaml(user_conf: UserConf) -> None:
    conf = user_conf
    study_args = [a for a in STUDY if not a.startswith("search.n_trials=")]
    # Hydra resolves file://myconf against the working directory; a trial's hydra.compose
    # must get it too, or it fails with "Could not find 'data/mydigits'".
    out = run_module(
        "search",
        ["hydra.searchpath=[file://myconf]", "search.study_name=plugrel", "search.n_trials=2"]
        + study_args,
        conf.root,
    ).stdout
    best = yaml.safe_load((conf.root / _line(out, RERUN_BEST)).read_text())
    assert best["study"] == "plugrel"
    assert best["overrides"][0] == conf.searchpath


def test_train_best_of_a_missing_file_names_the_override(tmp_path: Path) -> None:
    done = run_module("train", ["+best=nowhere/best.yaml"], tmp_path, returncode=2)
    message = " ".join(done.stderr.split())  # rich wraps it to the terminal width
    assert "best='nowhere/best.yaml': no such file" in message
    assert "+best=mlruns/.../best.yaml" in message  # the fix: where a study writes it
    assert not (tmp_path / "mlruns" / "mlflow.db").exists()  # nothing trained or recorded


def test_command_line_overrides_after_best_win(study: Study, tmp_path: Path) -> None:
    conf = study.conf
    done = run_module("train", [f"+best={study.best_path}", "trainer.max_epochs=2"], conf.root)
    run, config = _trained(conf.client, done.stdout, tmp_path)
    assert config["trainer"]["max_epochs"] == 2  # best.yaml says 1
    assert config["trainer"]["batch_size"] == study.trial.params["trainer.batch_size"]
    assert run.data.params["trainer.batch_size"] == str(study.trial.params["trainer.batch_size"])
