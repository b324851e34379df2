"""The input pipeline (train/batches.py): in-memory Splits and map-style Datasets read through a
DataLoader give the same run; the seeded step sampler; samples of any structure and custom
collate functions; the shape example memory is predicted from; the data-wait figure;
loader.* validation; what a data config may build; torchvision's ImageFolder end to end."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from torchvision.datasets import ImageFolder
from torchvision.transforms import ToTensor

from batchfit.common.checks import ConfigError
from batchfit.tracking.metrics import DATA_WAIT_SHARE, VAL_ACC, VAL_LOSS
from batchfit.train.batches import SHAPE_SAMPLES, Pipeline, StepSampler, steps_plan
from batchfit.train.build import build_data, build_loader
from batchfit.train.config import LoaderConfig, TrainerConfig
from batchfit.train.data import Datasets, Splits, synthetic
from batchfit.train.loop import Run, fit
from batchfit.train.lr import constant
from batchfit.train.measure.memory import MemoryMeter
from batchfit.train.memory.predict import MemoryPredictor
from batchfit.train.models import small_cnn
from batchfit.train.step import RunResult, memory_steps, step_micro_batch_sizes
from batchfit.train.tasks import Classification, Task

CPU = torch.device("cpu")
GiB = 2**30

# --------------------------------------------------------------------------- helpers


class PairDataset(Dataset):
    """(x, y) samples of two tensors, read one index at a time (a user's own Dataset)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, delay_s: float = 0.0):
        self.x, self.y, self.delay_s = x, y, delay_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)  # reading and decoding, as from disk
        return self.x[i], self.y[i]


class DictDataset(PairDataset):
    """{"pixels": (x, aux), <target_key>: y}: a dict sample holding a nested tuple."""

    def __init__(self, x, y, aux, target_key: str = "labels"):
        super().__init__(x, y)
        self.aux, self.target_key = aux, target_key

    def __getitem__(self, i: int):
        return {"pixels": (self.x[i], self.aux[i]), self.target_key: self.y[i]}


class TripleDataset(PairDataset):
    """(x, aux, y): a tuple sample of three tensors, the target last."""

    def __init__(self, x, y, aux):
        super().__init__(x, y)
        self.aux = aux

    def __getitem__(self, i: int):
        return self.x[i], self.aux[i], self.y[i]


class SequenceDataset(Dataset):
    """(tokens, label) samples whose token sequences have unequal lengths."""

    def __init__(self, lengths: list[int], vocab: int = 16, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
        # A learnable label: whether the sequence's first token is in the upper half.
        self.labels = [torch.tensor(int(t[0] >= vocab // 2)) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i], self.labels[i]


def pad_collate(samples):
    """Pads the token sequences of a batch with 0 to the longest of them."""
    tokens, labels = zip(*samples, strict=True)
    ids = torch.zeros(len(tokens), max(len(t) for t in tokens), dtype=torch.int64)
    for row, t in zip(ids, tokens, strict=True):
        row[: len(t)] = t
    return {"input_ids": ids, "labels": torch.stack(labels)}


class CountingCollate:
    def __init__(self):
        self.calls = 0
        self.widths: list[int] = []

    def __call__(self, samples):
        self.calls += 1
        batch = pad_collate(samples)
        self.widths.append(batch["input_ids"].shape[1])
        return batch


class BagOfTokens(nn.Module):
    """Sums token embeddings (padding embeds to zero) and classifies: activations are
    (batch, sequence, dim), so memory grows with the padded length."""

    def __init__(self, vocab: int = 16, dim: int = 8, classes: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.emb(input_ids)).sum(dim=1))


class PixelsModel(nn.Module):
    """Takes a dict batch's `pixels` (a collated (x, aux) pair) and classifies x."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.aux_shapes: list[tuple[int, ...]] = []

    def forward(self, pixels) -> torch.Tensor:
        x, aux = pixels
        self.aux_shapes.append(tuple(aux.shape))
        return self.net(x)


class SlowModel(nn.Module):
    """A linear classifier whose training forward takes `delay_s`, as a device step would."""

    def __init__(self, features: int, classes: int, delay_s: float):
        super().__init__()
        self.lin = nn.Linear(features, classes)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.delay_s)
        return self.lin(x.flatten(1))


def _splits(num_samples: int = 190) -> Splits:
    # 1x4x4 images, 3 classes; 152 training and 38 validation samples.
    return synthetic(
        num_samples=num_samples, num_classes=3, channels=1, image_size=4, noise=0.5, seed=0
    )


def _mlp(data: Splits, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    features = data.train_x[0].numel()
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(features, 16),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(16, data.num_classes),
    )


def _as_datasets(data: Splits) -> Datasets:
    return Datasets(TensorDataset(data.train_x, data.train_y), PairDataset(data.val_x, data.val_y))


def _num_train(data) -> int:
    if isinstance(data, Pipeline):
        return data.num_train
    return len(data.train_y) if isinstance(data, Splits) else len(data.train)


def _fit(model, data, cfg, lr=0.1, budget=None, task=None) -> RunResult:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    _, num_steps = steps_plan(_num_train(data), cfg)
    scheduler = constant(optimizer, num_steps)
    meter = MemoryMeter(CPU, budget)
    return fit(
        Run(model, optimizer, scheduler, data, cfg, CPU, meter, task=task or Classification())
    )


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- same order, same run

# 152 training samples in steps of 16 x 2 = 32: five steps an epoch, the last one ragged
# (24 samples: micro-batches of 16 and 8); two epochs, validation after each.
ACCUM = TrainerConfig(batch_size=16, accum_steps=2, max_epochs=2, warmup_steps=0, seed=3)


def test_the_ragged_accumulated_geometry_of_these_tests():
    assert steps_plan(152, ACCUM) == (5, 10)
    assert step_micro_batch_sizes(152, ACCUM, 4) == [16, 8]


@pytest.mark.parametrize("workers", [0, 2])
def test_datasets_train_exactly_like_in_memory_splits(workers):
    data = _splits()
    memory_model = _mlp(data)
    in_memory = _fit(memory_model, data, ACCUM)
    before = _params(_mlp(data))

    datasets = _as_datasets(data)
    dataset_model = _mlp(data)
    source = datasets if workers == 0 else Pipeline(datasets, LoaderConfig(num_workers=2), "cpu")
    read = _fit(dataset_model, source, ACCUM)

    assert not _same_params(_params(memory_model), before)  # it trained
    assert _same_params(_params(dataset_model), _params(memory_model))
    assert read.val == in_memory.val and VAL_ACC in read.val and VAL_LOSS in read.val
    assert [e[VAL_LOSS] for e in read.evals] == [e[VAL_LOSS] for e in in_memory.evals]
    assert len(read.evals) == 2
    assert read.train_loss == in_memory.train_loss
    assert (read.num_steps, read.num_samples) == (10, 2 * 152)
    assert (read.num_steps, read.num_samples) == (in_memory.num_steps, in_memory.num_samples)


def test_another_seed_gives_another_order_through_a_dataloader_too():
    data = _splits()
    runs = []
    for seed in (3, 4):
        cfg = TrainerConfig(batch_size=16, accum_steps=2, max_epochs=1, warmup_steps=0, seed=seed)
        model = _mlp(data)
        _fit(model, _as_datasets(data), cfg)
        runs.append(_params(model))
    assert not _same_params(*runs)


def test_dropout_runs_the_same_in_memory_and_through_a_dataloader():
    """The dropout masks come from the global RNG: reading a Datasets must not draw from it,
    or the run differs from the in-memory one from the first validation on."""
    data = _splits()
    cfg = TrainerConfig(batch_size=16, accum_steps=2, max_epochs=2, warmup_steps=0, seed=3)
    models = {}
    for name, source in (
        ("memory", data),
        ("loader", _as_datasets(data)),
        ("workers", Pipeline(_as_datasets(data), LoaderConfig(num_workers=2), "cpu")),
    ):
        models[name] = _mlp(data, dropout=0.5)  # seeds the global RNG: same init, same masks
        _fit(models[name], source, cfg)
    for name in ("loader", "workers"):
        assert _same_params(_params(models[name]), _params(models["memory"])), name


@pytest.mark.parametrize("workers", [0, 2])
def test_reading_batches_leaves_the_global_rng_alone(workers):
    """What the test above needs of the pipeline: neither training nor validation batches
    draw from torch's global generator (model init, dropout and augmentation use it)."""
    data = _splits()
    pipeline = Pipeline(_as_datasets(data), LoaderConfig(num_workers=workers))
    cfg = TrainerConfig(batch_size=16, max_epochs=1, seed=0)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    for _ in pipeline.train_steps(cfg, steps_plan(152, cfg)[1]):
        pass
    assert torch.equal(torch.get_rng_state(), state), "train_steps drew from the global RNG"
    for _ in range(2):  # two validations
        assert sum(len(y) for _, y in pipeline.val_batches(16)) == 38
    pipeline.close()
    assert torch.equal(torch.get_rng_state(), state), "val_batches drew from the global RNG"


def test_train_steps_read_the_sampler_indices_whichever_path():
    # Each sample is its own index: a batch shows which samples were read, in which order.
    n = 37
    ids = torch.arange(n, dtype=torch.float32).view(n, 1)
    labels = torch.arange(n) % 3
    splits = Splits(ids, labels, ids[:5], labels[:5], 3)
    cfg = TrainerConfig(batch_size=4, accum_steps=3, max_epochs=2, seed=5)
    _, num_steps = steps_plan(n, cfg)
    expected = [[idx.tolist() for idx in micro] for micro in StepSampler(n, cfg, num_steps).steps()]
    paths = {
        "memory": Pipeline(splits),
        "loader": Pipeline(Datasets(TensorDataset(ids, labels), TensorDataset(ids, labels))),
        "workers": Pipeline(
            Datasets(PairDataset(ids, labels), PairDataset(ids, labels)),
            LoaderConfig(num_workers=2, prefetch_factor=3),
        ),
    }
    for name, pipeline in paths.items():
        got = []
        for micro, samples, waited in pipeline.train_steps(cfg, num_steps):
            assert samples == sum(len(y) for _, y in micro), name
            assert waited >= 0.0
            for x, y in micro:
                assert torch.equal(y, x.view(-1).long() % 3), name  # labels with their samples
            got.append([x.view(-1).long().tolist() for x, _ in micro])
        assert got == expected, name
        pipeline.close()


# --------------------------------------------------------------------------- StepSampler


@pytest.mark.parametrize(
    ("num_train", "batch", "accum", "epochs"),
    [(23, 4, 2, 3), (20, 5, 2, 2), (7, 8, 1, 4), (31, 3, 4, 2)],
)
def test_step_sampler_covers_every_sample_once_an_epoch(num_train, batch, accum, epochs):
    cfg = TrainerConfig(batch_size=batch, accum_steps=accum, max_epochs=epochs, seed=1)
    steps_per_epoch, num_steps = steps_plan(num_train, cfg)
    assert num_steps == epochs * steps_per_epoch
    sampler = StepSampler(num_train, cfg, num_steps)
    steps = list(sampler.steps())
    assert len(steps) == num_steps
    orders = []
    for epoch in range(epochs):
        epoch_steps = steps[epoch * steps_per_epoch : (epoch + 1) * steps_per_epoch]
        order = [i for micro in epoch_steps for idx in micro for i in idx.tolist()]
        assert sorted(order) == list(range(num_train)), epoch  # each sample exactly once
        orders.append(order)
    for step, micro in enumerate(steps):
        assert [len(idx) for idx in micro] == step_micro_batch_sizes(num_train, cfg, step)
    # The flat micro-batch lists a DataLoader reads are the same, and as many as it says.
    flat = list(sampler)
    assert flat == [idx.tolist() for micro in steps for idx in micro]
    assert len(sampler) == len(flat)
    if num_train > 3:
        assert orders[0] != orders[1]  # a fresh permutation each epoch
        assert orders[0] != list(range(num_train))  # shuffled


def test_step_sampler_order_follows_the_seed():
    def order(seed: int, num_steps: int = 6) -> list[list[int]]:
        cfg = TrainerConfig(batch_size=4, accum_steps=2, max_epochs=3, seed=seed)
        return list(StepSampler(30, cfg, num_steps))

    assert order(0) == order(0)
    assert order(0) != order(1)
    # Another batch geometry with the same seed reads the samples in the same order.
    wide = TrainerConfig(batch_size=8, accum_steps=1, max_epochs=3, seed=0)
    assert [i for idx in StepSampler(30, wide, 3) for i in idx] == [
        i for idx in order(0, 3) for i in idx
    ]


def test_step_sampler_cut_mid_epoch_by_max_steps():
    cfg = TrainerConfig(batch_size=5, accum_steps=1, max_epochs=None, max_steps=7, seed=2)
    steps_per_epoch, num_steps = steps_plan(22, cfg)
    assert (steps_per_epoch, num_steps) == (5, 7)
    steps = list(StepSampler(22, cfg, num_steps).steps())
    assert [[len(idx) for idx in micro] for micro in steps] == [[5]] * 4 + [[2]] + [[5]] * 2
    second_epoch = [i for micro in steps[5:] for idx in micro for i in idx.tolist()]
    assert len(set(second_epoch)) == 10


# --------------------------------------------------------------------------- sample structures


def _aux(data: Splits, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(data.train_y), 2, generator=gen), torch.randn(
        len(data.val_y), 2, generator=gen
    )


def test_dict_samples_with_a_nested_tuple_train_like_in_memory():
    data = _splits()
    train_aux, val_aux = _aux(data)
    reference = _mlp(data)
    expected = _fit(reference, data, ACCUM)

    datasets = Datasets(
        DictDataset(data.train_x, data.train_y, train_aux, target_key="target"),
        DictDataset(data.val_x, data.val_y, val_aux, target_key="target"),
    )
    model = PixelsModel(_mlp(data))
    got = _fit(model, datasets, ACCUM, task=Classification(target_key="target"))

    assert _same_params(_params(model.net), _params(reference))
    assert got.val == expected.val
    # Every forward saw the nested tuple's second tensor, collated along the batch.
    assert model.aux_shapes and all(s[1:] == (2,) for s in model.aux_shapes)
    # Micro-batches of 16 and the ragged 8; validation of 38 in batches of 16, 16 and 6.
    assert {s[0] for s in model.aux_shapes} == {16, 8, 6}


def test_tuples_of_three_tensors_train_with_the_default_task():
    data = _splits()
    train_aux, val_aux = _aux(data)
    reference = _mlp(data)
    expected = _fit(reference, data, ACCUM)
    datasets = Datasets(
        TripleDataset(data.train_x, data.train_y, train_aux),
        TripleDataset(data.val_x, data.val_y, val_aux),
    )
    model = _mlp(data)
    pipeline = Pipeline(datasets, LoaderConfig(num_workers=2), "cpu")
    got = _fit(model, pipeline, ACCUM, task=Task())
    assert _same_params(_params(model), _params(reference))
    assert got.val == expected.val


@pytest.mark.parametrize("workers", [0, 2])
def test_a_custom_collate_function_pads_variable_length_samples(workers):
    gen = torch.Generator().manual_seed(0)
    train = SequenceDataset(torch.randint(1, 12, (90,), generator=gen).tolist(), seed=1)
    val = SequenceDataset(torch.randint(1, 12, (20,), generator=gen).tolist(), seed=2)
    with pytest.raises(RuntimeError):  # torch's default collate cannot stack them
        torch.utils.data.default_collate([train[i] for i in range(8)])
    collate = CountingCollate()
    cfg = TrainerConfig(batch_size=8, accum_steps=2, max_epochs=4, warmup_steps=0, seed=0)
    pipeline = Pipeline(Datasets(train, val), LoaderConfig(num_workers=workers, collate_fn=collate))
    torch.manual_seed(0)
    model = BagOfTokens()
    before = _params(model)
    result = _fit(model, pipeline, cfg, lr=0.2)

    assert not _same_params(_params(model), before)
    assert math.isfinite(result.train_loss)
    assert 0.0 <= result.val[VAL_ACC] <= 1.0 and len(result.evals) == 4
    assert result.evals[-1][VAL_LOSS] < result.evals[0][VAL_LOSS]  # it learns
    _, num_steps = steps_plan(90, cfg)
    micro_batches = len(StepSampler(90, cfg, num_steps))
    if workers == 0:  # collated in this process: every train and val batch went through it
        assert collate.calls == micro_batches + 4 * 3  # 20 val samples in batches of 8
        assert len(set(collate.widths)) > 1  # padded per batch, to that batch's longest
    else:
        assert collate.calls == 0  # the workers collated


# --------------------------------------------------------------------------- shape example


def _lengths(n: int, longest_at: int, longest: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 10, (n,), generator=gen).tolist()
    lengths[longest_at] = longest
    return lengths


def test_shape_example_is_two_rows_at_the_longest_of_the_first_samples():
    lengths = _lengths(SHAPE_SAMPLES + 44, longest_at=200, longest=30)
    lengths[SHAPE_SAMPLES + 20] = 50  # past the samples looked at
    dataset = SequenceDataset(lengths)
    pipeline = Pipeline(Datasets(dataset, dataset), LoaderConfig(collate_fn=pad_collate))
    example = pipeline.shape_example()
    assert example["input_ids"].shape == (2, 30)
    assert example["labels"].shape == (2,)
    for row in range(2):
        tokens = dataset.tokens[row]
        assert torch.equal(example["input_ids"][row, : len(tokens)], tokens)
        assert not example["input_ids"][row, len(tokens) :].any()
        assert example["labels"][row] == dataset.labels[row]
    # In-memory data: its first two samples.
    data = _splits()
    x, y = Pipeline(data).shape_example()
    assert torch.equal(x, data.train_x[:2]) and torch.equal(y, data.train_y[:2])


def _predict_and_measure(dataset: SequenceDataset, cfg: TrainerConfig) -> tuple[int, int]:
    pipeline = Pipeline(Datasets(dataset, dataset), LoaderConfig(collate_fn=pad_collate))
    task = Classification()
    torch.manual_seed(0)
    predictor = MemoryPredictor(
        BagOfTokens(vocab=16, dim=64),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        pipeline.shape_example(),
        CPU,
        task,
    )
    predicted = predictor.predict(cfg, len(dataset)).peak_bytes
    torch.manual_seed(0)
    model = BagOfTokens(vocab=16, dim=64)
    measured = _fit(model, pipeline, cfg, budget=4 * GiB, task=task).peak_bytes
    return predicted, measured


@pytest.mark.parametrize(("batch", "accum"), [(16, 1), (8, 3)])
def test_the_predicted_peak_covers_the_measured_one(batch, accum):
    cfg = TrainerConfig(batch_size=batch, accum_steps=accum, max_epochs=None, max_steps=3)
    assert MemoryMeter(CPU, 4 * GiB).needs_tracker  # the CPU run measures its steps
    measured_steps = memory_steps(120, cfg, 3)
    assert measured_steps == [0, 1]
    # The longest sample where no measured step reads it: those steps' batches are shorter.
    steps = list(StepSampler(120, cfg, 3).steps())
    read = {i for s in measured_steps for idx in steps[s] for i in idx.tolist()}
    longest_at = min(set(range(120)) - read)
    varied = SequenceDataset(_lengths(120, longest_at=longest_at, longest=60))
    predicted, measured = _predict_and_measure(varied, cfg)
    assert measured > 0
    assert predicted >= measured, (predicted, measured)
    # Every sample at the longest length: the same prediction, and the measurement matches it.
    uniform = SequenceDataset([60] * 120)
    uniform_predicted, uniform_measured = _predict_and_measure(uniform, cfg)
    assert uniform_predicted == predicted
    assert uniform_measured == uniform_predicted
    assert measured < uniform_measured  # shorter padded batches measured less


# --------------------------------------------------------------------------- data wait

# 96 training samples in batches of 8: 12 steps, steps 0 and 1 measured (not timed). Reading
# a batch takes 8 x 5 ms = 40 ms, a training step a little over 16 ms: without workers the
# loop waits about 70% of the time; two workers (a batch each 20 ms between them) hide all
# but a few ms of it. Sleeps, not computation, so a busy machine barely moves the shares.
# (no noise-scale window of split steps: they would leave the clock too)
WAIT = TrainerConfig(
    batch_size=8, max_epochs=1, warmup_steps=2, log_every_steps=100, seed=0, noise_scale_window=0
)
READ_S, STEP_S = 0.005, 0.016


def _wait_run(source) -> RunResult:
    torch.manual_seed(0)
    return _fit(SlowModel(16, 3, STEP_S), source, WAIT)


def test_data_wait_share_shows_a_slow_dataset_and_what_workers_hide():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(104, 16, generator=gen), torch.randint(0, 3, (104,), generator=gen)
    data = Splits(x[:96], y[:96], x[96:], y[96:], 3)
    sleepy = Datasets(
        PairDataset(data.train_x, data.train_y, READ_S),
        PairDataset(data.val_x, data.val_y, READ_S),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: no thread pool to wait for on a loaded machine
    try:
        in_memory = _wait_run(data)
        no_workers = _wait_run(sleepy)
        workers = _wait_run(Pipeline(sleepy, LoaderConfig(num_workers=2), "cpu"))
    finally:
        torch.set_num_threads(threads)

    shares = {}
    for name, result in (("memory", in_memory), ("0", no_workers), ("2", workers)):
        assert result.timed_steps == 10 and result.timed_samples == 80, name
        assert 0.0 <= result.data_wait_s <= result.timed_seconds, name
        shares[name] = result.metrics()[DATA_WAIT_SHARE]
        assert shares[name] == pytest.approx(result.data_wait_s / result.timed_seconds)
        # The timed steps took at least their forward passes' sleeps.
        assert result.timed_seconds >= 10 * STEP_S, name
    assert shares["memory"] < 0.2, shares
    assert shares["0"] > 0.5, shares
    assert shares["2"] < shares["0"], shares
    # The waits are real seconds: at least the reads of the 10 timed steps without workers,
    # well under half of that with two workers reading ahead.
    assert no_workers.data_wait_s >= 10 * 8 * READ_S
    assert workers.data_wait_s < no_workers.data_wait_s / 2
    # Throughput counts the reading: the same steps with a slow dataset are fewer per second.
    assert no_workers.throughput_samples_per_sec < in_memory.throughput_samples_per_sec
    assert no_workers.throughput_samples_per_sec < workers.throughput_samples_per_sec


# --------------------------------------------------------------------------- loader.* validation


def test_loader_defaults_are_valid():
    cfg = LoaderConfig.from_mapping({})
    assert cfg == LoaderConfig()
    assert (cfg.num_workers, cfg.pin_memory, cfg.collate_fn) == (0, None, None)
    assert LoaderConfig.from_mapping({"num_workers": 2, "collate_fn": pad_collate}).num_workers == 2


@pytest.mark.parametrize(
    ("values", "key", "fix"),
    [
        ({"num_workers": -1}, "loader.num_workers", "loader.num_workers=0"),
        ({"num_workers": True}, "loader.num_workers", "loader.num_workers=0"),
        ({"num_workers": 1.5}, "loader.num_workers", "loader.num_workers=0"),
        ({"pin_memory": "yes"}, "loader.pin_memory", "loader.pin_memory=null"),
        ({"pin_memory": 1}, "loader.pin_memory", "loader.pin_memory=null"),
        ({"persistent_workers": None}, "loader.persistent_workers", "=true"),
        ({"collate_fn": 3}, "loader.collate_fn", "_partial_: true"),
        ({"collate_fn": "my.collate"}, "loader.collate_fn", "_partial_: true"),
        ({"prefetch_factor": 0}, "loader.prefetch_factor", "loader.prefetch_factor=1"),
        ({"workers": 2}, "loader.workers", "num_workers"),
    ],
)
def test_a_bad_loader_setting_names_its_key_and_the_fix(values, key, fix):
    with pytest.raises(ConfigError) as caught:
        LoaderConfig.from_mapping(values)
    assert len(caught.value.problems) == 1
    problem = caught.value.problems[0]
    assert problem.startswith(key) and fix in problem, problem


def test_every_loader_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as caught:
        LoaderConfig.from_mapping(
            {
                "num_workers": -1,
                "pin_memory": "yes",
                "collate_fn": 3,
                "prefetch_factor": 0,
                "shuffle": True,
            }
        )
    problems = caught.value.problems
    keys = ["num_workers", "pin_memory", "collate_fn", "prefetch_factor", "shuffle"]
    assert len(problems) == len(keys)
    for key in keys:
        assert any(p.startswith(f"loader.{key}") for p in problems), key
    assert all(p in str(caught.value) for p in problems)


def test_build_loader_reads_the_loader_section(hydra_conf):
    assert build_loader(hydra_conf()) == LoaderConfig()  # conf/config.yaml's defaults
    collate = "loader.collate_fn=torch.utils.data.default_collate"
    cfg = build_loader(hydra_conf(["loader.num_workers=2", collate]))
    assert cfg.num_workers == 2 and cfg.collate_fn is torch.utils.data.default_collate
    with pytest.raises(ConfigError, match=r"loader\.num_workers must be an integer >= 0"):
        build_loader(hydra_conf(["loader.num_workers=-2"]))
    with pytest.raises(ConfigError, match=r"loader\.collate_fn='no\.such\.collate' cannot be"):
        build_loader(hydra_conf(["loader.collate_fn=no.such.collate"]))


# --------------------------------------------------------------------------- what data builds


def _with_data(hydra_conf, data: dict):
    cfg = hydra_conf()
    cfg.data = OmegaConf.create(data)
    return cfg


def test_build_data_refuses_what_is_neither_splits_nor_datasets(hydra_conf):
    cfg = hydra_conf(["data._target_=builtins.dict"])
    with pytest.raises(ConfigError) as caught:
        build_data(cfg)
    message = str(caught.value)
    assert "data (builtins.dict) built a dict" in message
    assert "batchfit.Datasets" in message and "batchfit.Splits" in message


def test_build_data_builds_datasets_from_a_config(hydra_conf):
    data = build_data(
        _with_data(
            hydra_conf,
            {
                "_target_": "batchfit.Datasets",
                "train": {"_target_": "builtins.list", "_args_": [[1, 2, 3]]},
                "val": {"_target_": "builtins.list", "_args_": [[4]]},
                "num_classes": 3,
            },
        )
    )
    assert isinstance(data, Datasets)
    assert (data.train, data.val, data.info) == ([1, 2, 3], [4], {"num_classes": 3})


@pytest.mark.parametrize(
    ("train", "match"),
    [
        ({"_target_": "builtins.list"}, r"data\.train \(list\) is empty"),
        ({"_target_": "builtins.int", "_args_": [3]}, r"data\.train must be a map-style"),
    ],
)
def test_build_data_reports_a_dataset_that_cannot_train_as_a_config_error(hydra_conf, train, match):
    cfg = _with_data(
        hydra_conf,
        {
            "_target_": "batchfit.Datasets",
            "train": train,
            "val": {"_target_": "builtins.list"},
        },
    )
    with pytest.raises(ConfigError, match=r"data \(batchfit\.Datasets\) cannot be built: " + match):
        build_data(cfg)


def test_datasets_refuses_an_empty_dataset_and_a_non_dataset():
    full = TensorDataset(torch.zeros(3, 1), torch.zeros(3))
    empty = TensorDataset(torch.zeros(0, 1), torch.zeros(0))
    with pytest.raises(ValueError, match=r"data\.val \(TensorDataset\) is empty"):
        Datasets(full, empty)
    with pytest.raises(ValueError, match=r"data\.train \(TensorDataset\) is empty"):
        Datasets(empty, full)
    with pytest.raises(TypeError, match=r"data\.train must be a map-style torch Dataset.*int"):
        Datasets(3, full)
    with pytest.raises(TypeError, match=r"data\.val must be a map-style torch Dataset"):
        Datasets(full, iter([1]))
    info = Datasets(full, full, vocab_size=7).info
    assert info == {"vocab_size": 7}  # no `classes` on a TensorDataset: no num_classes


# --------------------------------------------------------------------------- ImageFolder


def _image_folder(root: Path, per_class: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    for label, name in enumerate(("cat", "dog")):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 120, (8, 8, 3), dtype=np.uint8)
            pixels[..., label * 2] += 120  # cats red, dogs blue
            Image.fromarray(pixels, "RGB").save(folder / f"{i}.png")
    return root


def test_an_image_folder_trains_through_workers_like_in_memory(tmp_path):
    train_root = _image_folder(tmp_path / "train", per_class=12, seed=0)
    val_root = _image_folder(tmp_path / "val", per_class=4, seed=1)
    datasets = Datasets(
        ImageFolder(str(train_root), transform=ToTensor()),
        ImageFolder(str(val_root), transform=ToTensor()),
    )
    assert datasets.info == {"num_classes": 2}
    assert len(datasets.train) == 24 and len(datasets.val) == 8

    def tensors(dataset):
        samples = [dataset[i] for i in range(len(dataset))]
        return torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples])

    splits = Splits(*tensors(datasets.train), *tensors(datasets.val), num_classes=2)
    assert splits.train_x.shape == (24, 3, 8, 8)
    cfg = TrainerConfig(batch_size=4, accum_steps=2, max_epochs=3, warmup_steps=0, seed=0)

    torch.manual_seed(0)
    reference = small_cnn(num_classes=2, in_channels=3, width=4)
    expected = _fit(reference, splits, cfg, lr=0.05)
    torch.manual_seed(0)
    model = small_cnn(num_classes=2, in_channels=3, width=4)
    pipeline = Pipeline(datasets, LoaderConfig(num_workers=2), "cpu")
    result = _fit(model, pipeline, cfg, lr=0.05)

    assert result.num_steps == 9 and result.num_samples == 72
    assert 0.0 <= result.val[VAL_ACC] <= 1.0 and math.isfinite(result.val[VAL_LOSS])
    assert VAL_ACC in result.figures()
    assert _same_params(_params(model), _params(reference))
    assert result.val == expected.val
