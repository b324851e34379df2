"""An ImageFolder read by DataLoader workers, as a user runs it: `python -m search` in a
subprocess, then the MLflow store read back. (The bundled language model's study,
`+experiment=gpt`, is checked where the docs run it: tests/test_readme.py
`test_quick_start_gpt`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from batchfit.tracking.metrics import DATA_WAIT_SHARE, THROUGHPUT_SAMPLES
from tests.sweeps import run_module

pytestmark = pytest.mark.slow


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
    assert 0 <= run.data.metrics[DATA_WAIT_SHARE] < 1
    assert run.data.metrics[THROUGHPUT_SAMPLES] > 0
