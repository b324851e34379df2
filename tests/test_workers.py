"""Several workers on one study, on one machine, as a user runs them: Hydra's joblib and
submitit_local launchers, workers killed with SIGKILL mid-trial, a tracking server that goes
away mid-study, and a password that must not show anywhere. Stores are read back after."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.core.record import Attr
from batchfit.search.results.speed_check import SPEED_ATTR
from batchfit.search.storage.owners import OWNER_ATTR
from batchfit.search.study.decision import DECISION_ATTR
from tests.sweeps import (
    FINISHED,
    MlflowServer,
    check_stores,
    finish,
    journal_study,
    search_process,
    training,
    wait_for_trial,
)

pytestmark = pytest.mark.slow

SPACE = (
    "+search.params={trainer.batch_size:'choice(32,64)',"
    "optimizer.lr:'tag(log, interval(0.01, 0.3))'}"
)
STUDY = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.max_epochs=2",
    "search.study_name=w",
    SPACE,
]


def test_joblib_workers_share_one_study(tmp_path: Path) -> None:
    # joblib runs as many jobs at once as there are CPUs (n_jobs=-1): 2 here.
    args = [
        "--multirun", "hydra/launcher=joblib", "hydra.launcher.n_jobs=3", "search.workers=3",
        "search.n_trials=6",
    ]  # fmt: skip
    out, _ = finish(search_process([*args, *STUDY], tmp_path))
    study = journal_study(tmp_path / "mlruns" / "optuna.journal", "w")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    check_stores(study, client, 6)
    # Three processes ran trials (each records its owner), as three Hydra jobs of one sweep.
    owners = {t.system_attrs[OWNER_ATTR]["pid"] for t in study.trials if t.state in FINISHED}
    assert len(owners) == 3
    sweep = next((tmp_path / "mlruns" / "hydra" / "multirun").glob("*/*"))
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2"]
    # Nothing identifies a worker in what a user reruns or in what the study fixes.
    reruns = [line for line in out.splitlines() if line.startswith("Train it again: ")]
    assert len(reruns) == 3 and all("worker" not in line for line in reruns)
    fixed = yaml.safe_load(study.user_attrs["batchfit.config"])
    assert "worker" not in fixed and "workers" not in fixed["search"]
    assert fixed["loader"]["num_workers"] == 0  # the data loader's: the same for every worker


def test_two_workers_give_one_answer(tmp_path: Path) -> None:
    """The issue's case: two workers of one study end together (the study's two trials,
    one each). The recommendation and its speed check are made once, by one of them; both
    print that answer, and both best.yaml files and the parent run's are the same bytes."""
    args = [
        "--multirun", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "search.workers=2",
        "search.n_trials=2", "model=small_cnn", "model.width=4", "data=digits",
        "trainer.max_epochs=1", "search.study_name=one", "mlflow.system_metrics=false",
        # Two configurations, one each, both candidates: two geometries for the speed check.
        "search.recommend.tolerance=1.0", "search/sampler=grid",
        "+search.params={trainer.batch_size:'choice(16,64)'}",
    ]  # fmt: skip
    out, _ = finish(search_process(args, tmp_path))
    study = journal_study(tmp_path / "mlruns" / "optuna.journal", "one")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    check_stores(study, client, 2, num_epochs=1)
    assert {t.params["trainer.batch_size"] for t in study.trials} == {16, 64}
    assert len(set(study.user_attrs[SPEED_ATTR]["geometries"])) == 2
    assert out.count("Speed check: timing 2 candidate configurations") == 1, out
    assert out.count("The recommendation was made by another worker of this study") == 1
    answers = re.findall(r"^Recommended: trial (\d+)", out, re.MULTILINE)
    assert len(answers) == 2 and answers[0] == answers[1], out
    assert study.user_attrs[DECISION_ATTR]["trial"] == int(answers[0])
    sweep = next((tmp_path / "mlruns" / "hydra" / "multirun").glob("*/*"))
    written = [(sweep / job / "best.yaml").read_text() for job in ("0", "1")]
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("one").experiment_id], "tags.`batchfit.role` = 'study'"
    )
    logged = Path(client.download_artifacts(parent.info.run_id, "best.yaml", str(tmp_path)))
    assert written[0] == written[1] == logged.read_text()
    assert f"trial: {answers[0]}\n" in written[0]


def test_single_process_killed_mid_trial_resumes_and_reruns_that_trial(tmp_path: Path) -> None:
    """The issue's case: SIGKILL during trial 2 of a one-process study, then the same
    command again at once (well inside the 120 s heartbeat grace)."""
    args = [*STUDY, "search.n_trials=4"]
    journal = tmp_path / "mlruns" / "optuna.journal"
    first = search_process(args, tmp_path)
    victim = wait_for_trial(
        lambda: journal_study(journal, "w"),
        lambda t: t.number == 2 and t.state == TrialState.RUNNING and Attr.RUN_ID in t.user_attrs,
        alive=lambda: first.poll() is None,
    )
    first.send_signal(signal.SIGKILL)
    finish(first, expect_rc=None)
    assert journal_study(journal, "w").trials[2].state == TrialState.RUNNING  # as left

    out, _ = finish(search_process(args, tmp_path))
    assert "#2   KILLED: its worker died; its parameters run again" in out
    study = journal_study(journal, "w")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    check_stores(study, client, 4)
    assert study.trials[2].state == TrialState.FAIL
    (retry,) = [t for t in study.trials if t.system_attrs.get("failed_trial") == 2]
    assert retry.params == victim.params
    assert client.get_run(victim.user_attrs[Attr.RUN_ID]).info.status == "KILLED"


def test_submitit_local_worker_killed_mid_trial(tmp_path: Path) -> None:
    """Two workers through Hydra's submitit_local launcher; one is killed with SIGKILL in its
    second trial. The other runs that trial again and completes the study."""
    args = [
        "--multirun", "hydra/launcher=submitit_local", "search.workers=2", "search.n_trials=6",
        "hydra.launcher.timeout_min=10", *STUDY,
    ]  # fmt: skip
    journal = tmp_path / "mlruns" / "optuna.journal"
    sweep = search_process(args, tmp_path)
    victim = wait_for_trial(
        lambda: journal_study(journal, "w"),
        training(first=2),
        alive=lambda: sweep.poll() is None,
    )
    subprocess.run(["kill", "-9", str(victim.system_attrs[OWNER_ATTR]["pid"])], check=True)
    _, err = finish(sweep, expect_rc=None)  # the killed job fails the sweep; the study does not
    assert sweep.returncode != 0
    study = journal_study(journal, "w")
    check_stores(study, MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db"), 6)
    assert study.trials[victim.number].state == TrialState.FAIL
    (retry,) = [t for t in study.trials if t.system_attrs.get("failed_trial") == victim.number]
    assert retry.system_attrs[OWNER_ATTR]["pid"] != victim.system_attrs[OWNER_ATTR]["pid"]


def test_tracking_server_outage_loses_nothing_and_no_password_shows(tmp_path: Path) -> None:
    """A study logs to an MLflow server whose URI carries a password. The server goes away
    during trial 1 and comes back after trial 3 has finished; every record arrives, and the
    password is nowhere: console, Hydra's files, MLflow, the study."""
    secret = "s3cret-Pw"
    server = MlflowServer(f"sqlite:///{tmp_path}/server.db", tmp_path)
    server.start()
    uri = f"http://batchfit:{secret}@127.0.0.1:{server.port}"
    journal = tmp_path / "mlruns" / "optuna.journal"
    args = [*STUDY, "search.n_trials=5", f"mlflow.tracking_uri={uri}"]
    study_process = search_process(args, tmp_path)
    try:
        wait_for_trial(
            lambda: journal_study(journal, "w"),
            lambda t: t.number == 1 and t.state == TrialState.RUNNING,
            alive=lambda: study_process.poll() is None,
        )
        server.stop()
        wait_for_trial(
            lambda: journal_study(journal, "w"),
            lambda t: t.number == 3 and t.state in FINISHED,
            alive=lambda: study_process.poll() is None,
        )
        server.start()
        out, err = finish(study_process)
    finally:
        study_process.kill()
    try:
        client = MlflowClient(server.url)
        check_stores(journal_study(journal, "w"), client, 5, outage=True)
        texts = [out, err, journal.read_text()]
        texts += [p.read_text() for p in (tmp_path / "mlruns" / "hydra").rglob("*") if p.is_file()]
        for run in client.search_runs([client.get_experiment_by_name("w").experiment_id]):
            texts += [str(run.data.params), str(run.data.tags)]
            # Every artifact, plots included (binary ones read as bytes).
            local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "a")))
            texts += [
                f.read_bytes().decode("utf-8", "replace") for f in local.rglob("*") if f.is_file()
            ]
    finally:
        server.stop()
    leaks = [line for t in texts for line in t.splitlines() if secret in line]
    assert not leaks
    assert "batchfit:***@127.0.0.1" in out  # the URI is shown, masked
    assert "records queued; the study goes on" in out
    assert "MLflow reachable again: the queued records are written" in out
    configs = [t for t in texts if "tracking_uri: http://batchfit:***@" in t]
    assert configs  # the trials' config.yaml artifacts and Hydra's saved config, masked


def test_submitit_local_workers_say_where_their_output_and_the_answer_are(
    tmp_path: Path,
) -> None:
    """The submitit workers print into files: the launching command says which, the
    study's one answer and the best.yaml files, once they are done."""
    args = [
        "--multirun", "hydra/launcher=submitit_local", "search.workers=2", "search.n_trials=2",
        "hydra.launcher.timeout_min=10", *STUDY,
    ]  # fmt: skip
    out, _ = finish(search_process(args, tmp_path))
    logs = re.findall(r"^  (\S+/\.submitit/\S+_log\.out)$", out, re.MULTILINE)
    assert len(logs) == 2, out
    study = journal_study(tmp_path / "mlruns" / "optuna.journal", "w")
    decided = study.user_attrs[DECISION_ATTR]
    header = decided["best_yaml"].splitlines()[0].removeprefix("# ")
    assert f"Study w, answered once by the worker on {decided['made_by']}: {header}" in out
    for log in logs:  # each worker printed that same answer into its file
        assert header.split(": ", 1)[1][:60] in (tmp_path / log).read_text()
    written = re.findall(r"^  best.yaml: (\S+)$", out, re.MULTILINE)
    assert len(written) == 2
    assert {(tmp_path / w).read_text() for w in written} == {decided["best_yaml"]}
    assert f"Train it again: python -m train +best={written[0]}" in out
