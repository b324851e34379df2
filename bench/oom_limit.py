"""The real OOM boundary on a GPU against the prediction: for a few configurations, the smallest
per-process memory limit a training step really runs in, bisected with
`torch.cuda.set_per_process_memory_fraction`, beside the limit the prediction gives
(train/memory/reserve.py: the caching-allocator model's smallest limit). Needs CUDA.

    python bench/oom_limit.py                 # the bundled configurations
    python bench/oom_limit.py --resolution-mib 4

Each attempt is a real run of 3 optimizer steps through `train.run.run` (the code path of a
trial) under a budget of L bytes: the caching allocator raises OutOfMemoryError past it. The
real smallest limit is the least L that runs, to `--resolution-mib`. A prediction below it is a
"fits" that OOMs (the dangerous side) once the 5% preflight margin no longer covers it; above
it, a false OOM by that much. Target: every prediction x 1.05 at or above the real limit, and
the prediction at most 5% above it; the verdict sets the exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from train.memory.budget import OutOfMemory, format_bytes, release_memory  # noqa: E402
from train.run import plan, run  # noqa: E402
from train.workload import Workloads  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resolution-mib", type=float, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/oom_limit.py needs a CUDA device (--device cpu: a dry run)")
    cases = CASES if args.device == "cuda" else CPU_CASES
    console = Console(width=160)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    table = Table(title=f"Smallest per-process limit on {name}")
    for column in ("config", "batch", "precision", "predicted", "real", "error"):
        table.add_column(column, justify="right")
    errors = []
    workloads = Workloads()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for overrides, batch, precision in cases:
            geometry = [
                f"trainer.batch_size={batch}", "trainer.accum_steps=1",
                f"trainer.precision={precision}", f"trainer.device={args.device}",
            ]  # fmt: skip
            cfg = compose(config_name="config", overrides=[*overrides, *STEPS, *geometry])
            spec = plan(cfg, None)
            workload = workloads.of(cfg)
            prediction = workload.predict(spec, cfg.optimizer)
            step = int(args.resolution_mib * MiB)
            high = max(2 * prediction.peak_bytes, prediction.peak_bytes + 512 * MiB)
            assert _runs(cfg, spec, workload, high), f"{overrides} does not run in {high} B"
            real = real_smallest_limit(cfg, spec, workload, prediction.tensor_bytes, high, step)
            error = (prediction.peak_bytes - real) / real
            errors.append(error)
            table.add_row(
                " ".join(overrides), str(batch), precision, format_bytes(prediction.peak_bytes),
                format_bytes(real), f"{error:+.2%}",
            )  # fmt: skip
    console.print(table)
    verdict = all(1 / 1.05 - 1 <= e <= 0.05 for e in errors)
    console.print(
        f"{len(errors)} configurations: errors {', '.join(f'{e:+.2%}' for e in errors)} "
        f"(target -4.8%/+5%): [bold]{'PASS' if verdict else 'FAIL'}[/bold]"
    )
    sys.exit(0 if verdict else 1)


if __name__ == "__main__":
    main()
