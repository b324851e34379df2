"""The search space a study takes when `search.params` is empty: the four levers batchfit
exists for, over ranges derived from the model, the data and the budget.

- trainer.batch_size: BATCH_CHOICES powers of two up to the largest batch predicted to fit
  the budget at accumulation 1 in the most frugal precision the device runs (bf16 where it
  runs, else fp32), capped at a quarter of the training set and MAX_BATCH;
- trainer.accum_steps: 1, 2, 4;
- trainer.precision: fp32 and what else the device runs fast (bf16; on CUDA also fp16, and
  tf32 from compute capability 8.0; the CPU has no fast fp16 kernels);
- optimizer.lr: log-uniform from a quarter of the configured rate to four times it.

It is written into the config before anything else reads it, so the fit report, the study's
records and a rerun command see it as if the user had given it.
"""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import DictConfig, open_dict

from batchfit.common.checks import ConfigError
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.memory.fitting import fits_budget
from batchfit.train.memory.predict import PredictionUnsupported
from batchfit.train.memory.preflight import step_margin
from batchfit.train.plan import plan
from batchfit.train.precision import unsupported_reason
from batchfit.train.workload import Workloads

BATCH_CHOICES = 5
MAX_BATCH = 1024
ACCUMULATIONS = (1, 2, 4)
LR_FACTOR = 4.0


def precisions(device: torch.device | DeviceSpec) -> list[str]:
    """The precisions worth searching on `device` (or the GPU planned for)."""
    wanted = ("fp32", "tf32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")
    return [p for p in wanted if unsupported_reason(p, device) is None]


def _power_below(n: int) -> int:
    return 1 << max(n.bit_length() - 1, 0)


def largest_batch(cfg: DictConfig, precision: str, workloads: Workloads) -> tuple[int, str]:
    """The largest power-of-two batch predicted to fit at accumulation 1, and why it stops
    there (the budget, or the cap)."""
    spec = plan(cfg, cfg.search.memory_budget)
    workload = workloads.of(cfg)
    num_train = workload.num_train
    cap = min(MAX_BATCH, _power_below(max(num_train // 4, 1)))
    try:
        predictor = workload.predictor(spec, cfg.optimizer)
    except PredictionUnsupported:
        guess = min(cap, _power_below(4 * spec.trainer.batch_size))
        return guess, "4x trainer.batch_size (memory cannot be predicted for this model)"
    margin = step_margin(cfg.search.preflight_margin, predictor).value
    fitting = 0
    batch = 1
    while batch <= cap:
        trainer = dataclasses.replace(
            spec.trainer, batch_size=batch, accum_steps=1, effective_batch_size=None,
            precision=precision,
        )  # fmt: skip
        try:
            peak = predictor.predict(trainer, num_train).peak_bytes
        except PredictionUnsupported:  # a step that does not run on fakes, or cannot be told
            guess = min(cap, _power_below(4 * spec.trainer.batch_size))
            return guess, "4x trainer.batch_size (memory cannot be predicted for this model)"
        if not fits_budget(peak, spec.limit_bytes, margin):
            break
        fitting, batch = batch, batch * 2
    if fitting == 0:
        return 1, "nothing fits the budget: see the fit report"
    why = "the largest predicted to fit the budget" if batch <= cap else "the cap"
    return fitting, f"{why}, in {precision}"


def default_params(
    cfg: DictConfig, workloads: Workloads | None = None
) -> tuple[dict[str, str], str]:
    """The space (search.params grammar) and a note that says what it is and why; the
    predictor comes from `workloads` (a study's, shared with its fit report and trials)."""
    spec = plan(cfg, cfg.search.memory_budget)
    kept = precisions(spec.target)
    frugal = "bf16" if "bf16" in kept else "fp32"
    largest, why = largest_batch(cfg, frugal, workloads or Workloads())
    smallest = max(1, largest >> (BATCH_CHOICES - 1))
    batches = [b for b in (1 << k for k in range(11)) if smallest <= b <= largest]
    lr = float(spec.base_lr)
    params = {
        "trainer.batch_size": f"choice({', '.join(map(str, batches))})",
        "trainer.accum_steps": f"choice({', '.join(map(str, ACCUMULATIONS))})",
        "trainer.precision": f"choice({', '.join(kept)})",
        "optimizer.lr": f"tag(log, interval({lr / LR_FACTOR:.3g}, {lr * LR_FACTOR:.3g}))",
    }
    note = (
        "search.params is empty: searching the four levers, "
        + "; ".join(f"{key}={text}" for key, text in params.items())
        + f" (batch sizes up to {largest}: {why}; lr from /{LR_FACTOR:g} to x{LR_FACTOR:g} "
        f"optimizer.lr={lr:g}). Give search.params to search your own."
    )
    return params, note


def with_default_space(cfg: DictConfig, workloads: Workloads | None = None) -> str | None:
    """Fill an empty search.params with default_params; the note, or None when the config
    has its own space (or cannot be planned: validation then says why). `workloads`: the
    study's, which keeps the data and predictor built here for what follows."""
    search = cfg.search
    if search.get("params") or search.get("accumulation") == "derived":
        return None
    if search.get("default_space") is not True:
        return None
    try:
        params, note = default_params(cfg, workloads)
    except ConfigError:
        return None
    with open_dict(cfg):
        cfg.search.params = params
    return note
