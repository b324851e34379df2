"""Does the gradient noise scale that every trial measures predict the critical batch?

    python bench/noise_scale.py             # MLP/digits and a small GPT, side by side (~4 min)
    python bench/noise_scale.py --quick     # 3 batch sizes, 2 learning rates, 1 seed (~1.5 min)
    python bench/noise_scale.py --tasks digits --seeds 3 --threads 2

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv 1812.06162):
training to a fixed loss at batch size B takes S = S_min (1 + B_crit / B) optimizer steps
at the best learning rate for that B, and the critical batch B_crit is predicted, up to a
factor of a few, by the simple noise scale B_simple = tr(Σ) / |G|² measured along the run.
This bench checks both claims on batchfit's own training path (`train.plan.plan` and
`train.run.run`, what a trial runs), on two tasks:

- **digits**: `model=mlp data=digits`, SGD (Nesterov momentum 0.9), constant learning rate;
- **gpt**: `+experiment=gpt` sized down for 2 CPU cores (see GPT below), AdamW, constant rate.

For each batch size B (the effective batch) and each learning rate of a small log-spaced
grid around batchfit's rule for the optimizer (linear in B for SGD, square root for AdamW),
one run trains with `trainer.accum_steps=2` (micro-batches of B/2, so the gradient is that
of batch B and the noise scale's accumulation estimator measures every step) and validates
every `val_every_steps`; `Hooks.on_eval` ends it at the first validation whose val/loss is
at or below the task's target. Its steps to target are interpolated linearly in val/loss
between that validation and the one before (a validation every step on digits makes this
exact). A run that cannot beat the best steps already seen at its batch and seed is stopped
there (it cannot be the best); a diverged run never reaches the target. The best rate of a
batch is the one with the fewest steps at seed 0; with --seeds N > 1 it is run again at
seeds 1..N-1 and the batch's steps are the mean over the N seeds (less of the lucky minimum
over rates in them).

B_simple is each run's `RunResult.noise.noise_scale`, the estimate of train/measure/noise.py that
a trial logs as stats/grad_noise_scale: the ratio of its two parts' means over the run's
measured steps, here every step to the target (B_crit is defined at it; the mean leans to
the early steps, where |G|² is largest). The task's B_simple is the median over
the runs at the best rates (every batch, every seed; NaN readings left out): each run
estimates the same quantity at the same loss, and a single run's estimate is noisy (small
batches difference two noisy norms; large batches have few steps), so the median is the
robust summary. The ratio of the pooled parts (mean tr(Σ) / mean |G|² over those runs) is
printed beside it as a cross-check.

S_min and B_crit come from `search.results.critical_batch.fit_steps`. Verdict (exit status 0 PASS,
1 FAIL): for every task, the predicted steps within 25% of the measured at every batch, and
B_simple within a factor of 3 of B_crit. The figures are printed either way.

bench/noise_stability.py asks a narrower question: is one trial's B_simple a measurement?
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.search.results.critical_batch import NoFit, StepsModel, fit_steps  # noqa: E402
from batchfit.tracking.metrics import (  # noqa: E402
    VAL_LOSS,
)
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.step import Diverged, Hooks  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

Compose = Callable[[list[str]], DictConfig]

STEPS_TOLERANCE = 0.25  # predicted steps within 25% of the measured, at every batch
NOISE_FACTOR = 3.0  # B_simple within a factor of 3 of B_crit
ACCUM_STEPS = 2  # micro-batches per step: the accumulation estimator measures every step

# What every run shares: a constant rate (a schedule would tie the rate to the run's length,
# which is what is measured), no epoch budget (max_steps bounds a run), the CPU.
COMMON = (
    "scheduler=constant",
    "trainer.device=cpu",
    "trainer.max_epochs=null",
    f"trainer.accum_steps={ACCUM_STEPS}",
    "trainer.lr_scaling=none",  # the grid below sets each run's rate itself
)


@dataclass(frozen=True)
class Setup:
    """One task of the bench: its config, batches, learning-rate grid and target."""

    name: str
    overrides: tuple[str, ...]
    sizes: str  # the sizes, in words, for the output
    batches: tuple[int, ...]  # effective batch sizes, in samples (sequences for the GPT)
    lr_ref: float  # the grid's centre at batch `batch_ref` ...
    batch_ref: int
    lr_power: float  # ... scaled as (B / batch_ref) ** lr_power: 1 linear, 0.5 sqrt
    lr_factors: tuple[float, ...]  # the grid: the centre times these
    target_loss: float  # val/loss that every run trains to
    max_steps: int  # a run that has not reached it by then does not
    val_every_steps: int

    def lrs(self, batch: int) -> list[float]:
        """The grid at `batch`, the centre first and then outwards: the rate likeliest to
        be best runs first, so that the others stop as soon as they fall behind it."""
        centre = self.lr_ref * (batch / self.batch_ref) ** self.lr_power
        factors = sorted(self.lr_factors, key=lambda f: (abs(math.log(f)), -f))
        return [float(f"{centre * f:.3g}") for f in factors]

    def overrides_for(self, batch: int, lr: float, seed: int) -> list[str]:
        if batch % ACCUM_STEPS:
            raise ValueError(f"batch {batch} does not split into {ACCUM_STEPS} micro-batches")
        return [
            *self.overrides,
            *COMMON,
            f"trainer.batch_size={batch // ACCUM_STEPS}",
            f"trainer.max_steps={self.max_steps}",
            f"trainer.val_every_steps={self.val_every_steps}",
            f"trainer.log_every_steps={self.val_every_steps}",
            f"optimizer.lr={lr}",
            f"seed={seed}",
        ]


# Calibrated on this machine (2 shared cores, 1 thread), seed 0, with a grid of 7 rates
# 0.01..0.64 at every batch: the fewest steps to val/loss 0.2 were at 0.04, 0.04, 0.04-0.16,
# 0.16 and 0.32 for B = 8..128 (roughly linear in B; 0.64 diverged from B = 32 up), in
# 107, 59, 52, 27 and 27 steps. The grid below brackets those optima at every batch.
DIGITS = Setup(
    name="digits",
    # The split fixed at seed 0: a seed changes the initialisation and the batch order, not
    # which images the target loss is measured on.
    overrides=("model=mlp", "data=digits", "data.seed=0", "optimizer=sgd"),
    sizes="MLP 64-256-256-10 on digits (1,437 train / 360 val images), SGD Nesterov 0.9",
    batches=(8, 16, 32, 64, 128),
    lr_ref=0.04,
    batch_ref=16,
    lr_power=1.0,
    lr_factors=(0.5, 1.0, 2.0, 4.0),
    target_loss=0.2,
    max_steps=400,
    val_every_steps=1,
)

# conf/experiment/gpt.yaml sized down for 2 CPU cores: 64 wide instead of 128, sequences of
# 64 bytes, the first 100 KB of the stdlib (90 KB train, 5 KB val). Calibrated at seed 0:
# to val/loss 2.3 nats per byte, B = 8 took 240 steps at 1e-3 and 200 at 2e-3, B = 64 took
# 140 at 1e-3 and 100 at 2e-3; 3e-3 and 1e-2 were slower than 1e-3 to 2.6 at both.
GPT = Setup(
    name="gpt",
    overrides=(
        "+experiment=gpt",
        "optimizer=adamw",
        "model.n_embd=64",
        "data.seq_len=64",
        "data.max_bytes=100000",
        "data.val_fraction=0.05",
        "trainer.precision=fp32",
    ),
    sizes="GPT 2 layers x 64 wide, 4 heads, 64-byte sequences, 100 KB of the stdlib, AdamW",
    batches=(4, 8, 16, 32, 64),
    lr_ref=2e-3,
    batch_ref=16,
    lr_power=0.5,
    lr_factors=(0.5, 1.0, 2.0),
    target_loss=2.3,
    max_steps=1500,
    val_every_steps=10,
)

SETUPS = {s.name: s for s in (DIGITS, GPT)}


def quick(setup: Setup) -> Setup:
    """A smaller run of the same task: 3 batch sizes, the 2 middle rates."""
    b = setup.batches
    middle = len(setup.lr_factors) // 2
    return dataclasses.replace(
        setup,
        batches=(b[0], b[len(b) // 2], b[-1]),
        lr_factors=setup.lr_factors[max(0, middle - 1) : middle + 1],
    )


@dataclass(frozen=True)
class Run:
    """One training run to the target."""

    batch: int
    lr: float
    seed: int
    steps: float  # to the target, interpolated; inf where it was not reached
    how: str  # target | stopped (no better than the best) | diverged | max_steps
    noise_scale: float  # B_simple, NaN where the run read none
    grad_sq_norm: float
    grad_variance: float
    estimator: str
    seconds: float


def steps_to_target(evals: Sequence[tuple[int, float]], target: float) -> float:
    """The step at which val/loss first reached `target`, from (step, val/loss) pairs:
    linear in the loss between the first validation at or below it and the one before;
    inf where none is."""
    previous = None
    for step, loss in evals:
        if loss <= target:
            if previous is None or not previous[1] > target:
                return float(step)
            (p_step, p_loss) = previous
            return p_step + (step - p_step) * (p_loss - target) / (p_loss - loss)
        previous = (step, loss)
    return math.inf


def train_to_target(
    compose: Compose,
    workloads: Workloads,
    setup: Setup,
    batch: int,
    lr: float,
    seed: int,
    cap: float = math.inf,
) -> Run:
    """One run of `setup` at (batch, lr, seed) until val/loss reaches the target, or past
    `cap` steps (it cannot beat a run that reached it in `cap`), or max_steps."""
    cfg = compose(setup.overrides_for(batch, lr, seed))
    spec = plan(cfg, None)
    evals: list[tuple[int, float]] = []
    stopped: list[str] = []

    def on_eval(step: int, metrics: dict[str, float]) -> bool:
        evals.append((step, metrics[VAL_LOSS]))
        if metrics[VAL_LOSS] <= setup.target_loss:
            stopped.append("target")
        elif step >= cap:
            stopped.append("stopped")
        return bool(stopped)

    started = time.perf_counter()
    try:
        result = run(cfg, spec, Hooks(on_eval=on_eval), workloads.of(cfg))
    except Diverged:
        nan = math.nan
        return Run(batch, lr, seed, math.inf, "diverged", nan, nan, nan, "", _since(started))
    noise = result.noise
    return Run(
        batch=batch,
        lr=lr,
        seed=seed,
        steps=steps_to_target(evals, setup.target_loss),
        how=stopped[0] if stopped else "max_steps",
        noise_scale=noise.noise_scale if noise else math.nan,
        grad_sq_norm=noise.grad_sq_norm if noise else math.nan,
        grad_variance=noise.grad_variance if noise else math.nan,
        estimator=result.noise_estimator,
        seconds=_since(started),
    )


def _since(started: float) -> float:
    return time.perf_counter() - started


@dataclass
class Point:
    """A batch size at its best learning rate."""

    batch: int
    lr: float
    runs: list[Run]  # at that rate, one per seed
    swept: list[Run] = field(default_factory=list)  # seed 0 at every rate

    @property
    def steps(self) -> float:
        return statistics.fmean(r.steps for r in self.runs)

    @property
    def at_edge(self) -> bool:
        """The best rate is the grid's lowest or highest: a rate beyond it may be better."""
        rates = [r.lr for r in self.swept]
        return len(rates) > 1 and self.lr in (min(rates), max(rates))

    @property
    def noise_scale(self) -> float:
        return _median([r.noise_scale for r in self.runs])


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def sweep_batch(
    compose: Compose, workloads: Workloads, setup: Setup, batch: int, seeds: int
) -> Point | None:
    """The batch's rates at seed 0, and its best rate at every seed; None where no rate
    reached the target."""
    best: Run | None = None
    swept = []
    for lr in setup.lrs(batch):
        cap = best.steps if best else math.inf
        swept.append(train_to_target(compose, workloads, setup, batch, lr, 0, cap))
        if swept[-1].steps < cap:
            best = swept[-1]
    if best is None:
        return None
    runs = [best] + [
        train_to_target(compose, workloads, setup, batch, best.lr, seed) for seed in range(1, seeds)
    ]
    return Point(batch, best.lr, runs, swept)


@dataclass
class Outcome:
    """A task's measurements, fit and verdict."""

    setup: Setup
    points: list[Point]
    model: StepsModel | None
    no_fit: str  # why there is no model, where there is none
    missing: list[int]  # batches where no rate reached the target
    seconds: float

    @property
    def noise_scale(self) -> float:
        """The task's B_simple: the median over every run at a best rate."""
        return _median([r.noise_scale for p in self.points for r in p.runs])

    @property
    def pooled_noise_scale(self) -> float:
        """mean tr(Σ) / mean |G|² over the same runs (the cross-check)."""
        runs = [
            r
            for p in self.points
            for r in p.runs
            if math.isfinite(r.grad_sq_norm) and math.isfinite(r.grad_variance)
        ]
        if not runs:
            return math.nan
        sq = statistics.fmean(r.grad_sq_norm for r in runs)
        return statistics.fmean(r.grad_variance for r in runs) / sq if sq > 0 else math.nan

    def failures(self) -> list[str]:
        return verdict(self.model, self.noise_scale, self.missing, self.no_fit)


def measure(compose: Compose, setup: Setup, seeds: int, log: Callable[[str], None]) -> Outcome:
    """Every batch of `setup` at its best rate, and the model fitted to them."""
    started = time.perf_counter()
    workloads = Workloads()  # the data built once for all the task's runs
    points, missing = [], []
    for batch in setup.batches:
        point = sweep_batch(compose, workloads, setup, batch, seeds)
        log(_sweep_line(setup, batch, point))
        if point is None:
            missing.append(batch)
        else:
            points.append(point)
    model, no_fit = None, ""
    try:
        model = fit_steps([p.batch for p in points], [p.steps for p in points])
    except NoFit as error:
        no_fit = str(error)
    return Outcome(setup, points, model, no_fit, missing, time.perf_counter() - started)


def _sweep_line(setup: Setup, batch: int, point: Point | None) -> str:
    if point is None:
        return f"  {setup.name} B={batch}: no rate of {setup.lrs(batch)} reached the target"
    swept = sorted(point.swept, key=lambda r: r.lr)
    tried = ", ".join(f"{r.lr:g}: {_steps(r.steps)} ({r.how})" for r in swept)
    seeds = ", ".join(_steps(r.steps) for r in point.runs)
    edge = " (the grid's edge)" if point.at_edge else ""
    return f"  {setup.name} B={batch}: {tried}; best {point.lr:g}{edge}, seeds {seeds}"


def _steps(steps: float) -> str:
    return f"{steps:.1f}" if math.isfinite(steps) else "-"


def verdict(
    model: StepsModel | None, noise_scale: float, missing: Sequence[int] = (), no_fit: str = ""
) -> list[str]:
    """Why a task fails: a batch that never reached the target, no fit, a predicted step
    count more than STEPS_TOLERANCE off the measured, B_simple more than NOISE_FACTOR from
    B_crit (or not measured). Empty: it passes."""
    reasons = [f"batch {b} reached the target at no learning rate" for b in missing]
    if model is None:
        return [*reasons, f"no fit: {no_fit}"]
    for batch, steps in model.points:
        error = (model.steps(batch) - steps) / steps
        if abs(error) > STEPS_TOLERANCE:
            reasons.append(
                f"batch {batch:g}: predicted {model.steps(batch):.1f} steps against "
                f"{steps:.1f} measured ({error:+.0%}, over {STEPS_TOLERANCE:.0%})"
            )
    ratio = noise_scale / model.b_crit
    if not math.isfinite(ratio) or ratio <= 0:
        reasons.append(f"B_simple is {noise_scale:.3g}: no noise scale to compare")
    elif not 1 / NOISE_FACTOR <= ratio <= NOISE_FACTOR:
        reasons.append(
            f"B_simple {noise_scale:.3g} is {ratio:.2f}x B_crit {model.b_crit:.3g}, "
            f"outside 1/{NOISE_FACTOR:g}..{NOISE_FACTOR:g}x"
        )
    return reasons


def table(outcome: Outcome) -> list[str]:
    """The task's table: batch, best lr, measured and predicted steps, error, B_simple;
    then S_min, B_crit and B_simple / B_crit."""
    setup, model = outcome.setup, outcome.model
    lines = [
        f"{setup.name}: {setup.sizes}; target val/loss {setup.target_loss:g}",
        "| batch | best lr | measured steps | predicted steps | error | B_simple measured |",
        "|------:|--------:|---------------:|----------------:|------:|------------------:|",
    ]
    for p in outcome.points:
        predicted = model.steps(p.batch) if model else math.nan
        error = (predicted - p.steps) / p.steps
        lr = f"{p.lr:g}{'*' if p.at_edge else ''}"
        lines.append(
            f"| {p.batch} | {lr} | {p.steps:.1f} | {predicted:.1f} | {error:+.1%} "
            f"| {p.noise_scale:.3g} |"
        )
    for batch in outcome.missing:
        lines.append(f"| {batch} | - | not reached | - | - | - |")
    if any(p.at_edge for p in outcome.points):
        lines.append("* the grid's lowest or highest rate: one beyond it may take fewer steps")
    b_simple = outcome.noise_scale
    if model is None:
        lines.append(f"no fit: {outcome.no_fit}; B_simple {b_simple:.3g}")
    else:
        lines.append(
            f"S_min {model.s_min:.1f} steps, B_crit {model.b_crit:.3g}, "
            f"B_simple {b_simple:.3g} (median of {_num_readings(outcome)} runs; pooled parts "
            f"{outcome.pooled_noise_scale:.3g}), B_simple / B_crit {b_simple / model.b_crit:.2f}"
        )
    estimators = {r.estimator for p in outcome.points for r in p.runs if r.estimator}
    lines.append(f"noise scale estimator: {'; '.join(sorted(estimators)) or 'none'}")
    lines.append(f"wall time {outcome.seconds:.0f} s")
    return lines


def _num_readings(outcome: Outcome) -> int:
    return sum(math.isfinite(r.noise_scale) for p in outcome.points for r in p.runs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every task passes (predicted steps within 25%% of the "
        "measured at every batch, B_simple within 3x of B_crit), 1 otherwise.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 batch sizes, 2 rates, 1 seed: a smoke run"
    )
    parser.add_argument(
        "--tasks", nargs="+", choices=list(SETUPS), default=list(SETUPS), help="which tasks"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds at each best rate (default 2; --quick: 1)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = 1 if args.quick else (args.seeds or 2)
    setups = [quick(SETUPS[n]) if args.quick else SETUPS[n] for n in args.tasks]
    from hydra import compose, initialize_config_dir

    outcomes = []
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        for setup in setups:
            print(f"{setup.name}: batches {list(setup.batches)}, {seeds} seed(s)", flush=True)
            outcomes.append(measure(_composer(compose), setup, seeds, _print_flush))
    failed = False
    for outcome in outcomes:
        print()
        print("\n".join(table(outcome)))
        reasons = outcome.failures()
        failed |= bool(reasons)
        print(f"{outcome.setup.name}: {'FAIL' if reasons else 'PASS'}")
        for reason in reasons:
            print(f"  - {reason}")
    print(f"\nverdict: {'FAIL' if failed else 'PASS'}")
    return int(failed)


def _composer(compose: Callable[..., DictConfig]) -> Compose:
    return lambda overrides: compose(config_name="config", overrides=overrides)


def _print_flush(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
