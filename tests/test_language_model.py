"""The bundled language model (`+experiment=gpt`) and an ImageFolder read by DataLoader
workers, as a user runs them: `python -m search` / `python -m train` in subprocesses, then
the Optuna journal and the MLflow store read back."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState
from PIL import Image

from tests.sweeps import run_module

pytestmark = pytest.mark.slow

# The experiment on a tenth of its text, so that each trial takes a second or two.
GPT = [
    "+experiment=gpt",
    "data.max_bytes=24000",  # ~750 sequences of 32 bytes: enough to learn below uniform
    "search.n_trials=4",
    "mlflow.system_metrics=false",
    "search.speed_check=false",  # tests/search/test_speed_check.py and the quick start run it
    '++search.params={trainer.batch_size:"choice(8,16,128)",data.seq_len:"choice(32,256)"}',
]


def _journal(root: Path) -> optuna.storages.JournalStorage:
    backend = optuna.storages.journal.JournalFileBackend(str(root / "mlruns" / "optuna.journal"))
    return optuna.storages.JournalStorage(backend)


def test_gpt_study_reports_tokens_perplexity_and_exact_prediction(tmp_path: Path) -> None:
    out = run_module("search", GPT, tmp_path).stdout
    study = optuna.load_study(study_name="gpt-python_stdlib", storage=_journal(tmp_path))
    assert study.metric_names == ["val/loss", "throughput/tokens_per_sec"]
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 4
    done = [t for t in finished if t.state == TrialState.COMPLETE]
    assert done, out
    for t in done:
        figures = t.user_attrs["metrics"]
        seq_len = t.params["data.seq_len"]
        # Tokens are samples x seq_len here (no padding): the two throughputs agree.
        assert figures["throughput/tokens_per_sec"] == pytest.approx(
            figures["throughput/samples_per_sec"] * seq_len, rel=1e-6
        )
        assert t.values == [figures["val/loss"], figures["throughput/tokens_per_sec"]]
        assert figures["val/perplexity"] == pytest.approx(math.exp(figures["val/loss"]))
        # Bytes of Python source: well below the 5.55 nats of a uniform guess over 256.
        assert figures["val/loss"] < math.log(256)
        # On CPU the prediction is the same accounting as the measurement: exact.
        assert t.user_attrs["prediction_error"] == 0.0
        assert t.user_attrs["unit"] == "tokens"
    # batch 128 x 256 tokens needs ~680 MiB in fp32, over the experiment's 160 MiB.
    big = [t for t in finished if t.params["trainer.batch_size"] * t.params["data.seq_len"] > 8192]
    for t in big:
        assert t.state == TrialState.PRUNED and t.user_attrs["reason"] == "oom_predicted"
    assert "tokens/s" in out and "the best throughput/tokens_per_sec" in out

    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name(study.study_name)
    runs = client.search_runs([experiment.experiment_id], "tags.`batchfit.role` = 'trial'")
    completed = [r for r in runs if r.data.tags["batchfit.state"] == "COMPLETE"]
    assert len(completed) == len(done)
    for run in completed:
        for name in ("throughput/tokens_per_sec", "val/perplexity", "memory/prediction_error",
                     "time/data_wait_share"):  # fmt: skip
            assert name in run.data.metrics, name
        # Which text the run saw: the corpus's hash and what the model was built for.
        assert len(run.data.params["data_info.corpus_sha256"]) == 64
        assert run.data.params["data_info.vocab_size"] == "256"

    # The printed rerun trains the recommended configuration again, to the same val loss.
    rec = study.trials[int(out.split("Recommended: trial ")[1].split(",")[0])]
    rerun = next(line for line in out.splitlines() if line.startswith("Train it again: "))
    again = run_module("train", shlex.split(rerun.removeprefix("Train it again: "))[3:], tmp_path)
    again = again.stdout
    val_loss = float(again.split("val/loss ")[-1].split()[0])
    assert val_loss == pytest.approx(rec.user_attrs["metrics"]["val/loss"], abs=1e-4)
    assert "tokens/s" in again


def _image_folder(root: Path, per_class: int) -> None:
    """Two classes of 12x12 RGB PNGs: red-ish squares and blue-ish ones."""
    for split in ("train", "val"):
        for label, channel in (("red", 0), ("blue", 2)):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = [[(40 + i * 3) % 90] * 3 for _ in range(144)]
                for p in pixels:
                    p[channel] = 200
                image = Image.new("RGB", (12, 12))
                image.putdata([tuple(p) for p in pixels])
                image.save(folder / f"{i}.png")


def test_image_folder_trains_through_loader_workers(tmp_path: Path) -> None:
    _image_folder(tmp_path / "images", per_class=24)
    args = [
        "data=imagefolder",
        f"data.train.root={tmp_path}/images/train",
        f"data.val.root={tmp_path}/images/val",
        "data.train.transform.transforms.0.size=12",
        "data.val.transform.transforms.0.size=12",
        "data.val.transform.transforms.1.size=12",
        "model=small_cnn",
        "model.width=4",
        "loader.num_workers=2",
        "trainer.batch_size=8",
        "trainer.max_epochs=3",
        "optimizer.lr=0.1",
        "mlflow.system_metrics=false",
    ]
    out = run_module("train", args, tmp_path).stdout
    last = out.strip().splitlines()[-1]
    acc = float(last.split("val/acc ")[1].split()[0])
    assert acc > 0.9, out  # red against blue: learnt in 3 epochs
    assert "waiting for data" in last
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("train").experiment_id])[0]
    assert 0 <= run.data.metrics["time/data_wait_share"] < 1
    assert run.data.metrics["throughput/samples_per_sec"] > 0
