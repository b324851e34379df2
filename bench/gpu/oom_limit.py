"""The real OOM boundary on a GPU against the prediction: for a few configurations, the smallest
per-process memory limit a training step really runs in, bisected with
`torch.cuda.set_per_process_memory_fraction`, beside the limit the prediction gives
(train/memory/reserve.py: the caching-allocator model's smallest limit). Needs CUDA.

    python bench/gpu/oom_limit.py                 # the bundled configurations
    python bench/gpu/oom_limit.py --resolution-mib 4

Each attempt is a real run of 3 optimizer steps through `train.run.run` (the code path of a
trial) under a budget of L bytes: the caching allocator raises OutOfMemoryError past it. The
real smallest limit is the least L that runs, to `--resolution-mib`. A prediction below it is a
"fits" that OOMs (the dangerous side) once the 5% preflight margin no longer covers it; above
it, a false OOM by that much. Target: every prediction x 1.05 at or above the real limit, and
the prediction at most 5% above it; the verdict sets the exit code.

Every configuration is reported, each as soon as it is done: one that does not run even under
twice its predicted limit, or that fails otherwise, is a FAIL row and the next one still runs,
so that one failure does not hide the rest. `--max-seconds` stops starting configurations
after that long (those left are listed as not run, and the verdict is FAIL: not checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.train.device.sizes import format_bytes  # noqa: E402
from batchfit.train.measure.memory import OutOfMemory, release_memory  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

MiB = 2**20
# (overrides, batch size, precision): convolutions, a decoder with attention, both precisions.
CASES = [
    (["model=resnet18", "data=synthetic", "data.image_size=32"], 64, "fp32"),
    (["model=resnet18", "data=synthetic", "data.image_size=32"], 256, "bf16"),
    (["+experiment=gpt", "data.seq_len=256"], 32, "fp32"),
    (["+experiment=gpt", "data.seq_len=256", "model.n_layer=8", "model.n_embd=512"], 16, "bf16"),
]
# --device cpu: a dry run of the bisection itself, where prediction and measurement are the
# same accounting (the real limit must equal the prediction to the resolution).
CPU_CASES = [(["model=small_cnn", "model.width=8", "data=digits"], 16, "fp32")]
STEPS = ["trainer.max_epochs=null", "trainer.max_steps=3", "trainer.warmup_steps=0",
         "search.memory_budget=null"]  # fmt: skip


def _runs(cfg, spec, workload, limit_bytes: int) -> bool:  # noqa: ANN001
    """Whether 3 real steps run under a per-process limit of `limit_bytes`."""
    release_memory(spec.device)
    try:
        run(cfg, dataclasses.replace(spec, budget_bytes=limit_bytes), None, workload)
    except (OutOfMemory, torch.OutOfMemoryError):
        return False
    finally:
        release_memory(spec.device)
    return True


def real_smallest_limit(cfg, spec, workload, low: int, high: int, step: int) -> int:  # noqa: ANN001
    """The least multiple of `step` in (low, high] that runs (high must run)."""
    low, high = low // step, -(-high // step)
    while high - low > 1:
        mid = (low + high) // 2
        if _runs(cfg, spec, workload, mid * step):
            high = mid
        else:
            low = mid
    return high * step


@dataclasses.dataclass
class Outcome:
    """One configuration's result: the predicted and real smallest limits, or why not."""

    predicted_bytes: int | None = None
    real_bytes: int | None = None
    failure: str | None = None  # what went wrong instead of a comparison

    @property
    def error(self) -> float | None:
        if self.predicted_bytes is None or self.real_bytes is None:
            return None
        return (self.predicted_bytes - self.real_bytes) / self.real_bytes

    @property
    def passed(self) -> bool:
        # The prediction x 1.05 (the preflight margin) covers the real limit, and the
        # prediction is at most 5% above it.
        return self.error is not None and 1 / 1.05 - 1 <= self.error <= 0.05


def measure(cfg, spec, workload, resolution_bytes: int) -> Outcome:  # noqa: ANN001
    """The predicted smallest limit and the real one, bisected between the predicted live
    tensors and twice the prediction (at least +512 MiB), which must run."""
    prediction = workload.predict(spec, cfg.optimizer)
    outcome = Outcome(predicted_bytes=prediction.peak_bytes)
    high = max(2 * prediction.peak_bytes, prediction.peak_bytes + 512 * MiB)
    if not _runs(cfg, spec, workload, high):
        outcome.failure = f"does not run in {format_bytes(high)} (2 x the prediction)"
        return outcome
    low = prediction.tensor_bytes
    outcome.real_bytes = real_smallest_limit(cfg, spec, workload, low, high, resolution_bytes)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resolution-mib", type=float, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="start no configuration after this"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu/oom_limit.py needs a CUDA device (--device cpu: a dry run)")
    cases = CASES if args.device == "cuda" else CPU_CASES
    console = Console(width=160)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    table = Table(title=f"Smallest per-process limit on {name}")
    for column in ("config", "batch", "precision", "predicted", "real", "error", "within"):
        table.add_column(column, justify="right")
    outcomes, started, workloads = [], time.perf_counter(), Workloads()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for overrides, batch, precision in cases:
            label = f"{' '.join(overrides)} batch {batch} {precision}"
            if args.max_seconds is not None and time.perf_counter() - started > args.max_seconds:
                outcome = Outcome(failure=f"not run: past --max-seconds={args.max_seconds:g}")
            else:
                geometry = [
                    f"trainer.batch_size={batch}", "trainer.accum_steps=1",
                    f"trainer.precision={precision}", f"trainer.device={args.device}",
                ]  # fmt: skip
                try:
                    cfg = compose(config_name="config", overrides=[*overrides, *STEPS, *geometry])
                    spec = plan(cfg, None)
                    outcome = measure(cfg, spec, workloads.of(cfg), int(args.resolution_mib * MiB))
                except Exception as error:  # reported as this configuration's FAIL; go on
                    traceback.print_exc()
                    outcome = Outcome(failure=f"{type(error).__name__}: {error}"[:300])
                    release_memory(torch.device(args.device))
            outcomes.append(outcome)
            table.add_row(*_row(overrides, batch, precision, outcome))
            console.print(f"{label}: {_said(outcome)}")  # as it comes: a timeout keeps it
    console.print(table)
    failed = sum(not o.passed for o in outcomes)
    verdict = failed == 0
    console.print(
        f"{len(outcomes)} configurations, {failed} failed (target: prediction x 1.05 at or above "
        f"the real limit, prediction at most 5% above it): "
        f"[bold]{'PASS' if verdict else 'FAIL'}[/bold]"
    )
    sys.exit(0 if verdict else 1)


def _row(overrides: list[str], batch: int, precision: str, outcome: Outcome) -> list[str]:
    predicted = outcome.predicted_bytes
    cells = [" ".join(overrides), str(batch), precision]
    cells.append(format_bytes(predicted) if predicted is not None else "-")
    if outcome.real_bytes is None:
        return [*cells, outcome.failure or "-", "-", "NO"]
    return [*cells, format_bytes(outcome.real_bytes), f"{outcome.error:+.2%}",
            "yes" if outcome.passed else "NO"]  # fmt: skip


def _said(outcome: Outcome) -> str:
    if outcome.real_bytes is None:
        return f"FAIL: {outcome.failure}"
    return (
        f"predicted {format_bytes(outcome.predicted_bytes)}, real "
        f"{format_bytes(outcome.real_bytes)} ({outcome.error:+.2%}): "
        f"{'PASS' if outcome.passed else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
