"""Learning rate: scaling with the effective batch size, and the schedules."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def rule_for(optimizer_target: str) -> str:
    """The rule trainer.lr_scaling=auto takes for an optimizer (its `_target_`): linear for
    SGD (Goyal et al. 2017, "Accurate, Large Minibatch SGD", arXiv 1706.02677); square root
    for Adam-type optimizers (Malladi et al. 2022, "On the SDEs and Scaling Rules for
    Adaptive Gradient Algorithms", arXiv 2205.10287; LAMB and Adafactor with them); none
    for the others, for which no rule is established."""
    name = optimizer_target.rsplit(".", 1)[-1].lower()
    if any(family in name for family in ("adam", "lamb", "adafactor")):
        return "sqrt"
    if name.endswith("sgd"):
        return "linear"
    return "none"


def scaled_lr(base_lr: float, effective_batch_size: int, rule: str, ref_batch_size: int) -> float:
    """The rate for `effective_batch_size` when `base_lr` is right at `ref_batch_size`.

    linear: lr grows with the batch (Goyal et al. 2017, SGD); sqrt: with its square root
    (Krizhevsky 2014; the usual choice for Adam-type optimizers); none: as given.
    """
    ratio = effective_batch_size / ref_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown learning-rate scaling rule {rule!r}")


def constant(optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    """The rate as given for the whole run."""
    return LambdaLR(optimizer, lambda step: 1.0)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float = 0.1
) -> LambdaLR:
    """Linear warm-up over the first `warmup_fraction` of the steps, then cosine decay to 0."""
    warmup = max(1, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return LambdaLR(optimizer, factor)
