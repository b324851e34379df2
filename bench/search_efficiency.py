"""How many trials does each sampler need? A tabular benchmark: every configuration of a small
real space trained once, then the samplers replayed against the table, with no training.

    python bench/search_efficiency.py --build    # train the table (a grid study, minutes)
    python bench/search_efficiency.py            # replay 30 seeds per sampler (a minute or two)
    python bench/search_efficiency.py --seeds 50 --table other.csv

The space: small_cnn on scikit-learn's digits (+experiment=resnet's settings: SGD, cosine,
linear lr scaling), batch size 16..512 x accumulation 1,2 x precision fp32,bf16 x 4 learning
rates, 96 configurations, under a memory budget at the median predicted peak, so that about
half do not fit. `--build` runs them all as one grid study through
`search.study.driver.StudyDriver`, the code behind `python -m search`: each row is a trial,
predicted, trained (stopping at search.target), pruned or recorded as that path does. The table
(search_efficiency.csv, committed beside this file) holds per configuration: the outcome, val
accuracy, throughput, time to the target accuracy, peak and predicted memory, and the trial's
wall seconds. Its figures are this machine's: a CPU without fast bf16 kernels prunes bf16 as
`slow`.

The replay asks each sampler for trials and answers from the table:
- single objective, time/to_target_s (min): random, grid (Optuna's GridSampler, random
  order), TPE as batchfit configures it, batchfit (the same TPE behind search/sampling/sampler.py's
  FeasibilityFilter, with proposals predicted not to fit and repeats answered without taking a
  trial slot, by search/core/trial_count.py's answer_for and search/trial/objective.py's
  answer_from_record), and GP;
- two objectives, val/acc and throughput (max, max): random, grid, TPE, batchfit, NSGA-II.
A configuration that does not fit is a pruned trial that takes a slot (batchfit: none when it
was predicted, but the prediction's seconds count); with one objective, a configuration that
misses the target or is too slow is a pruned trial; with two (no target), one that missed
the target is a complete trial with its final accuracy, a slow one a pruned trial.
GP models only COMPLETE trials, so it samples at random until 10 have reached the target.
Printed per sampler: the median trial slots and table-seconds (the sum of the rows' wall
seconds, what the search would have cost) until a trial within 5% of the best feasible time
to target, the slots spent on infeasible configurations, and the hypervolume after 20 slots
(two objectives).

Targets: batchfit needs at most 1/3 of the grid's size to get within 5%, and at least 2x fewer
trials than random (medians). The verdict sets the exit status.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import hydra
import numpy as np
import optuna
from optuna._hypervolume import compute_hypervolume
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.search.core.record import CONSTRAINT, OOM, OOM_REASONS, PREDICTED_OOM, TrialRecord  # noqa: E402
from batchfit.search.core.trial_count import MAX_UNBILLED_IN_A_ROW, answer_for, study_records  # noqa: E402
from batchfit.search.sampling.sampler import FeasibilityFilter  # noqa: E402
from batchfit.search.study.driver import StudyDriver  # noqa: E402
from batchfit.search.trial import ending  # noqa: E402
from batchfit.search.trial.objective import answer_from_record  # noqa: E402
from batchfit.tracking.metrics import THROUGHPUT_SAMPLES, TO_TARGET_S, VAL_ACC  # noqa: E402
from bench.sampler import compose, median_predicted_peak  # noqa: E402

TABLE = Path(__file__).with_name("search_efficiency.csv")
TARGET = f"{VAL_ACC}>=0.95"
SPACE = {
    "trainer.batch_size": [16, 32, 64, 128, 256, 512],
    "trainer.accum_steps": [1, 2],
    "trainer.precision": ["fp32", "bf16"],
    "optimizer.lr": [0.01, 0.03, 0.1, 0.3],
}
BASE = [
    "+experiment=resnet",
    "model=small_cnn",
    "model.width=16",
    "data=digits",
    "trainer.max_epochs=6",
    "trainer.device=cpu",
    "search/sampler=grid",
    "search.trial_time_budget_s=20",  # bf16 without fast kernels: pruned as slow, not waited for
    f"search.target='{TARGET}'",
    "search.objectives=[val/acc,throughput/samples_per_sec]",
    "mlflow.system_metrics=false",
    "+search.params={"
    + ",".join(f"{k}:'choice({','.join(map(str, v))})'" for k, v in SPACE.items())
    + "}",
]
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
WITHIN = 0.05  # "within 5% of the best"
HV_AFTER = 20  # hypervolume after this many trial slots


@dataclass
class Row:
    batch_size: int
    accum_steps: int
    precision: str
    lr: float
    outcome: str  # COMPLETE, or the reason it was pruned (oom_predicted, missed_target, slow)
    val_acc: float | None
    throughput: float | None  # samples/s
    time_to_target_s: float | None
    peak_bytes: int | None
    predicted_bytes: int | None
    trial_s: float

    @property
    def key(self) -> tuple:
        return (self.batch_size, self.accum_steps, self.precision, self.lr)

    @property
    def fits(self) -> bool:
        return self.outcome not in OOM_REASONS


def build(path: Path, console: Console) -> None:
    """Every configuration once, as a grid study through the normal trial path."""
    size = math.prod(len(v) for v in SPACE.values())
    with (
        hydra.initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"),
        tempfile.TemporaryDirectory() as tmp,
    ):
        budget = median_predicted_peak(BASE)
        console.print(f"budget {budget / 2**20:.2f} MiB (median predicted peak); {size} trials")
        overrides = [
            *BASE,
            f"search.n_trials={size}",
            f"search.memory_budget={budget}",
            "search.study_name=search-efficiency",
            f"search.storage=sqlite:///{tmp}/optuna.db",
            f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"mlflow.artifact_root={tmp}/artifacts",
        ]
        driver = StudyDriver.prepare(
            compose(overrides), overrides, {"experiment": "resnet"}, console
        )
        driver.run()
        rows = {}
        for t in driver.study.get_trials(deepcopy=False):
            a = TrialRecord.of(t)
            if a.is_repeat or t.state not in FINISHED:
                continue
            figures = a.outcome.metrics
            row = Row(
                batch_size=t.params["trainer.batch_size"],
                accum_steps=t.params["trainer.accum_steps"],
                precision=t.params["trainer.precision"],
                lr=t.params["optimizer.lr"],
                outcome=a.outcome.reason or t.state.name,
                val_acc=figures.get(VAL_ACC),
                throughput=figures.get(THROUGHPUT_SAMPLES),
                time_to_target_s=figures.get(TO_TARGET_S),
                peak_bytes=a.outcome.peak_bytes,
                predicted_bytes=a.outcome.predicted_bytes,
                trial_s=a.seconds or 0.0,
            )
            rows[row.key] = row
    missing = size - len(rows)
    if missing:
        raise SystemExit(f"{missing} configurations have no row: see the study's output above")
    write(path, list(rows.values()), budget)


def write(path: Path, rows: list[Row], budget: int) -> None:
    with path.open("w", newline="") as file:
        file.write(
            "# Every configuration of bench/search_efficiency.py's space, trained once through\n"
            "# the normal trial path (a grid study). Regenerate:\n"
            "#   python bench/search_efficiency.py --build\n"
            f"# search.memory_budget={budget} bytes; search.target={TARGET}\n"
        )
        writer = csv.writer(file)
        writer.writerow([f.name for f in fields(Row)])
        for row in sorted(rows, key=lambda r: r.key):
            writer.writerow(
                ["" if v is None else v for v in (getattr(row, f.name) for f in fields(Row))]
            )


def read(path: Path) -> dict[tuple, Row]:
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    rows = {}
    for values in csv.DictReader(lines):
        typed = {}
        for f in fields(Row):
            text = values[f.name]
            kind = f.type.split(" |")[0]
            typed[f.name] = (
                None if text == "" else {"int": int, "float": float, "str": str}[kind](text)
            )
        row = Row(**typed)
        rows[row.key] = row
    return rows


# --- The replay --------------------------------------------------------------------------


@dataclass
class Replay:
    slots_to_within: int | None  # trial slots until a trial within WITHIN of the best
    seconds_to_within: float | None
    infeasible_slots: int  # slots spent on configurations that do not fit
    hypervolume: float | None  # after HV_AFTER slots, two objectives


def samplers(two: bool) -> dict[str, Callable[[int], optuna.samplers.BaseSampler]]:
    grid = {k: list(v) for k, v in SPACE.items()}

    def tpe(seed: int) -> optuna.samplers.BaseSampler:
        # As conf/search/sampler/tpe.yaml and +experiment=resnet configure it.
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=6)

    found = {
        "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
        "grid": lambda seed: optuna.samplers.GridSampler(grid, seed=seed),
        "TPE": tpe,
        "batchfit (TPE + feasibility)": lambda seed: FeasibilityFilter(tpe(seed)),
    }
    if two:
        found["NSGA-II"] = lambda seed: optuna.samplers.NSGAIISampler(seed=seed)
    else:
        found["GP"] = lambda seed: optuna.samplers.GPSampler(seed=seed)
    return found


def _ended(trial: optuna.Trial, reason: str) -> None:
    """Record `trial` as pruned for `reason`, as search/trial/ending.py records a trial."""
    ended = ending.ended("PRUNED", reason)
    ending.write(trial, TrialRecord(trial.number, "PRUNED", outcome=ended))


def replay(
    table: dict[tuple, Row],
    make: Callable[[int], optuna.samplers.BaseSampler],
    seed: int,
    two: bool,
    batchfit: bool,
    max_slots: int,
) -> Replay:
    best = min(r.time_to_target_s for r in table.values() if r.time_to_target_s is not None)
    study = optuna.create_study(
        directions=["maximize", "maximize"] if two else ["minimize"], sampler=make(seed)
    )
    reached: tuple[int, float] | None = None
    slots, seconds, infeasible, unbilled_in_a_row = 0, 0.0, 0, 0
    front: list[tuple[float, float]] = []
    hypervolume = None
    max_throughput = max(r.throughput or 0.0 for r in table.values())

    def objective(trial: optuna.Trial) -> float | list[float]:
        nonlocal slots, seconds, infeasible, reached
        params = {k: trial.suggest_categorical(k, v) for k, v in SPACE.items()}
        row = table[tuple(params.values())]
        if batchfit:
            earlier = answer_for(study_records(study), trial.number, params)
            if earlier is not None:
                return answer_from_record(trial, earlier)  # not billed
        if not row.fits:
            free = batchfit and row.outcome == PREDICTED_OOM  # a real OOM takes a slot
            _ended(trial, PREDICTED_OOM if free else OOM)
            trial.set_constraint(CONSTRAINT, 1.0)
            seconds += row.trial_s  # a prediction's time counts, though it takes no slot
            if not free:
                slots += 1
                infeasible += 1
            raise optuna.TrialPruned()
        slots += 1
        seconds += row.trial_s
        trial.set_constraint(CONSTRAINT, -1.0)
        if two:
            if row.outcome != "COMPLETE" and row.val_acc is None:
                _ended(trial, row.outcome)
                raise optuna.TrialPruned()
            front.append((row.val_acc, row.throughput / max_throughput))
            return [row.val_acc, row.throughput]
        if row.time_to_target_s is None:
            _ended(trial, row.outcome)
            raise optuna.TrialPruned()
        if reached is None and row.time_to_target_s <= (1 + WITHIN) * best:
            reached = (slots, seconds)
        return row.time_to_target_s

    size = len(table)
    while slots < max_slots and unbilled_in_a_row < MAX_UNBILLED_IN_A_ROW:
        if isinstance(study.sampler, optuna.samplers.GridSampler) and study.sampler.is_exhausted(
            study
        ):
            break
        if batchfit and len({tuple(t.params.items()) for t in study.trials}) >= size:
            break  # every configuration known: the driver ends such a study
        before = slots
        study.optimize(objective, n_trials=1)
        unbilled_in_a_row = unbilled_in_a_row + 1 if slots == before else 0
        if two and slots == HV_AFTER and hypervolume is None:
            hypervolume = _hypervolume(front)
        if not two and reached is not None:
            break
    if two and hypervolume is None:
        hypervolume = _hypervolume(front)
    return Replay(
        reached[0] if reached else None, reached[1] if reached else None, infeasible, hypervolume
    )


def _hypervolume(points: list[tuple[float, float]]) -> float:
    """Of (val acc, throughput / the table's best), both maximised, from the origin."""
    if not points:
        return 0.0
    losses = -np.array(points, dtype=float)
    return float(compute_hypervolume(losses, np.zeros(2)))


def _median(values: list[float | None], cap: float) -> float:
    """The median with a sampler that never got there counted past every finite value."""
    return statistics.median([cap if v is None else v for v in values])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", action="store_true", help="train the table first")
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument("--seeds", type=int, default=30)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    console = Console(width=130)
    if args.build:
        build(args.table, console)
    table = read(args.table)
    size = len(table)
    feasible = [r for r in table.values() if r.fits]
    reaching = sorted(r.time_to_target_s for r in feasible if r.time_to_target_s is not None)
    best = reaching[0]
    within = sum(t <= (1 + WITHIN) * best for t in reaching)
    console.print(
        f"table: {size} configurations, {size - len(feasible)} do not fit the budget, "
        f"{len(reaching)} reach {TARGET}; best time to target {best:.2f} s, {within} within "
        f"{WITHIN:.0%} of it; training them all took {sum(r.trial_s for r in table.values()):.0f} s"
    )
    cap = 2 * size  # random draws with replacement: it may need more slots than the grid
    results: dict[str, list[Replay]] = {}
    single = Table(title=f"Time to {TARGET}: trial slots until within {WITHIN:.0%} of the best "
                   f"({args.seeds} seeds; medians)")  # fmt: skip
    for column in ("sampler", "slots", "table-seconds", "not reached", "infeasible slots"):
        single.add_column(column, justify="right")
    for name, make in samplers(two=False).items():
        runs = [
            replay(table, make, seed, False, name.startswith("batchfit"), cap)
            for seed in range(args.seeds)
        ]
        results[name] = runs
        slots = _median([r.slots_to_within for r in runs], math.inf)
        seconds = _median([r.seconds_to_within for r in runs], math.inf)
        single.add_row(
            name,
            f"{slots:g}",
            f"{seconds:.0f}",
            str(sum(r.slots_to_within is None for r in runs)),
            f"{statistics.median(r.infeasible_slots for r in runs):g}",
        )
    console.print(single)
    pair = Table(title=f"val/acc x throughput: hypervolume after {HV_AFTER} trial slots "
                 f"({args.seeds} seeds)")  # fmt: skip
    for column in ("sampler", "median", "min", "max", "infeasible slots"):
        pair.add_column(column, justify="right")
    full = _hypervolume(
        [
            (r.val_acc, r.throughput / max(x.throughput or 0 for x in table.values()))
            for r in feasible
            if r.val_acc is not None and r.throughput
        ]  # fmt: skip
    )
    for name, make in samplers(two=True).items():
        runs = [
            replay(table, make, seed, True, name.startswith("batchfit"), HV_AFTER)
            for seed in range(args.seeds)
        ]
        volumes = [r.hypervolume for r in runs]
        pair.add_row(
            name,
            f"{statistics.median(volumes):.4f}",
            f"{min(volumes):.4f}",
            f"{max(volumes):.4f}",
            f"{statistics.median(r.infeasible_slots for r in runs):g}",
        )
    console.print(pair)
    console.print(f"hypervolume of the whole table's front: {full:.4f}")
    ours = _median([r.slots_to_within for r in results["batchfit (TPE + feasibility)"]], math.inf)
    random = _median([r.slots_to_within for r in results["random"]], math.inf)
    checks = {
        f"batchfit {ours:g} slots <= a third of the grid ({size / 3:.1f})": ours <= size / 3,
        f"batchfit {ours:g} slots <= half of random's ({random / 2:g})": ours <= random / 2,
    }
    for text, ok in checks.items():
        console.print(f"{'PASS' if ok else 'FAIL'}: {text}")
    verdict = all(checks.values())
    console.print(f"[bold]{'PASS' if verdict else 'FAIL'}[/bold]")
    sys.exit(0 if verdict else 1)


if __name__ == "__main__":
    main()
