"""Joules per sample for each batch size and precision, and the configuration with the least
energy to the target beside the fastest, measured where the hardware counts energy.

    python bench/energy.py                       # the quick start's model on digits
    python bench/energy.py --batch-sizes 32 128 512 --precisions fp32 bf16 --steps 300
    python bench/energy.py -- model=small_cnn    # extra overrides for every configuration

The quick start's configurations (`+experiment=resnet data=digits`: ResNet-18 on
scikit-learn's digits, SGD, the learning rate linear in the batch from optimizer.lr at 128)
train in one real study (`python -m search`, a grid over --batch-sizes x --precisions, no
accumulation), each for --steps optimizer steps and validated 8 times on the way, so that
the study predicts each configuration's time and energy to the loss every batch size reached
(search/results/time_to_target.py). Joules are what the counters saw over the timed steps
(train/measure/energy.py: NVML on a GPU, RAPL on a CPU). Printed: per configuration, the
throughput, joules per sample, mean watts and utilisation; then the fastest configuration to
the target and the one with the fewest joules to it, with both figures of each.

On a machine with no counter readable it says so and exits 0 with no figures. Verdict (the
exit status): every configuration that trained has its joules, and the study predicted an
energy to the target for the configurations it trained.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from batchfit.search.core.record import TrialRecord  # noqa: E402
from batchfit.search.results import time_to_target  # noqa: E402
from batchfit.search.results.time_to_target import Untrusted  # noqa: E402
from batchfit.search.sampling import levers  # noqa: E402
from batchfit.search.storage.opening import open_storage  # noqa: E402
from batchfit.tracking.metrics import (  # noqa: E402
    DEVICE_UTILIZATION,
    ENERGY_J,
    ENERGY_PER_SAMPLE,
    MEAN_WATTS,
    THROUGHPUT_SAMPLES,
)
from batchfit.train.measure.energy import why_unmeasured  # noqa: E402
from batchfit.train.plan import resolve_device  # noqa: E402
from batchfit.train.precision import unsupported_reason  # noqa: E402

NAME = "energy-bench"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument(
        "--precisions", nargs="+", default=None,
        help="default: fp32 and what else the device runs fast (search/sampling/levers.py)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps per configuration")
    parser.add_argument("--device", default="auto")
    parser.add_argument("overrides", nargs="*", help="after --: Hydra overrides for every run")
    return parser.parse_args()


def _study(args: argparse.Namespace, precisions: list[str], cwd: Path) -> optuna.Study:
    batches = ",".join(map(str, args.batch_sizes))
    overrides = [
        "+experiment=resnet", "data=digits", f"trainer.device={args.device}",
        "search/sampler=grid", f"search.study_name={NAME}",
        f"search.n_trials={len(args.batch_sizes) * len(precisions)}",
        f"++search.params={{trainer.batch_size:'choice({batches})',"
        f"trainer.precision:'choice({','.join(precisions)})',"
        "trainer.accum_steps:null,optimizer.lr:null}",
        f"trainer.max_steps={args.steps}", "trainer.max_epochs=null",
        f"trainer.val_every_steps={max(args.steps // 8, 1)}",
        "search.objectives=[val/loss]", "search.recommend.metric=val/loss",
        "search.recommend.prefer=energy/joules_per_sample",
        "search.trial_time_budget_s=null", "search.timeout_s=null", "search.speed_check=false",
        "search.fit_report_first=false", "mlflow.system_metrics=false",
        *args.overrides,
    ]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "search", *overrides], cwd=cwd, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the study failed (exit {done.returncode})")
    storage = open_storage(f"journal:{cwd}/mlruns/optuna.journal", None)
    return optuna.load_study(study_name=NAME, storage=storage)


def _table(trials: list[optuna.trial.FrozenTrial]) -> list[str]:
    """One line per trained configuration; the names of those without their joules."""
    print(
        f"\n{'batch':>6} {'precision':>9} {'samples/s':>10} {'J/sample':>10} {'mean W':>8} "
        f"{'util':>6}"
    )
    missing = []
    for t in sorted(trials, key=lambda t: (str(t.params), t.number)):
        record = TrialRecord.of(t)
        figure = record.outcome.figure
        batch, precision = t.params.get("trainer.batch_size"), t.params.get("trainer.precision")
        if figure(ENERGY_J) is None:
            missing.append(f"{batch} {precision}")
            print(
                f"{batch:>6} {precision:>9}  no joules ({record.state}: {record.outcome.message})"
            )
            continue
        util = figure(DEVICE_UTILIZATION)
        print(
            f"{batch:>6} {precision:>9} {figure(THROUGHPUT_SAMPLES):>10.0f} "
            f"{figure(ENERGY_PER_SAMPLE):>10.4g} {figure(MEAN_WATTS):>8.1f} "
            f"{'-' if util is None else f'{util:.0%}':>6}"
        )
    return missing


def main() -> int:
    args = _args()
    device = resolve_device(args.device)
    why = why_unmeasured(device)
    if why is not None:
        print(f"{why}: no figures (device {device})")
        return 0
    wanted = args.precisions or levers.precisions(device)
    precisions = [p for p in wanted if unsupported_reason(p, device) is None]
    print(
        f"bench: +experiment=resnet data=digits on {device}, batch sizes {args.batch_sizes}, "
        f"precisions {precisions}, {args.steps} steps each, torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="batchfit-energy-") as tmp:
        trials = _study(args, precisions, Path(tmp)).get_trials()
    trained = [t for t in trials if TrialRecord.of(t).is_trained]
    missing = _table(trained)
    try:
        plan = time_to_target.plan(trials)
    except Untrusted as untrusted:
        print(f"\ntime to target not predicted: {untrusted}")
        return 1
    fastest, least = plan.best, plan.least_energy
    print(f"\nto {plan.describe()}:")
    if least is None:
        print("no configuration has an energy to the target")
        return 1
    for label, p in (("fastest", fastest), ("fewest joules", least)):
        joules = "-" if p.joules is None else f"{p.joules:.4g} J"
        print(f"  {label:>13}: {p.geometry:<14} {p.seconds:.4g} s, {joules}")
    if least is not fastest and fastest.joules is not None:
        print(
            f"  the fewest joules take {least.seconds / fastest.seconds:.2f}x the time and "
            f"{least.joules / fastest.joules:.2f}x the energy of the fastest"
        )
    if missing:
        print(f"verdict: FAIL: {len(missing)} configuration(s) trained without joules: {missing}")
        return 1
    print("verdict: PASS: every configuration that trained has its joules and its energy to target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
