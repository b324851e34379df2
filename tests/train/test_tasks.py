"""Tasks: exact accumulation per unit (samples, tokens), model outputs, dict and tuple batches,
validation figures and their directions, a user's own task through fit end to end."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanSquaredError, Metric
from torchmetrics.classification import MulticlassAccuracy

from batchfit.tracking.metrics import THROUGHPUT_TOKENS, VAL_ACC, VAL_LOSS, VAL_PERPLEXITY
from batchfit.train.batches import StepSampler, steps_plan
from batchfit.train.config import TrainerConfig
from batchfit.train.data import Datasets, Splits, synthetic
from batchfit.train.loop import Run, fit
from batchfit.train.lr import constant
from batchfit.train.measure.evaluate import evaluate
from batchfit.train.measure.memory import MemoryMeter
from batchfit.train.precision import Precision
from batchfit.train.step import optimizer_step
from batchfit.train.tasks import (
    MAXIMIZE,
    MINIMIZE,
    ArgmaxAccuracy,
    Classification,
    LanguageModel,
    Regression,
    Task,
    batch_size_of,
    logits_of,
)

CPU = torch.device("cpu")
FP32 = Precision("fp32", "cpu")
PAD = -100
VOCAB = 11
# Target tokens per sample of the language-model batch: unequal, one sample all padding.
LENGTHS = [5, 1, 3, 0, 4, 2]
SEQ_LEN = 5
# Parameters after one SGD step (lr=1) agree with the hand-computed step to this much: the
# float32 sums run in another order. A wrong normalisation is off by orders of magnitude more.
ATOL = 1e-6
FAR = 1e-3


# --------------------------------------------------------------------------- helpers


class TinyLM(nn.Module):
    """Embedding + linear head over the vocabulary: (N, T) token ids -> (N, T, V) logits."""

    def __init__(self, vocab: int = VOCAB, dim: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def _lm_batch(lengths: list[int] = LENGTHS, seq_len: int = SEQ_LEN, seed: int = 0) -> dict:
    """{"input_ids": (N, T), "labels": (N, T)}; sample i has lengths[i] target tokens, the
    rest of its labels is padding."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    input_ids = torch.randint(0, VOCAB, (n, seq_len), generator=gen)
    labels = torch.randint(0, VOCAB, (n, seq_len), generator=gen)
    for i, length in enumerate(lengths):
        labels[i, length:] = PAD
    return {"input_ids": input_ids, "labels": labels}


def _dict_chunks(batch: dict, sizes: list[int]) -> list[dict]:
    assert sum(sizes) == batch_size_of(batch)
    parts = {k: v.split(sizes) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(len(sizes))]


def _tuple_chunks(x: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> list[tuple]:
    assert sum(sizes) == len(y)
    return list(zip(x.split(sizes), y.split(sizes), strict=True))


def _linear(features: int = 6, outputs: int = 4, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(features, outputs)


def _classification_data(n: int = 8, features: int = 6, classes: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _sgd_step(model: nn.Module, micro, task: Task, num_units: int | None = None) -> torch.Tensor:
    """One optimizer_step with plain SGD, lr=1: the parameters move by minus the gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return optimizer_step(
        model, optimizer, FP32.grad_scaler(), FP32, micro, None, num_units=num_units, task=task
    )


def _stepped(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    """The parameters one SGD step (lr=1) on `loss` would give; the model is left as it is."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params)
    return [p.detach() - g for p, g in zip(params, grads, strict=True)]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_params(got: list[torch.Tensor], want: list[torch.Tensor], msg: str = "") -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=msg or None)


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _lm_token_loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=PAD, reduction="sum"
    )


def _tokens(batch: dict) -> int:
    return int((batch["labels"] != PAD).sum())


# --------------------------------------------------------------------------- exact accumulation


@pytest.mark.parametrize(
    "sizes",
    [[6], [2, 4], [4, 2], [1, 5], [3, 3], [2, 1, 3], [1] * 6],
    ids=lambda s: "+".join(map(str, s)),
)
def test_language_model_accumulation_is_exact_per_token(sizes):
    batch = _lm_batch()
    tokens = [_tokens(b) for b in _dict_chunks(batch, sizes)]
    assert sum(tokens) == sum(LENGTHS) == 15
    # Reference: one SGD step on the mean cross-entropy over every target token, by hand.
    reference = TinyLM()
    full = F.cross_entropy(
        reference(batch["input_ids"]).reshape(-1, VOCAB),
        batch["labels"].reshape(-1),
        ignore_index=PAD,
    )
    expected = _stepped(reference, full)

    model = TinyLM()
    loss = _sgd_step(model, _dict_chunks(batch, sizes), LanguageModel())

    _assert_params(_params(model), expected)
    torch.testing.assert_close(loss, full.detach(), rtol=0, atol=ATOL)  # mean loss per token
    assert all(p.grad is None for p in model.parameters())

    if len(sizes) == 1:
        return
    # The equality above can fail: the ways a loop could get the normalisation wrong give
    # other parameters, far beyond the tolerance, on this split of unequal token counts.
    assert len(set(tokens)) > 1
    micro = _dict_chunks(batch, sizes)
    naive = TinyLM()

    def sums():  # noqa: ANN202 - a fresh graph per alternative
        return [_lm_token_loss_sum(naive, b) for b in micro]

    def means():  # noqa: ANN202
        return [s / max(t, 1) for s, t in zip(sums(), tokens, strict=True)]

    alternatives = {
        # the mean of the micro-batches' means (what averaging per-micro-batch losses gives)
        "mean of micro-batch means": sum(means()) / len(micro),
        # each micro-batch divided by its own units, not the step's
        "per-micro-batch units": sum(means()),
        # samples as the unit of a language model
        "per sample": sum(sums()) / len(LENGTHS),
    }
    for name, wrong in alternatives.items():
        assert _distance(_stepped(naive, wrong), expected) > FAR, name


def test_a_generator_of_micro_batches_uses_the_num_units_given():
    """fit passes a generator and the units it counted on the host: the step divides by them."""
    batch = _lm_batch()
    reference = TinyLM()
    expected = _stepped(reference, _lm_token_loss_sum(reference, batch) / 15)

    model = TinyLM()
    micro = (b for b in _dict_chunks(batch, [2, 4]))
    loss = _sgd_step(model, micro, LanguageModel(), num_units=15)
    _assert_params(_params(model), expected)
    assert loss.item() == pytest.approx(_lm_token_loss_sum(TinyLM(), batch).item() / 15, rel=1e-6)

    # Another count gives another step: the count given is the one divided by.
    other = TinyLM()
    _sgd_step(other, (b for b in _dict_chunks(batch, [2, 4])), LanguageModel(), num_units=6)
    assert _distance(_params(other), expected) > FAR


@pytest.mark.parametrize("sizes", [[8], [3, 5], [5, 3], [1, 7], [2, 2, 4]])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_classification_accumulation_is_exact_per_sample(sizes, label_smoothing):
    x, y = _classification_data()
    reference = _linear()
    full = F.cross_entropy(reference(x), y, label_smoothing=label_smoothing)
    expected = _stepped(reference, full)

    model = _linear()
    loss = _sgd_step(
        model, _tuple_chunks(x, y, sizes), Classification(label_smoothing=label_smoothing)
    )

    _assert_params(_params(model), expected)
    torch.testing.assert_close(loss, full.detach(), rtol=0, atol=ATOL)
    if len(sizes) > 1:
        # Averaging the micro-batch means would weigh the samples of a short one more.
        naive = _linear()
        means = [
            F.cross_entropy(naive(xs), ys, label_smoothing=label_smoothing)
            for xs, ys in _tuple_chunks(x, y, sizes)
        ]
        assert _distance(_stepped(naive, sum(means) / len(means)), expected) > FAR
    if label_smoothing:
        plain = _linear()
        assert _distance(_stepped(plain, F.cross_entropy(plain(x), y)), expected) > FAR


@pytest.mark.parametrize("outputs", [1, 3])
@pytest.mark.parametrize("sizes", [[8], [3, 5], [1, 2, 5]])
def test_regression_accumulation_is_exact_per_sample(outputs, sizes):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=gen)
    # One output: a (N,) target against the model's (N, 1), squeezed. Several: (N, D) each.
    y = torch.randn(8, generator=gen) if outputs == 1 else torch.randn(8, outputs, generator=gen)
    reference = _linear(outputs=outputs)
    full = F.mse_loss(reference(x).squeeze(-1) if outputs == 1 else reference(x), y)
    expected = _stepped(reference, full)

    model = _linear(outputs=outputs)
    loss = _sgd_step(model, _tuple_chunks(x, y, sizes), Regression())

    _assert_params(_params(model), expected)
    # The step's loss is the mean squared error over every element, whatever the split.
    torch.testing.assert_close(loss, full.detach(), rtol=0, atol=ATOL)
    if len(sizes) > 1:
        naive = _linear(outputs=outputs)
        means = [
            F.mse_loss(naive(xs).squeeze(-1) if outputs == 1 else naive(xs), ys)
            for xs, ys in _tuple_chunks(x, y, sizes)
        ]
        assert _distance(_stepped(naive, sum(means) / len(means)), expected) > FAR


def test_regression_loss_is_the_sum_over_samples_of_the_mean_over_outputs():
    preds = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, -1.0]])
    target = torch.tensor([[1.0, 4.0], [1.0, 1.0], [0.0, 0.0]])
    # per sample: (0 + 4) / 2, (1 + 1) / 2, (9 + 1) / 2 -> 2 + 1 + 5
    task = Regression()
    assert task.loss(preds, (None, target)).item() == pytest.approx(8.0)
    assert task.units((None, target)) == 3


def test_regression_target_with_a_trailing_dimension_of_one_is_not_broadcast():
    """A (N, 1) output against a (N, 1) target (a dataset yielding `tensor([y])`, or y
    reshaped to a column) is the same shape: the loss is the plain sum of squared errors.
    Squeezing only the output would broadcast (N,) against (N, 1) into an (N, N) loss."""
    out = torch.tensor([[1.0], [2.0], [3.0]])
    target = torch.tensor([[1.0], [2.0], [4.0]])
    task = Regression()
    assert task.loss(out, (None, target)).item() == pytest.approx(1.0)
    assert task.loss(out, (None, target.squeeze(-1))).item() == pytest.approx(1.0)


def test_regression_evaluates_a_column_target():
    gen = torch.Generator().manual_seed(2)
    val = [(torch.randn(4, generator=gen), torch.randn(1, generator=gen)) for _ in range(5)]
    model = _linear(features=4, outputs=1)
    metrics = evaluate(model, Datasets(val, val), 2, FP32, CPU, Regression())
    x = torch.stack([s[0] for s in val])
    y = torch.stack([s[1] for s in val])
    with torch.no_grad():
        mse = F.mse_loss(model(x), y).item()
    assert metrics["val/mse"] == pytest.approx(mse, rel=1e-5)
    assert metrics[VAL_LOSS] == pytest.approx(mse, rel=1e-5)


# --------------------------------------------------------------------------- model outputs


@dataclass
class Output:
    """A dataclass-like model output, as Hugging Face's ModelOutput."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class Wrapped(nn.Module):
    """The same linear layer, its logits returned in one of several forms."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = _linear()

    def forward(self, x: torch.Tensor):  # noqa: ANN201
        logits = self.lin(x)
        if self.kind == "tensor":
            return logits
        if self.kind == "dict":
            return {"hidden": x, "logits": logits}
        if self.kind == "dataclass":
            return Output(logits=logits, hidden=x)
        if self.kind == "tuple":
            return (logits,)
        if self.kind == "dict without logits":
            return {"scores": logits}
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["dict", "dataclass"])
def test_a_dict_or_dataclass_output_gives_the_tensor_outputs_loss_step_and_metrics(kind):
    x, y = _classification_data()
    task = Classification()
    tensor_model, model = Wrapped("tensor"), Wrapped(kind)
    want = task.loss(tensor_model(x), (x, y))
    assert want.item() == pytest.approx(
        F.cross_entropy(tensor_model.lin(x), y, reduction="sum").item()
    )
    assert task.loss(model(x), (x, y)).item() == pytest.approx(want.item(), rel=1e-6)

    # Through a step and a validation as well.
    _sgd_step(tensor_model, _tuple_chunks(x, y, [3, 5]), task)
    _sgd_step(model, _tuple_chunks(x, y, [3, 5]), task)
    _assert_params(_params(model), _params(tensor_model))
    assert not torch.equal(model.lin.weight, _linear().weight)
    data = Splits(x, y, x, y, 4)
    assert evaluate(model, data, 3, FP32, CPU, task) == evaluate(
        tensor_model, data, 3, FP32, CPU, task
    )


@pytest.mark.parametrize(
    ("kind", "type_name"), [("tuple", "tuple"), ("dict without logits", "dict")]
)
def test_an_output_without_logits_raises_a_helpful_type_error(kind, type_name):
    x, y = _classification_data()
    output = Wrapped(kind)(x)
    with pytest.raises(TypeError, match=rf"returned a {type_name}\b.*Override Task\.predictions"):
        Classification().loss(output, (x, y))
    with pytest.raises(TypeError, match=r"'logits'"):
        logits_of(output)


def test_logits_of_each_form():
    t = torch.randn(2, 3)
    assert logits_of(t) is t
    assert logits_of({"logits": t, "loss": torch.tensor(1.0)}) is t
    assert logits_of(Output(logits=t)) is t


def test_overriding_predictions_reads_another_field():
    """What the TypeError advises: a task of one's own reads the output's other field."""

    class Scores(Classification):
        def predictions(self, output):  # noqa: ANN001, ANN201
            return output["scores"].float()

    x, y = _classification_data()
    model = Wrapped("dict without logits")
    want = F.cross_entropy(model.lin(x), y, reduction="sum")
    assert Scores().loss(model(x), (x, y)).item() == pytest.approx(want.item())


def test_predictions_are_float32_under_low_precision():
    model = TinyLM()
    batch = _lm_batch()
    task = LanguageModel()
    with Precision("bf16", "cpu").autocast():
        output = task.forward(model, batch)
    assert output.dtype == torch.bfloat16  # autocast ran the head in bf16...
    assert task.predictions(output).dtype == torch.float32  # ...the loss reads fp32


# --------------------------------------------------------------------------- batches


class Kwargs(nn.Module):
    """A model taking named inputs only, as Hugging Face's do."""

    def __init__(self):
        super().__init__()
        self.lin = _linear()

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(features * mask)


def test_a_dict_batch_feeds_every_key_but_the_target():
    x, y = _classification_data()
    mask = (torch.arange(6) % 2).float().expand(8, 6)
    batch = {"features": x, "mask": mask, "label": y}
    task = Classification(target_key="label")
    model = Kwargs()
    output = task.forward(model, batch)  # model(label=...) would be a TypeError
    torch.testing.assert_close(output, model.lin(x * mask))
    assert task.target(batch) is y
    want = F.cross_entropy(model.lin(x * mask), y, reduction="sum")
    assert task.loss(output, batch).item() == pytest.approx(want.item())
    assert task.units(batch) == 8

    # The same step as a tuple batch of the masked features.
    plain = _linear()
    _sgd_step(model, _dict_chunks(batch, [3, 5]), task)
    _sgd_step(plain, _tuple_chunks(x * mask, y, [3, 5]), Classification())
    _assert_params(_params(model), _params(plain))


def test_a_model_sees_only_the_input_keys():
    seen: list[set[str]] = []

    class AnyInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _linear()

        def forward(self, **inputs):  # noqa: ANN003, ANN201
            seen.append(set(inputs))
            return self.lin(inputs["features"])

    x, y = _classification_data()
    batch = {"features": x, "extra": torch.zeros(8), "labels": y}
    Classification().forward(AnyInputs(), batch)
    LanguageModel(target_key="extra").forward(AnyInputs(), batch)
    assert seen == [{"features", "extra"}, {"features", "labels"}]


@pytest.mark.parametrize(
    ("task", "key"),
    [(Classification(), "labels"), (Classification(target_key="y"), "y"),
     (LanguageModel(target_key="targets"), "targets"), (Regression(target_key="value"), "value")],
    ids=["classification", "classification-y", "language_model", "regression"],
)  # fmt: skip
def test_a_missing_target_key_raises_key_error_naming_it(task, key):
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "label": torch.zeros(2)}
    message = (
        rf"keys \['input_ids', 'label'\], none of them the target '{key}'; set task.target_key"
    )
    with pytest.raises(KeyError, match=message):
        task.target(batch)
    with pytest.raises(KeyError, match=message):
        task.loss(torch.zeros(2, 3, VOCAB), batch)
    if isinstance(task, LanguageModel):  # its units are counted from the target
        with pytest.raises(KeyError, match=message):
            task.units(batch)


def test_a_tuple_batch_feeds_its_first_item_and_targets_its_last():
    x, y = _classification_data()
    weights = torch.full((8,), 3.0)  # a middle item: neither input nor target
    inputs: list[torch.Tensor] = []

    class One(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _linear()

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            inputs.append(features)
            return self.lin(features)

    model, task = One(), Classification()
    for batch in [(x, weights, y), [x, y]]:
        output = task.forward(model, batch)
        assert inputs[-1] is x
        assert task.target(batch) is y
        want = F.cross_entropy(model.lin(x), y, reduction="sum")
        assert task.loss(output, batch).item() == pytest.approx(want.item())
        assert task.units(batch) == 8


def test_batch_size_of():
    x = torch.zeros(5, 3)
    assert batch_size_of((x, torch.zeros(5))) == 5
    assert batch_size_of({"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4, 7)}) == 4
    # 0-dim tensors (a scalar in the batch) are skipped; nested structures are searched.
    assert batch_size_of({"scale": torch.tensor(2.0), "inputs": {"x": x}}) == 5
    with pytest.raises(TypeError, match="at least one tensor, got dict"):
        batch_size_of({"name": "a", "scale": torch.tensor(1.0)})


# --------------------------------------------------------------------------- language model


def test_language_model_units_count_the_target_tokens():
    batch = _lm_batch()
    assert LanguageModel().units(batch) == sum(LENGTHS)
    assert Classification().units(batch) == len(LENGTHS)  # samples, for contrast
    assert LanguageModel.unit == "tokens" and Classification.unit == "samples"
    # Another padding value.
    labels = torch.tensor([[3, 0, 0], [0, 0, 0], [1, 2, 0]])
    assert LanguageModel(ignore_index=0).units({"labels": labels}) == 3
    assert LanguageModel().units({"labels": labels}) == 9


def _predictor(vocab: int = VOCAB) -> TinyLM:
    """Predicts token (t + 1) % V after token t, confidently but not certainly."""
    model = TinyLM(vocab=vocab, dim=vocab)
    with torch.no_grad():
        model.embed.weight.copy_(torch.eye(vocab))
        model.head.weight.copy_(3.0 * torch.eye(vocab).roll(1, dims=0))
        model.head.bias.zero_()
    return model


def _lm_samples(n: int, seed: int, pad: int = PAD, min_tokens: int = 0) -> list[dict]:
    """Dict samples of SEQ_LEN tokens with unequal numbers of target tokens; about half of
    the targets are the predictor's guess."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        input_ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=gen)
        guess = (input_ids + 1) % VOCAB
        other = torch.randint(0, VOCAB, (SEQ_LEN,), generator=gen)
        labels = torch.where(torch.rand(SEQ_LEN, generator=gen) < 0.5, guess, other)
        length = int(torch.randint(min_tokens, SEQ_LEN + 1, (), generator=gen))
        labels[length:] = pad
        samples.append({"input_ids": input_ids, "labels": labels})
    return samples


@pytest.mark.parametrize("pad", [PAD, -1])
def test_evaluate_language_model_per_token(pad):
    val = _lm_samples(7, seed=3, pad=pad)
    model = _predictor()
    task = LanguageModel(ignore_index=pad)
    metrics = evaluate(model, Datasets(val, val), 3, FP32, CPU, task)  # batches of 3, 3, 1

    input_ids = torch.stack([s["input_ids"] for s in val])
    labels = torch.stack([s["labels"] for s in val])
    keep = labels != pad
    with torch.no_grad():
        logits = model(input_ids)
    loss = F.cross_entropy(logits[keep], labels[keep]).item()
    correct = logits.argmax(-1)[keep] == labels[keep]
    acc = correct.float().mean().item()
    assert set(metrics) == {VAL_LOSS, VAL_ACC, VAL_PERPLEXITY}
    assert metrics[VAL_LOSS] == pytest.approx(loss, rel=1e-5)
    assert metrics[VAL_PERPLEXITY] == pytest.approx(math.exp(metrics[VAL_LOSS]), rel=1e-9)
    assert metrics[VAL_ACC] == pytest.approx(acc, abs=1e-6)

    # The data makes these checks discriminating: padding counted, or batch means averaged,
    # would give other figures.
    assert 0.2 < acc < 0.9
    assert (~keep).sum() > 0
    assert abs(correct.sum().item() / labels.numel() - acc) > 0.05
    batch_means = [
        F.cross_entropy(logits[i : i + 3][keep[i : i + 3]], labels[i : i + 3][keep[i : i + 3]])
        for i in range(0, 7, 3)
    ]
    assert abs(sum(batch_means).item() / 3 - loss) > 1e-3


def test_evaluate_a_language_model_whose_batch_is_all_padding():
    """A validation batch with no target token adds nothing (not NaN)."""
    val = _lm_samples(4, seed=5, min_tokens=1)
    val.append(
        {
            "input_ids": torch.zeros(SEQ_LEN, dtype=torch.int64),
            "labels": torch.full((SEQ_LEN,), PAD),
        }
    )
    model = _predictor()
    metrics = evaluate(model, Datasets(val, val), 4, FP32, CPU, LanguageModel())
    alone = evaluate(model, Datasets(val[:4], val[:4]), 4, FP32, CPU, LanguageModel())
    assert metrics == pytest.approx(alone, rel=1e-6)
    assert all(math.isfinite(v) for v in metrics.values())


# --------------------------------------------------------------------------- directions


class Unsure(Metric):
    """A metric that does not say which way is better."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total += preds.sum()

    def compute(self) -> torch.Tensor:
        return self.total


def test_directions_of_the_bundled_tasks():
    assert Classification().directions() == {VAL_ACC: MAXIMIZE, VAL_LOSS: MINIMIZE}
    assert LanguageModel().directions() == {
        VAL_ACC: MAXIMIZE,
        VAL_LOSS: MINIMIZE,
        VAL_PERPLEXITY: MINIMIZE,
    }
    assert Regression().directions() == {
        "val/mse": MINIMIZE,
        "val/mae": MINIMIZE,
        VAL_LOSS: MINIMIZE,
    }
    assert (MAXIMIZE, MINIMIZE) == ("maximize", "minimize")


def test_directions_name_exactly_what_evaluate_reports():
    x, y = _classification_data()
    lm_val = _lm_samples(4, seed=1)
    gen = torch.Generator().manual_seed(0)
    reg_val = [(torch.randn(6, generator=gen), torch.randn((), generator=gen)) for _ in range(4)]
    cases = [
        (Classification(), Splits(x, y, x, y, 4), _linear()),
        (LanguageModel(), Datasets(lm_val, lm_val), TinyLM()),
        (Regression(), Datasets(reg_val, reg_val), _linear(outputs=1)),
    ]
    for task, data, model in cases:
        metrics = evaluate(model, data, 3, FP32, CPU, task)
        assert set(metrics) == set(task.directions()), type(task).__name__
        assert all(math.isfinite(v) for v in metrics.values())


def test_a_metric_without_a_direction_is_refused_by_name():
    class Mine(Classification):
        def metrics(self):  # noqa: ANN201
            return {"acc": ArgmaxAccuracy(), "calibration": Unsure()}

    with pytest.raises(ValueError, match=r"'calibration' \(Unsure\) has higher_is_better=None"):
        Mine().directions()


def test_a_custom_metric_takes_its_direction_from_the_metric():
    class Mine(Classification):
        derived = {"error": MINIMIZE}

        def metrics(self):  # noqa: ANN201
            return {"top2": MulticlassAccuracy(num_classes=4, top_k=2), "mse": MeanSquaredError()}

    assert Mine().directions() == {
        "val/top2": MAXIMIZE,
        "val/mse": MINIMIZE,
        VAL_LOSS: MINIMIZE,
        "val/error": MINIMIZE,
    }


# --------------------------------------------------------------------------- a task of one's own


class SmoothedTopTwo(Classification):
    """Label smoothing, a top-2 accuracy of torchmetrics and a derived error rate."""

    derived = {"error": MINIMIZE}

    def __init__(self, num_classes: int):
        super().__init__(label_smoothing=0.1)
        self.num_classes = num_classes

    def metrics(self) -> dict[str, Metric]:
        return {
            "acc": ArgmaxAccuracy(),
            "top2": MulticlassAccuracy(num_classes=self.num_classes, top_k=2, average="micro"),
        }

    def derive(self, values: dict[str, float]) -> dict[str, float]:
        return {"error": 1.0 - values["acc"]}


def _fit(model, data, cfg, task, lr=0.1):  # noqa: ANN001, ANN202
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    num_train = len(data.train_y) if isinstance(data, Splits) else len(data.train)
    _, num_steps = steps_plan(num_train, cfg)
    scheduler = constant(optimizer, num_steps)
    return fit(Run(model, optimizer, scheduler, data, cfg, CPU, MemoryMeter(CPU, None), task=task))


def test_a_custom_task_through_fit():
    data = synthetic(num_samples=190, num_classes=5, channels=1, image_size=4, noise=2.0, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 5))
    task = SmoothedTopTwo(num_classes=5)
    cfg = TrainerConfig(batch_size=16, accum_steps=2, max_epochs=2)

    result = _fit(model, data, cfg, task)

    assert set(result.val) == set(task.directions()) == {VAL_ACC, "val/top2", VAL_LOSS, "val/error"}
    assert all("val/top2" in e and "val/error" in e for e in result.evals)
    figures = result.figures()
    for name, value in result.val.items():
        assert figures[name] == value
    # The figures are those of the final model, computed by hand.
    with torch.no_grad():
        logits = model(data.val_x)
    y = data.val_y
    acc = (logits.argmax(-1) == y).float().mean().item()
    top2 = (logits.topk(2, dim=-1).indices == y[:, None]).any(-1).float().mean().item()
    loss = F.cross_entropy(logits, y, label_smoothing=0.1).item()
    assert result.val[VAL_ACC] == pytest.approx(acc, abs=1e-6)
    assert result.val["val/top2"] == pytest.approx(top2, abs=1e-6)
    assert result.val["val/error"] == pytest.approx(1 - acc, abs=1e-6)
    assert result.val[VAL_LOSS] == pytest.approx(loss, rel=1e-5)
    # ...and they tell the metrics apart: top-2 above top-1, smoothing in the loss.
    assert top2 > acc + 0.05
    assert abs(F.cross_entropy(logits, y).item() - loss) > 1e-3
    assert acc > 0.4  # it trained (chance: 0.2)


def test_language_model_through_fit_counts_tokens_and_accumulates_exactly():
    """fit with micro-batches of 2 or 3 samples per step of 6 ends with the parameters of 1
    micro-batch of 6: the step divides by the tokens it counted on the host. The last step of
    an epoch is short (16 = 6 + 6 + 4)."""
    train = _lm_samples(16, seed=7)
    val = _lm_samples(5, seed=8)
    tokens = [int((s["labels"] != PAD).sum()) for s in train]
    assert len(set(tokens)) > 2

    runs = {}
    for batch_size, accum in [(6, 1), (2, 3), (3, 2)]:
        model = TinyLM()
        cfg = TrainerConfig(batch_size=batch_size, accum_steps=accum, max_epochs=2, seed=1)
        runs[batch_size, accum] = (
            _fit(model, Datasets(train, val), cfg, LanguageModel(), lr=0.5),
            model,
            cfg,
        )

    base, base_model, base_cfg = runs[6, 1]
    assert _distance(_params(base_model), _params(TinyLM())) > 0.01  # it trained
    for (result, model, _cfg), key in zip(runs.values(), runs, strict=True):
        _assert_params(_params(model), _params(base_model), msg=str(key))
        assert result.val == pytest.approx(base.val, rel=1e-5)

    # Units: tokens of the timed steps, in the order the sampler drew them.
    assert base.unit == "tokens"
    steps = list(StepSampler(len(train), base_cfg, base.num_steps).steps())
    first_timed = base.num_steps - base.timed_steps
    assert 0 < first_timed < base.num_steps
    timed_tokens = sum(
        tokens[i] for step in steps[first_timed:] for idx in step for i in idx.tolist()
    )
    assert base.timed_units == timed_tokens
    assert base.timed_units != base.timed_samples
    metrics = base.metrics()
    assert metrics[THROUGHPUT_TOKENS] == pytest.approx(base.timed_units / base.timed_seconds)
    figures = base.figures()
    assert figures[VAL_PERPLEXITY] == pytest.approx(math.exp(figures[VAL_LOSS]), rel=1e-9)
    assert set(base.val) == {VAL_LOSS, VAL_ACC, VAL_PERPLEXITY}


# --------------------------------------------------------------------------- ArgmaxAccuracy


def test_argmax_accuracy_leaves_out_the_ignore_index():
    # (N, T, V) logits against (N, T) targets; argmax is the token id given by `predicted`.
    predicted = torch.tensor([[1, 2, 3, 0], [4, 4, 1, 2]])
    logits = F.one_hot(predicted, 5).float()
    target = torch.tensor([[1, 0, 3, -100], [4, -100, -100, 2]])
    # kept: (1 ok, 0 wrong, 3 ok), (4 ok, 2 ok) -> 4 of 5; the 3 padding positions never
    # match a prediction, so counting them would give 4 of 8.
    metric = ArgmaxAccuracy(ignore_index=-100)
    metric.update(logits, target)
    assert metric.compute().item() == pytest.approx(4 / 5)
    plain = ArgmaxAccuracy()
    plain.update(logits, target)
    assert plain.compute().item() == pytest.approx(4 / 8)


def test_argmax_accuracy_ignores_a_valid_class_and_accumulates_over_updates():
    # ignore_index 0 is a class the model predicts: its correct predictions do not count.
    metric = ArgmaxAccuracy(ignore_index=0)
    metric.update(F.one_hot(torch.tensor([0, 0, 1, 2]), 3).float(), torch.tensor([0, 0, 1, 1]))
    assert metric.compute().item() == pytest.approx(1 / 2)
    metric.update(F.one_hot(torch.tensor([2, 1]), 3).float(), torch.tensor([2, 0]))
    assert metric.compute().item() == pytest.approx(2 / 3)  # over both updates: 2 of 3 kept
    metric.reset()
    metric.update(F.one_hot(torch.tensor([1]), 3).float(), torch.tensor([2]))
    assert metric.compute().item() == 0.0
    assert ArgmaxAccuracy.higher_is_better is True
