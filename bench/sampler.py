"""Does OOM teach the sampler? The share of OOM proposals late in a study, with and without.

Real studies through `search.study.driver.StudyDriver` (the code behind `python -m search`) on the
resnet experiment's space (batch size 16..1024 x accumulation 1,2,4 x precision x lr, TPE,
two objectives) with a small CNN on synthetic 16x16 images and 3 optimizer steps a trial, so
that a study of 40 trials takes about a minute. The memory budget is set from the fit report
to the median predicted peak over batch size x precision, so about half the combinations
do not fit. Each seed runs twice, with search.oom_constraint=false and =true; the printed
figures are the share of proposals 21-40 that were OOM (predicted or real), and the share of
the study's search.n_trials slots that trained (a proposal predicted not to fit, or a
repeat, is answered without training and does not take a slot).

    python bench/sampler.py                       # seeds 0-3, 40 trials
    python bench/sampler.py --seeds 0 1 2 3 4 5 --trials 60

Targets: with the constraint, at most half the OOM rate without it; at least 90% of the
trial slots train.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import hydra
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.search.core.record import OOM, OOM_REASONS, TrialRecord  # noqa: E402
from batchfit.search.fit.tabulate import fit_report  # noqa: E402
from batchfit.search.sampling.sampler import FeasibilityFilter  # noqa: E402
from batchfit.search.study.driver import StudyDriver  # noqa: E402
from batchfit.search.study.validate import validate  # noqa: E402

BASE = [
    "+experiment=resnet",
    "model=small_cnn",
    "model.width=16",
    "data=synthetic",
    "data.image_size=16",
    "data.num_samples=1200",
    "trainer.max_epochs=null",
    "trainer.max_steps=3",
    "trainer.device=cpu",
    "search.trial_time_budget_s=5",  # bf16/fp16 have no fast kernels on most CPUs: prune them
]


def compose(overrides: list[str]):  # noqa: ANN201
    return hydra.compose(config_name="config", overrides=overrides)


def median_predicted_peak(base: list[str]) -> int:
    """The median predicted peak over the fit report's cells (batch size x accumulation x
    precision) of the space `base` composes: a budget about half of them do not fit."""
    cfg = compose(base)
    checked = validate(cfg, "calibration", compose, open_store=False)
    report = fit_report(cfg, checked.space, checked.spec, checked.settings)
    peaks = [c.peak_bytes for c in report.cells.values() if c.peak_bytes is not None]
    return int(statistics.median(peaks))


def oom_shares(
    seed: int, trials: int, constraint: bool, budget: int
) -> tuple[float, float, int, float]:
    """(OOM share of the second half of the proposals, overall, proposals redrawn, share of
    the n_trials slots that trained) of one study."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            *BASE,
            f"seed={seed}",
            f"search.n_trials={trials}",
            f"search.memory_budget={budget}",
            f"search.oom_constraint={str(constraint).lower()}",
            f"search.study_name=sampler-{seed}-{constraint}",
            f"search.storage=sqlite:///{tmp}/optuna.db",
            f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"mlflow.artifact_root={tmp}/artifacts",
        ]
        cfg = compose(overrides)
        console = Console(file=io.StringIO(), width=160)
        driver = StudyDriver.prepare(cfg, overrides, {"experiment": "resnet"}, console)
        driver.run()
        done = sorted(driver.study.get_trials(deepcopy=False), key=lambda t: t.number)
        kept = [TrialRecord.of(t) for t in done]
        oom = [t.outcome.reason in OOM_REASONS for t in kept]
        # a slot that trained: counted in n_trials and not stopped by a real OOM
        trained = sum(t.is_trained and t.outcome.reason != OOM for t in kept)
        sampler = driver.study.sampler
        redrawn = sampler.num_redrawn if isinstance(sampler, FeasibilityFilter) else 0
    half = len(oom) // 2
    return sum(oom[half:]) / (len(oom) - half), sum(oom) / len(oom), redrawn, trained / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    console = Console(width=120)
    with hydra.initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        budget = median_predicted_peak(BASE)
        console.print(f"budget {budget / 2**20:.1f} MiB (median predicted peak of the grid)")
        table = Table(title="OOM share of the second half of the proposals; slots that trained")
        for column in (
            "seed",
            "without constraint",
            "with constraint",
            "redrawn",
            "all, w/o",
            "all, with",
            "trained, w/o",
            "trained, with",
        ):
            table.add_column(column, justify="right")
        without, with_, trained = [], [], []
        for seed in args.seeds:
            off = oom_shares(seed, args.trials, False, budget)
            on = oom_shares(seed, args.trials, True, budget)
            without.append(off[0])
            with_.append(on[0])
            trained += [off[3], on[3]]
            table.add_row(
                str(seed),
                f"{off[0]:.0%}",
                f"{on[0]:.0%}",
                str(on[2]),
                f"{off[1]:.0%}",
                f"{on[1]:.0%}",
                f"{off[3]:.0%}",
                f"{on[3]:.0%}",
            )
            console.print(f"seed {seed}: second half {off[0]:.0%} without, {on[0]:.0%} with")
    console.print(table)
    mean_off, mean_on = statistics.mean(without), statistics.mean(with_)
    ratio = mean_on / mean_off if mean_off else float("nan")
    least = min(trained)
    verdict = "PASS" if mean_off and ratio <= 0.5 and least >= 0.9 else "FAIL"
    console.print(
        f"mean OOM share in the second half: {mean_off:.1%} without, {mean_on:.1%} with; "
        f"ratio {ratio:.2f} (target <= 0.50); trial slots that trained: at least {least:.0%} "
        f"in every study (target >= 90%): [bold]{verdict}[/bold]"
    )
    sys.exit(verdict != "PASS")


if __name__ == "__main__":
    main()
