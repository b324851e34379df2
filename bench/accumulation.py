"""Searched or derived accumulation: which finds the better configuration in a fixed number
of trials?

Real studies through `search.study.driver.StudyDriver` on the resnet experiment's space, ResNet-18
on synthetic 32x32 images (CIFAR's shape) under the 1 GiB budget of
conf/budget/resnet18_synthetic.yaml, in which the larger batch sizes do not fit:

- searched (`+experiment=resnet`): batch size x accumulation x precision x lr, as given;
- derived (`+experiment=resnet_derived`): the effective batch x precision x lr; each trial
  trains with the largest micro-batch predicted to fit, accumulating the rest.

For each seed both run the same number of trials; printed side by side: the best throughput
and the best validation accuracy each reached, and how many trials were lost to OOM.

    python bench/accumulation.py                     # seeds 0-2, 8 trials, 384 samples
    python bench/accumulation.py --samples 640       # more data per trial
    python bench/accumulation.py --seeds 0 1 2 3 4 --trials 12 -- trainer.max_epochs=2
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
import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.search.core.record import OOM_REASONS, SLOW, TrialRecord, records  # noqa: E402
from batchfit.search.study.driver import StudyDriver  # noqa: E402

MODES = {"searched": "+experiment=resnet", "derived": "+experiment=resnet_derived"}


def study(
    mode: str, seed: int, trials: int, samples: int, extra: list[str], precision: str | None
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            MODES[mode],
            "data=synthetic",
            f"data.num_samples={samples}",
            "data.noise=0.5",  # at the default 1.0 one epoch of ResNet-18 stays at chance
            "trainer.max_epochs=1",
            f"seed={seed}",
            f"search.n_trials={trials}",
            f"search.study_name=accumulation-{mode}-{seed}",
            f"search.storage=sqlite:///{tmp}/optuna.db",
            f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"mlflow.artifact_root={tmp}/artifacts",
            *extra,
        ]
        cfg = hydra.compose(config_name="config", overrides=overrides)
        if precision:  # a key with a dot cannot be overridden from the command line
            cfg.search.params["trainer.precision"] = precision
        console = Console(file=io.StringIO(), width=160)
        driver = StudyDriver.prepare(
            cfg, overrides, {"experiment": MODES[mode].split("=")[1], "data": "synthetic"}, console
        )
        driver.run()
        done = records(driver.study.get_trials(deepcopy=False))
    complete = [t for t in done if t.state == "COMPLETE"]
    best_speed = max(complete, key=lambda t: t.outcome.throughput, default=None)
    best_acc = max(complete, key=lambda t: t.outcome.val_acc, default=None)

    def geometry(t: TrialRecord | None) -> str:
        return "-" if t is None else f"{t.batch_size}x{t.accum_steps} {t.precision}"

    return {
        "throughput": best_speed.outcome.throughput if best_speed else 0.0,
        "val_acc": best_acc.outcome.val_acc if best_acc else 0.0,
        "fastest": geometry(best_speed),
        "most_accurate": geometry(best_acc),
        "complete": len(complete),
        "oom": sum(t.outcome.reason in OOM_REASONS for t in done),
        "slow": sum(t.outcome.reason == SLOW for t in done),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--samples", type=int, default=384, help="synthetic dataset size")
    parser.add_argument("--precision", help="search.params value for trainer.precision")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, after --")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    console = Console(width=140)
    if args.precision is None and not torch.cuda.is_available():
        # Without bf16/fp16 kernels a low-precision probe of ResNet-18 alone takes a minute
        # before the trial is pruned as slow; compare the two modes in fp32.
        args.precision = "fp32"
        console.print("CPU: precision fixed to fp32 (--precision 'choice(fp32,bf16)' to search)")
    table = Table(title=f"Best of {args.trials} trials per study: searched vs derived")
    for column in ("seed", "mode", "best samples/s", "fastest", "best val acc", "most accurate",
                   "complete", "OOM", "slow"):  # fmt: skip
        table.add_column(column, justify="right")
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with hydra.initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for seed in args.seeds:
            for mode in MODES:
                r = study(mode, seed, args.trials, args.samples, args.overrides, args.precision)
                results[mode].append(r)
                table.add_row(
                    str(seed), mode, f"{r['throughput']:.1f}", r["fastest"], f"{r['val_acc']:.3f}",
                    r["most_accurate"], str(r["complete"]), str(r["oom"]), str(r["slow"]),
                )  # fmt: skip
                console.print(
                    f"seed {seed} {mode}: best {r['throughput']:.1f} samples/s, "
                    f"best val acc {r['val_acc']:.3f}, {r['oom']} OOM of {args.trials}"
                )
    console.print(table)
    for mode, rows in results.items():
        console.print(
            f"{mode:>8}: mean best throughput {statistics.mean(r['throughput'] for r in rows):.1f} "
            f"samples/s, mean best val acc {statistics.mean(r['val_acc'] for r in rows):.3f}, "
            f"OOM trials {sum(r['oom'] for r in rows)} of {args.trials * len(rows)}"
        )


if __name__ == "__main__":
    main()
