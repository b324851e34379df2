"""Is one trial's gradient noise scale a measurement? One configuration's B_simple across seeds.

    python bench/noise_stability.py             # 3 seeds per configuration (~12 min)
    python bench/noise_stability.py --seeds 5

Trains the quick start's ResNet-18 on digits (`+experiment=resnet data=digits`, its schedule,
a learning rate of 0.1 at 128) in fixed configurations (STABILITY) at `--seeds` seeds through
batchfit's own training path (`train.plan.plan` and `train.run.run`, what a trial runs), and
prints each seed's B_simple as the run logged it (stats/grad_noise_scale, train/measure/noise.py),
its 95% interval and the steps it rests on. Verdict (exit status 0 PASS, 1 FAIL): every seed has
a figure, and the largest over the smallest is at most STABILITY_FACTOR (2) per configuration.
Whether B_simple predicts the critical batch (McCandlish et al. 2018, arXiv 1812.06162) is
bench/noise_scale.py's question.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.tracking.metrics import (  # noqa: E402
    GRAD_NOISE_SCALE,
    GRAD_NOISE_SCALE_HIGH,
    GRAD_NOISE_SCALE_LOW,
    GRAD_NOISE_STEPS,
)
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

Compose = Callable[[list[str]], DictConfig]

STABILITY_FACTOR = 2.0  # one configuration's B_simple, largest over smallest across seeds
# The quick start's study, one configuration at a time: its schedule, optimizer.lr=0.1 at
# 128 (the study searches 0.01-0.2). At the default 0.05, 9 steps of 32x4 resolved |G|² at
# no seed (means 3.5, 20 and 2.5, ± 17-21): B_simple is far above the batch there, and no
# figure is logged. 32x4: the accumulation estimator on every step past the memory check,
# 9 of the 12 in the quick start's one epoch. 128x1: the split estimator's window is a third
# of the steps left at most (3 in one epoch: too few, no figure); 3 epochs and a window of
# 12 give it 10. Measured here (2 shared cores, ~12 min): 32x4 46.6, 45.1, 51.6 (1.14x);
# 128x1 39.2, 43.8, 25.0 (1.75x), their 95% intervals each about 10x wide.
STABILITY = {
    "32x4 fp32": ("trainer.batch_size=32", "trainer.accum_steps=4"),
    "128x1 fp32": (
        "trainer.batch_size=128",
        "trainer.accum_steps=1",
        "trainer.max_epochs=3",
        "trainer.noise_scale_window=12",
    ),
}
STABILITY_COMMON = (
    "+experiment=resnet",
    "data=digits",
    "data.seed=0",
    "trainer.device=cpu",
    "optimizer.lr=0.1",
)


@dataclass(frozen=True)
class Reading:
    """One seed's B_simple as its run logged it (NaN: none), its interval, its steps."""

    seed: int
    noise_scale: float
    low: float
    high: float
    steps: int
    note: str  # the run's batchfit.noise_scale tag: the estimator, or why no figure

    def line(self) -> str:
        if not math.isfinite(self.noise_scale):
            return f"    seed {self.seed}: no B_simple ({self.note})"
        return (
            f"    seed {self.seed}: B_simple {self.noise_scale:.3g} "
            f"[{self.low:.3g}, {self.high:.3g}] over {self.steps} steps"
        )


def stability(compose: Compose, overrides: Sequence[str], seeds: int) -> list[Reading]:
    """The configuration's B_simple at seeds 0..seeds-1, as each trial would log it."""
    workloads = Workloads()
    readings = []
    for seed in range(seeds):
        cfg = compose([*STABILITY_COMMON, "trainer.precision=fp32", *overrides, f"seed={seed}"])
        result = run(cfg, plan(cfg, None), None, workloads.of(cfg))
        figures = result.metrics()
        nan = math.nan
        readings.append(
            Reading(
                seed,
                figures.get(GRAD_NOISE_SCALE, nan),
                figures.get(GRAD_NOISE_SCALE_LOW, nan),
                figures.get(GRAD_NOISE_SCALE_HIGH, nan),
                int(figures.get(GRAD_NOISE_STEPS, 0)),
                result.noise_estimator,
            )
        )
    return readings


def stability_verdict(readings: Sequence[Reading]) -> tuple[float, list[str]]:
    """The largest B_simple over the smallest across seeds, and why it fails (a seed
    without a figure, a spread over STABILITY_FACTOR); no reasons: it passes."""
    missing = [r.seed for r in readings if not math.isfinite(r.noise_scale)]
    if missing:
        return math.nan, [f"seed(s) {missing} logged no B_simple"]
    values = [r.noise_scale for r in readings]
    spread = max(values) / min(values)
    if spread > STABILITY_FACTOR:
        return spread, [f"max/min {spread:.2f} across seeds, over {STABILITY_FACTOR:g}"]
    return spread, []


def main_stability(seeds: int) -> int:
    from hydra import compose, initialize_config_dir

    failed = False
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        for name, overrides in STABILITY.items():
            print(f"resnet18/digits {name}, {seeds} seeds:", flush=True)
            readings = stability(_composer(compose), overrides, seeds)
            print("\n".join(r.line() for r in readings))
            spread, reasons = stability_verdict(readings)
            failed |= bool(reasons)
            print(f"  max/min {spread:.2f}: {'FAIL: ' + '; '.join(reasons) if reasons else 'PASS'}")
    print(f"\nverdict: {'FAIL' if failed else 'PASS'}")
    return int(failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Exit status: 0 when every configuration's B_simple is within "
        f"{STABILITY_FACTOR:g}x across seeds (each seed with a figure), 1 otherwise.",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return main_stability(args.seeds)


def _composer(compose: Callable[..., DictConfig]) -> Compose:
    return lambda overrides: compose(config_name="config", overrides=overrides)


if __name__ == "__main__":
    sys.exit(main())
