"""learning_failure (search/trial/objective.py): a run that trained to its end but did not learn
is named, with why: a loss that is not finite, no better than a uniform guess, or (without
that baseline) never below its first validation."""

from __future__ import annotations

import math

import pytest
import torch

from batchfit.search.trial.objective import learning_failure
from batchfit.tracking.metrics import VAL_ACC, VAL_LOSS
from batchfit.train.step import RunResult
from batchfit.train.tasks import CausalLM, Classification, Regression, Task


def _result(*losses: float, chance: float | None = math.log(10), acc: float = 0.1) -> RunResult:
    evals = [{VAL_LOSS: loss, VAL_ACC: acc} for loss in losses]
    return RunResult(
        num_steps=10, num_samples=100, throughput_samples_per_sec=1.0, step_ms=1.0,
        peak_bytes=0, reserved_bytes=None, train_loss=losses[-1], val=evals[-1], evals=evals,
        chance_loss=chance,
    )  # fmt: skip


def test_a_run_that_learned_is_no_failure() -> None:
    assert learning_failure(_result(2.0, 0.4)) is None
    assert learning_failure(_result(0.4)) is None  # one validation, below chance
    assert learning_failure(_result(5.0, chance=None)) is None  # no baseline, one validation
    # learned in its first epoch, then overfit: learned (below chance)
    assert learning_failure(_result(0.3, 0.5, 0.6)) is None
    assert learning_failure(_result(1.2, 0.9, 1.3, chance=None)) is None  # improved once
    # Above chance in loss, not in accuracy: overconfident where wrong (a quick start's
    # ResNet at lr 0.14: val/acc 0.616 at val/loss 4.9), it learned; at 0.19 of 10 classes, not.
    assert learning_failure(_result(4.9, acc=0.616)) is None
    assert learning_failure(_result(4.9, acc=0.2)) is None
    assert "no better than a uniform guess" in learning_failure(_result(4.9, acc=0.19))


@pytest.mark.parametrize(
    ("losses", "chance", "words"),
    [
        ((2.0, math.nan), math.log(10), "val/loss is nan"),
        ((math.inf,), None, "val/loss is inf"),
        # the data-parallel trial: weights blown up to a finite loss
        ((7.4e16,), math.log(10), "no better than a uniform guess over 10 classes"),
        ((2.31,), math.log(10), "(ln 10 = 2.303)"),
        ((1.2, 1.3, 1.25), None, "no validation after its first below the first's 1.2"),
        ((1.2, 1.2), None, "no validation after its first below the first's 1.2"),
    ],
)
def test_a_run_that_did_not_learn_says_why(losses, chance, words) -> None:
    found = learning_failure(_result(*losses, chance=chance))
    assert found is not None and found.startswith("did not learn") and words in found, found


def test_the_chance_loss_is_that_of_a_uniform_guess() -> None:
    logits = torch.zeros(4, 10)  # a uniform guess: its cross-entropy is the chance loss
    labels = torch.arange(4)
    for task in (Classification(), Classification(label_smoothing=0.1), Task()):
        loss = task.loss(logits, (logits, labels)) / 4
        assert task.chance_loss(logits) == pytest.approx(float(loss))
    tokens = torch.zeros(2, 5, 50)
    assert CausalLM().chance_loss(tokens) == pytest.approx(math.log(50))
    assert Regression().chance_loss(torch.zeros(3)) is None

    class OwnLoss(Classification):  # a loss of one's own: no baseline known
        def loss(self, output, batch):
            return super().loss(output, batch) * 2

    assert OwnLoss().chance_loss(logits) is None
    assert Classification().chance_loss(torch.zeros(4, 1)) is None  # one class: no guess
