"""A study's recommendation trained again, as a user runs it: `python -m train +best=PATH`
and the printed `python -m train ...` command, with config groups from the user's own
directory (`--config-dir` or `hydra.searchpath`), in subprocesses; then the Optuna journal
and the MLflow store read back. Also what `python -m train` refuses before training (a run
predicted not to fit), how it names, tags and saves its runs, and that it prints no
password."""

from __future__ import annotations

import http.server
import re
import shlex
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from optuna.trial import FrozenTrial

from batchfit.search.core.record import Attr
from batchfit.tracking.metrics import VAL_ACC
from batchfit.train.build import build_pipeline, build_task
from batchfit.train.measure.evaluate import evaluate
from batchfit.train.memory.fitting import fits_budget
from batchfit.train.model_file import load, rebuild
from batchfit.train.params import EFFECTIVE_PARAM, LR_PARAM, LR_REF_PARAM, LR_RULE_PARAM
from batchfit.train.plan import plan
from batchfit.train.precision import Precision
from batchfit.train.workload import Workloads
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
    (myconf / "model" / "tiny.yaml").write_text(
        "_target_: batchfit.train.models.small_cnn\nwidth: 4\n"
    )
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


def _geometry(trial: FrozenTrial) -> str:
    """A run's configuration as its name gives it: batch x accumulation precision."""
    attrs = trial.user_attrs
    return (
        f"{attrs['trainer.batch_size']}x{attrs['trainer.accum_steps']} {attrs['trainer.precision']}"
    )


def _assert_trains_the_trial(study: Study, run: Run, experiment: str) -> None:
    client = study.conf.client
    assert run.info.experiment_id == client.get_experiment_by_name(experiment).experiment_id
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
        client, trial.user_attrs[Attr.RUN_ID], "config.yaml", conf.root / "trial"
    )
    assert yaml.safe_load(trial_config)["model"]["width"] == 4


def test_train_best_yaml_trains_the_recommended_trial_again(study: Study, tmp_path: Path) -> None:
    conf, trial = study.conf, study.trial
    done = run_module("train", [f"+best={study.best_path}"], conf.root)
    run, config = _trained(conf.client, done.stdout, tmp_path / "rerun")
    # In the study's experiment, beside the trial it retrains, named and tagged after it.
    _assert_trains_the_trial(study, run, "plug")
    assert run.info.run_name == f"retrain trial-{trial.number} of plug · {_geometry(trial)}"
    assert run.data.tags["batchfit.study"] == "plug"
    assert run.data.tags["batchfit.trial"] == str(trial.number)
    # The study's lr_scaling is auto: linear for SGD, from the reference batch the study
    # fixed at its command line's (trainer.batch_size=32): the rate the trial trained with.
    lr, effective = trial.params["optimizer.lr"], trial.user_attrs[EFFECTIVE_PARAM]
    assert trial.user_attrs[LR_PARAM] == pytest.approx(lr * effective / 32)
    assert trial.user_attrs[LR_RULE_PARAM] == "linear" and trial.user_attrs[LR_REF_PARAM] == 32
    assert (
        f"lr {lr * effective / 32:.4g} (optimizer.lr={lr:g} scaled linear (auto: the "
        f"optimizer's) to effective batch {effective} from trainer.lr_ref_batch_size=32)"
    ) in done.stdout
    trial_config = yaml.safe_load(
        _artifact(conf.client, trial.user_attrs[Attr.RUN_ID], "config.yaml", tmp_path)
    )
    assert {s: config[s] for s in SECTIONS} == {s: trial_config[s] for s in SECTIONS}
    # Seeded (model init, split and batch order) and the same code path as the trial: the
    # same accuracy, not merely a close one (observed: identical to the last digit on CPU).
    assert run.data.metrics[VAL_ACC] == pytest.approx(
        trial.user_attrs[Attr.METRICS][VAL_ACC], abs=1e-6
    )


def test_printed_command_trains_it_from_another_directory(study: Study, tmp_path: Path) -> None:
    conf = study.conf
    command = shlex.split(_line(study.stdout, RERUN))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Only the MLflow store points back; the user's groups come from the absolute search path.
    store = f"mlflow.tracking_uri=sqlite:///{conf.root}/mlruns/mlflow.db"
    done = run_module("train", [*command[3:], store, "+save=models/tiny.pt"], elsewhere)
    run, config = _trained(conf.client, done.stdout, tmp_path / "rerun")
    # Without +best it retrains no known trial: experiment "train", named by its configuration.
    _assert_trains_the_trial(study, run, "train")
    assert run.info.run_name == _geometry(study.trial)
    assert "batchfit.study" not in run.data.tags and "batchfit.trial" not in run.data.tags
    assert config["model"]["width"] == 4
    # The trained model: the run's artifact, and the same bytes where +save said.
    downloaded = conf.client.download_artifacts(run.info.run_id, "model/model.pt", str(tmp_path))
    artifact = Path(downloaded).read_bytes()
    assert (elsewhere / "models" / "tiny.pt").read_bytes() == artifact
    saved = load(downloaded)
    assert saved.overrides == [*command[3:], store, "+save=models/tiny.pt"]
    model = rebuild(saved)  # a fresh small_cnn of width 4, built from the saved config
    assert model.state_dict().keys() == saved.state_dict.keys()
    assert all(torch.equal(t, saved.state_dict[k]) for k, t in model.state_dict().items())
    # ... holding the trained weights: it scores the run's last validation again.
    cfg = saved.config
    acc = evaluate(
        model,
        build_pipeline(cfg, torch.device("cpu")),
        cfg.trainer.batch_size,
        Precision(cfg.trainer.precision, "cpu"),
        torch.device("cpu"),
        build_task(cfg),
    )[VAL_ACC]
    assert acc == pytest.approx(run.data.metrics[VAL_ACC], abs=1e-6)


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
    scaling = ["trainer.lr_scaling=linear", "trainer.lr_ref_batch_size=128"]
    done = run_module(
        "train", [f"+best={study.best_path}", "trainer.max_epochs=2", *scaling], conf.root
    )
    run, config = _trained(conf.client, done.stdout, tmp_path)
    assert config["trainer"]["max_epochs"] == 2  # best.yaml says 1
    assert config["trainer"]["batch_size"] == study.trial.params["trainer.batch_size"]
    assert run.data.params["trainer.batch_size"] == str(study.trial.params["trainer.batch_size"])
    # The scaled rate, said with its rule and both batches (the study's is unscaled).
    base = study.trial.params["optimizer.lr"]
    effective = study.trial.user_attrs[EFFECTIVE_PARAM]
    scaled = base * effective / 128
    assert float(run.data.params["lr_scaled"]) == pytest.approx(scaled)
    assert (
        f"lr {scaled:.4g} (optimizer.lr={base:g} scaled linear to effective batch {effective} "
        "from trainer.lr_ref_batch_size=128)"
    ) in done.stdout


# The command of the report (python -m train on the CPU with conf/budget/resnet18_digits.yaml's
# simulated 160 MiB): predicted 167.2 MiB, it trained for minutes before its OOM.
ISSUE = [
    "+experiment=resnet", "data=digits", "trainer.batch_size=64", "trainer.accum_steps=2",
    "trainer.precision=bf16", "optimizer.lr=0.05", "trainer.device=cpu",
]  # fmt: skip
REFUSED = re.compile(
    r"predicted to peak at ([\d.]+) MiB; with search\.preflight_margin=0\.05 that is ([\d.]+) "
    r"MiB, over search\.memory_budget=160\.0 MiB"
)
FITS = re.compile(r"What fits in bf16: trainer\.batch_size=(\d+) trainer\.accum_steps=(\d+)")


def test_train_refuses_a_run_predicted_not_to_fit(
    tmp_path: Path, hydra_conf: Callable[..., DictConfig]
) -> None:
    # trainer.max_steps=1: were it not refused, it would end in seconds, not minutes (bf16)
    done = run_module("train", [*ISSUE, "trainer.max_steps=1"], tmp_path, returncode=2)
    message = " ".join(done.stderr.split())  # rich wraps it to the terminal width
    numbers = REFUSED.search(message)
    assert numbers, message
    assert float(numbers.group(1)) * 1.05 == pytest.approx(float(numbers.group(2)), abs=0.1)
    assert float(numbers.group(2)) > 160
    assert "nothing was trained" in message
    assert "to train it anyway (a real OOM may end it), add search.preflight=false" in message
    assert not (tmp_path / "mlruns" / "mlflow.db").exists()  # no run, not even a failed one
    # What it offers instead is predicted to fit, by the rule a trial is checked by.
    offered = FITS.search(message)
    assert offered, message
    batch, accum = offered.groups()
    assert int(batch) * int(accum) == 128  # first: the same effective batch
    cfg = hydra_conf([*ISSUE, f"trainer.batch_size={batch}", f"trainer.accum_steps={accum}"])
    spec = plan(cfg, cfg.search.memory_budget)
    predicted = Workloads().of(cfg).predict(spec, cfg.optimizer).peak_bytes
    assert fits_budget(predicted, spec.budget_bytes, 0.05)


def test_train_forced_past_the_check_says_so_and_meets_the_real_oom(tmp_path: Path) -> None:
    # small_cnn of width 4 at batch 256 peaks at ~2.6 MB (CPU accounting, as in STUDY)
    args = [
        "model=small_cnn", "model.width=4", "data=digits", "trainer.batch_size=256",
        "trainer.device=cpu", "search.memory_budget=1MiB", "mlflow.system_metrics=false",
    ]  # fmt: skip
    refused = run_module("train", args, tmp_path, returncode=2)
    assert "nothing was trained" in " ".join(refused.stderr.split())
    forced = run_module("train", [*args, "search.preflight=false"], tmp_path, returncode=1)
    said = " ".join(forced.stdout.split())
    assert "trained anyway, as search.preflight=false says" in said
    assert "over search.memory_budget=1.0 MiB" in said
    assert forced.stderr.startswith("oom: "), forced.stderr  # the CPU meter's real OOM


class _Unauthorized(http.server.BaseHTTPRequestHandler):
    """A tracking server that refuses the credentials it is given (HTTP 401)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def refusing_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unauthorized)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_train_configuration_errors_print_no_password(tmp_path: Path, refusing_server: str) -> None:
    args = [
        "model=small_cnn", "model.width=4", "data=digits", "trainer.max_steps=1",
        f"mlflow.tracking_uri=http://batchfit:s3cret-pw@{refusing_server}",
    ]  # fmt: skip
    done = run_module("train", args, tmp_path, returncode=2)
    said = done.stdout + done.stderr
    assert "s3cret-pw" not in said
    message = " ".join(done.stderr.split())
    assert message.startswith("Configuration error"), said
    assert f"mlflow.tracking_uri='http://batchfit:***@{refusing_server}' cannot be used" in message
    assert "Traceback" not in said
    for saved in (tmp_path / "mlruns").rglob("*"):  # Hydra's .hydra/ files and job log
        assert not saved.is_file() or "s3cret-pw" not in saved.read_text(errors="replace")
