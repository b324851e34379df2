"""batchfit against the heuristics people use today, on bench/search_efficiency.py's workload.

    python bench/versus_heuristics.py                 # 12 batchfit trials, 3 rounds of finals
    python bench/versus_heuristics.py --trials 20 --rounds 5

The workload: small_cnn on digits (+experiment=resnet: SGD, cosine, lr linear in the
effective batch from optimizer.lr at 128), the memory budget at the median predicted peak of
the space, the target val/acc>=0.95. Three ways to choose a configuration:
- **largest batch that fits, grown** (PyTorch Lightning's BatchSizeFinder, mode `power`):
  batch 2, 4, 8, ... each for 3 optimizer steps until one runs out of memory; the last that
  ran is used, in fp32 without accumulation, with the linear lr rule from the default
  optimizer.lr;
- **largest batch that fits, halved** (Hugging Face Trainer's `auto_find_batch_size`,
  Accelerate's `find_executable_batch_size`): training starts at --start-batch and halves on
  every out-of-memory error; same precision and lr rule;
- **batchfit**: a study of --trials trials over the space (batch size x accumulation x
  precision x lr) optimising time/to_target_s, with its preflight and feasibility handling;
  the configuration of its fastest trial to the target.
The search cost is the wall seconds each spent choosing. Then each chosen configuration
trains to the target (up to --final-epochs) --rounds times, the approaches interleaved, by
the normal trial path; the figure is the median of time/to_target_s, the training seconds
until validation first met the target (the throughput's clock). Printed in one run, with
ratios. Verdict: batchfit's configuration reaches the target sooner than both heuristics'
(or they do not reach it); it sets the exit status.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import hydra
import optuna
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.search.core.record import PREDICTED_OOM, TrialRecord, records  # noqa: E402
from batchfit.search.core.trial_count import num_trained  # noqa: E402
from batchfit.search.study.driver import StudyDriver  # noqa: E402
from batchfit.tracking.metrics import TO_TARGET_S, VAL_ACC  # noqa: E402
from batchfit.train.measure.memory import OutOfMemory, release_memory  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402
from bench.sampler import compose, median_predicted_peak  # noqa: E402
from bench.search_efficiency import BASE, SPACE, TARGET  # noqa: E402

WORKLOAD = [
    "+experiment=resnet",
    "model=small_cnn",
    "model.width=16",
    "data=digits",
    "trainer.device=cpu",
    "mlflow.system_metrics=false",
]
DEFAULT = {"trainer.accum_steps": 1, "trainer.precision": "fp32"}  # the heuristics' settings
PROBE_STEPS = 3  # Lightning's steps_per_trial
MAX_BATCH = 1024  # digits has 1437 training samples


@dataclass
class Choice:
    approach: str
    config: dict  # batch size, accumulation, precision, lr
    search_s: float
    how: str  # what the search did, in words


def _fits(batch: int, budget: int, workloads: Workloads) -> bool:
    """A few real optimizer steps at `batch` under the budget: False on out-of-memory. The
    data comes from `workloads`: built once, as the heuristics' trainers hold theirs."""
    cfg = compose(
        [
            *WORKLOAD,
            f"trainer.batch_size={batch}",
            *(f"{k}={v}" for k, v in DEFAULT.items()),
            "trainer.max_epochs=null",
            f"trainer.max_steps={PROBE_STEPS}",
        ]
    )
    spec = plan(cfg, budget)
    try:
        run(cfg, spec, None, workloads.of(cfg))
        fitted = True
    except OutOfMemory:
        fitted = False
    release_memory(spec.device)
    return fitted


def grow(budget: int, lr: float, workloads: Workloads | None = None) -> Choice:
    """Lightning's BatchSizeFinder, mode power: double from 2 until out of memory."""
    workloads = workloads or Workloads()
    started, batch, tried = time.perf_counter(), 2, []
    # Lightning stops at the dataset too
    while batch <= MAX_BATCH and _fits(batch, budget, workloads):
        tried.append(batch)
        batch *= 2
    tried.append(batch)
    found = batch // 2
    return Choice(
        "largest that fits, grown (Lightning)",
        {"trainer.batch_size": found, **DEFAULT, "optimizer.lr": lr},
        time.perf_counter() - started,
        f"tried {', '.join(map(str, tried))}: {batch} ran out of memory",
    )


def halve(budget: int, lr: float, start: int, workloads: Workloads | None = None) -> Choice:
    """HF Trainer's auto_find_batch_size: start high, halve on every out-of-memory error. Its
    last attempt is the real training run (measured with the finals), not search cost."""
    workloads = workloads or Workloads()
    started, batch, tried = time.perf_counter(), start, []
    while not _fits(batch, budget, workloads):
        tried.append(batch)
        batch //= 2
        if batch < 1:
            raise SystemExit("not even a batch of 1 fits the budget")
    spent = time.perf_counter() - started
    return Choice(
        "largest that fits, halved (HF auto_find_batch_size)",
        {"trainer.batch_size": batch, **DEFAULT, "optimizer.lr": lr},
        spent,
        f"{', '.join(map(str, tried))} ran out of memory; {batch} ran",
    )


def _study(overrides: list[str], name: str, tmp: str) -> optuna.Study:
    overrides = [
        *WORKLOAD,
        *overrides,
        f"search.study_name={name}",
        f"search.storage=sqlite:///{tmp}/optuna.db",
        f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
        f"mlflow.artifact_root={tmp}/artifacts",
        f"search.target='{TARGET}'",
        "search.objectives=[time/to_target_s]",
    ]
    console = Console(file=io.StringIO(), width=160)
    driver = StudyDriver.prepare(compose(overrides), overrides, {"experiment": "resnet"}, console)
    driver.run()
    return driver.study


def batchfit(budget: int, trials: int, epochs: int, seed: int, tmp: str) -> Choice:
    params = ",".join(f"{k}:'choice({','.join(map(str, v))})'" for k, v in SPACE.items())
    started = time.perf_counter()
    study = _study(
        [
            f"search.memory_budget={budget}",
            f"trainer.max_epochs={epochs}",
            f"search.n_trials={trials}",
            f"seed={seed}",
            f"search.params={{{params}}}",
        ],
        "batchfit",
        tmp,
    )
    spent = time.perf_counter() - started
    if not study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        raise SystemExit(
            f"no batchfit trial reached {TARGET} within trainer.max_epochs={epochs}: nothing "
            "to compare (give more --epochs)"
        )
    best = study.best_trial
    kept = records(study.trials)
    trained = num_trained(kept)
    predicted = sum(t.outcome.reason == PREDICTED_OOM for t in kept)
    return Choice(
        "batchfit",
        dict(best.params),
        spent,
        f"{trained} trials trained, {predicted} proposals predicted not to fit; "
        f"best: trial {best.number}",
    )


def final(
    choice: Choice, budget: int, epochs: int, seed: int, tmp: str, name: str
) -> tuple[float, float]:
    """(time/to_target_s or inf, best val/acc) of one training run of the choice."""
    params = ",".join(f"{k}:'choice({v})'" for k, v in choice.config.items())
    study = _study(
        [
            f"search.memory_budget={budget}",
            f"trainer.max_epochs={epochs}",
            "search.n_trials=1",
            f"seed={seed}",
            "search.trial_time_budget_s=null",
            # the heuristics' batch may fit with no room to spare: only a real OOM stops it
            "search.preflight=false",
            f"search.params={{{params}}}",
        ],
        name,
        tmp,
    )
    (trial,) = study.trials
    if trial.state not in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
        raise SystemExit(
            f"the final run of {choice.approach} failed: {TrialRecord.of(trial).outcome.message}"
        )
    figures = TrialRecord.of(trial).outcome.metrics
    return figures.get(TO_TARGET_S, float("inf")), figures.get(VAL_ACC, float("nan"))


def _describe(config: dict) -> str:
    return (
        f"{config['trainer.batch_size']}x{config['trainer.accum_steps']} "
        f"{config['trainer.precision']} lr {config['optimizer.lr']:g}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12, help="batchfit's search.n_trials")
    parser.add_argument("--rounds", type=int, default=3, help="final runs per configuration")
    parser.add_argument("--epochs", type=int, default=6, help="trainer.max_epochs of a trial")
    parser.add_argument("--final-epochs", type=int, default=30)
    parser.add_argument("--start-batch", type=int, default=512, help="HF's starting batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    console = Console(width=140)
    with (
        hydra.initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"),
        tempfile.TemporaryDirectory() as tmp,
    ):
        budget = median_predicted_peak(BASE)
        lr = float(compose(WORKLOAD).optimizer.lr)
        console.print(
            f"budget {budget / 2**20:.2f} MiB; target {TARGET}; heuristics: fp32, no "
            f"accumulation, optimizer.lr={lr:g} at batch 128 scaled linearly"
        )
        workloads = Workloads()  # the heuristics' data, built once for both
        choices = [
            grow(budget, lr, workloads),
            halve(budget, lr, args.start_batch, workloads),
            batchfit(budget, args.trials, args.epochs, args.seed, tmp),
        ]
        for c in choices:
            console.print(f"{c.approach}: {_describe(c.config)} ({c.how}; {c.search_s:.1f} s)")
        results: dict[str, list[tuple[float, float]]] = {c.approach: [] for c in choices}
        for r in range(args.rounds):
            order = choices if r % 2 == 0 else choices[::-1]
            for i, c in enumerate(order):
                results[c.approach].append(
                    final(c, budget, args.final_epochs, args.seed, tmp, f"f{r}-{i}")
                )
    table = Table(title=f"Time to {TARGET}: search cost and the chosen configuration's training")
    for column in ("approach", "configuration", "search s", "time to target s (median)",
                   "runs reaching it", "val/acc at stop", "vs batchfit"):  # fmt: skip
        table.add_column(column, justify="right")
    ours = statistics.median(t for t, _ in results["batchfit"])
    for c in choices:
        times = [t for t, _ in results[c.approach]]
        median = statistics.median(times)
        reached = sum(t != float("inf") for t in times)
        ratio = f"{median / ours:.1f}x" if median != float("inf") and ours else "never reached"
        table.add_row(
            c.approach,
            _describe(c.config),
            f"{c.search_s:.1f}",
            f"{median:.2f}" if median != float("inf") else f"> {args.final_epochs} epochs",
            f"{reached}/{len(times)}",
            f"{statistics.median(a for _, a in results[c.approach]):.3f}",
            ratio if c.approach != "batchfit" else "1.0x",
        )
    console.print(table)
    heuristics = [
        statistics.median(t for t, _ in results[c.approach])
        for c in choices
        if c.approach != "batchfit"
    ]
    verdict = ours != float("inf") and all(ours < h for h in heuristics)
    console.print(
        f"[bold]{'PASS' if verdict else 'FAIL'}[/bold]: batchfit's configuration reaches the "
        f"target in {ours:.2f} s of training; the heuristics' in "
        + ", ".join(f"{h:.2f} s" if h != float("inf") else "never" for h in heuristics)
    )
    sys.exit(0 if verdict else 1)


if __name__ == "__main__":
    main()
