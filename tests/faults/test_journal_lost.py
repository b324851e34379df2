"""The study's journal deleted, replaced or truncated under a running study: the study stops
once, with a message and no traceback; the old file's records are kept beside it; every trial's
MLflow run ends (none left RUNNING, none repeated); a new study of the same name is refused
instead of nesting its trials under the old one's parent run; and the records put back, the
same command resumes the study."""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from batchfit.search.storage.journal import RECOVERED_SUFFIX, JournalLost, SafeJournalFileBackend
from batchfit.search.storage.opening import open_storage
from tests.faults.study import NAME, STUDY, journal_of, run_study, start_study
from tests.sweeps import journal_study, training, wait_for_trial

LONGER = [*STUDY, "trainer.max_epochs=30"]  # trials of seconds: the journal goes inside one
RECORD = [{"op_code": 0, "worker_id": "w", "study_name": "t", "directions": [1]}]


def _backend_with_a_study(journal: Path) -> tuple[SafeJournalFileBackend, bytes]:
    storage = open_storage(f"journal:{journal}", None)
    optuna.create_study(study_name="s", storage=storage).optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=2
    )
    return storage._backend, journal.read_bytes()


def _recovered(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{RECOVERED_SUFFIX}*"))


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_vanished_journal_is_refused_and_its_records_kept_beside_it(
    tmp_path: Path, how: str
) -> None:
    journal = tmp_path / "optuna.journal"
    backend, before = _backend_with_a_study(journal)
    if how == "deleted":
        journal.unlink()
    else:  # another file renamed over it, as an editor or a copy back from elsewhere does
        other = tmp_path / "other"
        other.write_bytes(before[: len(before) // 2])
        other.replace(journal)
    with pytest.raises(JournalLost, match=f"was {how}.*the study stops here") as lost:
        list(backend.read_logs(0))
    with pytest.raises(JournalLost) as again:  # said and recovered once
        backend.append_logs(RECORD)
    assert again.value is lost.value
    assert _recovered(tmp_path) == [lost.value.recovered]
    assert lost.value.recovered.read_bytes() == before
    assert f"mv {lost.value.recovered} {journal}" in str(lost.value)


def test_a_journal_truncated_below_the_records_read_is_refused(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.journal"
    backend, before = _backend_with_a_study(journal)
    journal.write_bytes(before[:10])  # the same file, cut (`> optuna.journal`, a bad copy)
    with pytest.raises(JournalLost, match="was truncated .*records before the cut are gone"):
        backend.append_logs(RECORD)
    assert journal.read_bytes() == before[:10]  # nothing appended at a wrong offset


def test_a_torn_tail_cut_by_a_writer_is_not_a_lost_journal(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.journal"
    backend, before = _backend_with_a_study(journal)
    with journal.open("ab") as f:
        f.write(b'{"op_code":5,"worker_id":"a-writer-killed-he')
    backend.append_logs(RECORD)  # cuts the torn tail (shorter), reads on
    assert len(list(backend.read_logs(0))) == before.count(b"\n") + 1


def _runs(cwd: Path) -> list:
    client = MlflowClient(f"sqlite:///{cwd}/mlruns/mlflow.db")
    return client.search_runs([client.get_experiment_by_name(NAME).experiment_id])


@pytest.mark.slow
def test_a_journal_deleted_mid_study_stops_it_once_then_resumes_when_put_back(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "mlruns" / "optuna.journal"
    process = start_study(tmp_path, LONGER)
    running = wait_for_trial(
        lambda: journal_study(journal, NAME), training(1), alive=lambda: process.poll() is None
    )
    journal.unlink()
    out, err = process.communicate(timeout=300)
    assert process.returncode == 1, out[-3000:] + err[-3000:]
    assert "Storage error" in err and "was deleted while the study ran" in err
    assert "Traceback" not in out + err and "constraint value is ignored" not in out + err
    (recovered,) = _recovered(journal.parent)
    runs = _runs(tmp_path)
    trials = [r.data.tags["batchfit.trial"] for r in runs if "batchfit.trial" in r.data.tags]
    assert sorted(trials) == ["0", str(running.number)]  # each trial's run once
    assert all(r.info.status != "RUNNING" for r in runs)

    # The same command with the journal gone: refused before any trial, nothing added.
    refused = run_study(tmp_path, LONGER, returncode=2)
    assert f"search.study_name={NAME}: MLflow" in refused.stderr
    assert f"mv {recovered} {journal}" in refused.stderr
    assert f"search.study_name={NAME}-2" in refused.stderr
    assert len(_runs(tmp_path)) == len(runs)

    shutil.move(recovered, journal)
    run_study(tmp_path, LONGER)
    study = journal_of(tmp_path)
    assert study.trials[0].state == TrialState.COMPLETE
    assert len([t for t in study.trials if t.state == TrialState.COMPLETE]) == 2
    runs = _runs(tmp_path)
    assert len([r for r in runs if r.data.tags.get("batchfit.role") == "study"]) == 1
    assert all(r.info.status != "RUNNING" for r in runs)
