"""`import batchfit`: predict_peak, largest_batch and fit_table on a user's own model.

The oracle of the CPU figures is the measurement: a real step of the same model under the
tracker that measures CPU runs (train/measure/memory.py), and the fit report's own cells for a
config's model (the command line and the API must give the same bytes for the same step).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchfit
from batchfit.prediction import UserTask
from batchfit.search.fit.tabulate import fit_report
from batchfit.search.study.validate import validate
from batchfit.train.build import build_model, build_optimizer
from batchfit.train.device.gpus import gpu
from batchfit.train.device.sizes import format_bytes
from batchfit.train.measure.memory import TensorMemoryTracker
from batchfit.train.plan import plan
from batchfit.train.precision import Precision
from batchfit.train.step import optimizer_step, state_tensors
from batchfit.train.workload import Workloads

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model=small_cnn", "model.width=4", "data=digits", "trainer.device=cpu"]
SPACE = (
    '++search.params={trainer.batch_size:"choice(16,64)",trainer.accum_steps:"choice(1,2)",'
    'trainer.precision:"choice(fp32,bf16)"}'
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 10))


def _loss(output: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


def _batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


def test_the_exports_are_the_public_surface() -> None:
    assert "predict_peak" in batchfit.__all__ and "fit_table" in dir(batchfit)
    assert batchfit.Datasets.__module__ == "batchfit.train.data"
    with pytest.raises(AttributeError, match="no attribute 'train_one'"):
        batchfit.train_one  # noqa: B018 - private: not re-exported


def test_a_prediction_is_the_measured_peak_of_the_same_step_on_cpu() -> None:
    """The user's model, optimizer and loss, stepped for real by the step the prediction
    computes on fakes (train/step.py optimizer_step) under the tracker that measures CPU
    runs, the batch arriving within the step: the tracker's peak is the prediction to the
    byte. A loop of one's own differs by what it keeps alive (optimizer_step keeps a 4-byte
    running loss)."""
    model, (x, y) = _mlp(), _batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    task = UserTask(loss=lambda out, b: F.cross_entropy(out, b[1], reduction="sum"))
    precision = Precision("fp32", "cpu")

    def step(batch: tuple) -> None:
        optimizer_step(model, optimizer, precision.grad_scaler(), precision, [batch], task=task)

    step((x, y))  # the optimizer's state exists from here on, as in the steady state
    tracker = TensorMemoryTracker()
    tracker.register(state_tensors(model, optimizer))
    with tracker:
        step((x.clone(), y.clone()))
    predicted = batchfit.predict_peak(model, (x, y), optimizer=optimizer, task=task)
    assert predicted.peak_bytes == tracker.peak_bytes
    breakdown = predicted.breakdown
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert (breakdown.weights_bytes, breakdown.gradients_bytes) == (weights, weights)
    assert breakdown.optimizer_state_bytes == 2 * weights + 4 * 4  # 2 moments; 4 step counts
    parts = dataclasses.astuple(breakdown)
    assert sum(parts) == predicted.peak_bytes and breakdown.workspace_bytes == 0


def test_a_prediction_leaves_the_model_and_the_optimizer_as_they_were() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 10))
    model[0].weight.requires_grad_(False)
    model.eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
    _loss(model.train()(batch[0]), batch).backward()
    optimizer.step()
    model.eval()
    tensors = {name: (t, t.clone()) for name, t in model.state_dict(keep_vars=True).items()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    found = batchfit.predict_peak(model, batch, optimizer=optimizer, loss=_loss, batch_size=64)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert found.breakdown.gradients_bytes == trainable  # the frozen conv weight has none
    assert found.breakdown.optimizer_state_bytes == trainable  # SGD's momentum
    assert not model.training  # its mode as it was
    for name, (tensor, before) in tensors.items():
        now = model.state_dict(keep_vars=True)[name]
        assert now is tensor and torch.equal(now, before) and now.device.type == "cpu", name
    assert {name: p.grad for name, p in model.named_parameters()} == grads
    assert not model[0].weight.requires_grad and model[3].weight.requires_grad
    assert {id(p): s for p, s in optimizer.state.items()}.keys() == state.keys()
    for param, values in optimizer.state.items():
        assert all(torch.equal(values[k], v) for k, v in state[id(param)].items())


def test_a_model_on_the_meta_device_is_predicted_for_a_card() -> None:
    """An 8-layer 4096-wide stack (537M parameters, 2 GiB in fp32) built on the meta device:
    no weight is ever allocated; the card's prediction holds them and Adam's two moments."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])
    found = batchfit.predict_peak(
        model, torch.randn(4, 4096), loss=lambda out, b: out.float().pow(2).sum(),
        gpu="H100-80GB", precision="bf16",
    )  # fmt: skip
    weights = 8 * (4096 * 4096 + 4096) * 4
    breakdown = found.breakdown
    assert (breakdown.weights_bytes, breakdown.gradients_bytes) == (weights, weights)
    assert breakdown.optimizer_state_bytes >= 2 * weights
    assert breakdown.workspace_bytes == 2 * 32 * 2**20  # sm 9.0: two 32 MiB cuBLAS workspaces
    assert sum(dataclasses.astuple(breakdown)) == found.peak_bytes
    assert found.device == "H100-80GB" and found.fits
    assert found.budget_bytes == gpu("H100-80GB").usable_bytes and found.margin == 0.05


@pytest.mark.parametrize("card", [None, "A100-40GB"])
def test_the_api_and_the_fit_report_give_the_same_bytes(hydra_conf, card: str | None) -> None:
    """The config's model, optimizer, task and example batch handed to the API as a user
    holds them: every cell of the fit report's table, to the byte, for this CPU and for a
    card (the allocator's replay)."""
    overrides = [*SMALL, SPACE, *([f"search.gpu={card}"] if card else [])]
    cfg = hydra_conf(overrides)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*overrides, *extra]), False)
    report = fit_report(cfg, checked.space, checked.spec, checked.settings)
    workload = Workloads().of(cfg)
    pipeline = workload.pipeline(torch.device("cpu"))
    model = build_model(cfg, pipeline, workload.task, "none")
    optimizer = build_optimizer(cfg, model.parameters(), plan(cfg, None).lr)
    table = batchfit.fit_table(
        model, pipeline.shape_example(), optimizer=optimizer, task=workload.task,
        batch_sizes=(16, 64), accum_steps=(1, 2), precisions=("fp32", "bf16"),
        budget=report.budget_bytes, gpu=card,
    )  # fmt: skip
    cells = {key: cell.peak_bytes for key, cell in report.cells.items()}
    assert len(cells) == 8
    assert {key: found.peak_bytes for key, found in table.predictions.items()} == cells
    for precision in ("fp32", "bf16"):
        for accum in (1, 2):
            assert table.largest(precision, accum) == report.largest(precision, accum)


@pytest.mark.slow
def test_the_command_line_prints_the_api_bytes(hydra_conf, tmp_path: Path) -> None:
    """`python -m search.fit` in a fresh process: each cell it prints is the API's
    prediction of that step, formatted (the in-process test above compares the bytes)."""
    overrides = [*SMALL, SPACE]
    done = subprocess.run(
        [sys.executable, "-m", "search.fit", *overrides, f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    cfg = hydra_conf(overrides)
    workload = Workloads().of(cfg)
    pipeline = workload.pipeline(torch.device("cpu"))
    model = build_model(cfg, pipeline, workload.task, "none")
    optimizer = build_optimizer(cfg, model.parameters(), 0.05)
    step = batchfit.StepPredictor(
        model, pipeline.shape_example(), optimizer=optimizer, task=workload.task
    )
    rows = [line.split("│")[1:-1] for line in done.stdout.splitlines() if line.startswith("│")]
    checked, accums = 0, []
    for first, *cells in rows:
        label = first.strip()
        if label.startswith("accum_steps"):  # "accum_steps 1, 2: same peak"
            accums = [int(a) for a in label.split(" ", 1)[1].split(":")[0].split(",")]
        elif label.isdigit():
            for accum in accums:
                for precision, text in zip(("fp32", "bf16"), cells, strict=True):
                    found = step.predict(int(label), accum_steps=accum, precision=precision)
                    assert text.strip().split(" (")[0] == format_bytes(found.peak_bytes)
                    checked += 1
    assert checked == 8, done.stdout


def test_largest_batch_is_the_fit_boundary() -> None:
    model, batch = _mlp(), _batch(4)
    step = batchfit.StepPredictor(model, batch, loss=_loss, budget=600 * 1024, margin=0.0)
    found = step.largest(precision="fp32", max_batch_size=10_000)
    assert found is not None and found.fits
    assert not step.predict(found.batch_size + 1).fits
    again = batchfit.largest_batch(model, batch, loss=_loss, budget=600 * 1024, margin=0.0)
    assert (again.batch_size, again.peak_bytes) == (found.batch_size, found.peak_bytes)
    assert batchfit.largest_batch(model, batch, loss=_loss, budget=1024) is None
    kept = step.keeping(96)  # the largest divisor of 96 that fits, its accumulation the rest
    assert kept.fits and kept.batch_size * kept.accum_steps == 96 and 96 % kept.batch_size == 0
    unbounded = batchfit.StepPredictor(model, batch, loss=_loss)  # the CPU: no budget
    with pytest.raises(ValueError, match="keeping an effective batch needs a budget"):
        unbounded.keeping(96)


def test_a_fit_table_renders_as_the_fit_report() -> None:
    table = batchfit.fit_table(
        _mlp(), _batch(), loss=_loss, budget="600KiB", precisions=("fp32", "tf32", "bf16"),
        batch_sizes=(8, 64, 512),
    )  # fmt: skip
    text = str(table)
    assert "Fit report for cpu" in text and "budget 600.0 KiB (budget), margin 5%" in text
    assert table.unsupported.keys() == {"tf32"} and table.predictions["tf32", 8, 1] is None
    assert table.largest("fp32") == 64 and "largest that fits" in text
    fits = {(r["precision"], r["batch_size"]): r["fits"] for r in table.rows()}
    assert fits["fp32", 64] and not fits["fp32", 512]


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"gpu": "B300-999GB"}, ValueError, r"gpu='B300-999GB': .*known"),
        ({"precision": "fp8"}, ValueError, r"precision='fp8': give one of fp32, tf32, bf16"),
        ({"precision": "tf32"}, ValueError, r"precision='tf32': tf32 is a CUDA"),
        ({"batch_size": 0}, ValueError, r"batch_size=0: give an integer >= 1"),
        ({"budget": "lots"}, ValueError, r"budget='lots'"),
        ({"optimizer": 3}, TypeError, r"optimizer: got a int; give a torch.optim.Optimizer"),
        ({"strategy": "ddp", "devices": 0}, ValueError, r"devices=0: give an integer >= 1"),
        ({"loss": None}, batchfit.PredictionUnsupported, r"without a loss; pass loss="),
    ],
)
def test_bad_arguments_say_which_and_the_fix(settings: dict, error: type, match: str) -> None:
    arguments = {"loss": _loss, **settings}
    with pytest.raises(error, match=match):
        batchfit.predict_peak(_mlp(), _batch(), **arguments)


def test_a_hugging_face_batch_and_the_models_own_loss() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    encoding = transformers.BatchEncoding({"input_ids": ids, "labels": ids.clone()})
    found = batchfit.predict_peak(model, encoding, batch_size=4, precision="bf16")
    assert found.peak_bytes > sum(p.numel() * 4 for p in model.parameters()) * 3
