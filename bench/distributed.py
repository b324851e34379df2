"""Data-parallel trials on this machine: one process against 2 gloo ranks (DDP and FSDP2),
side by side in one run, and the time a per-rank prediction takes for a 1B and an 8B
model at world size 8.

    python bench/distributed.py          # exit status 1 when a per-rank prediction is off

For each layout the same per-device configuration (batch, accumulation, precision) trains
the same number of steps; the run's throughput is all ranks' samples over the slowest
rank's timed seconds. Scaling efficiency = throughput / (ranks x one process's). Each
rank's measured peak (the CPU tensor tracker of its steady-state step) is set beside the
prediction of one rank's step (fake tensors, fake process group).

These are 2-core machines: two ranks share the two cores one process had (each rank gets
one intra-op thread), and gloo's collectives run on the same cores, so the speed-up is
bounded well below 2 here and depends on the load of the moment. The efficiency says what
these cores give, not what GPUs would. The verdict is on memory only: every rank's peak
equal to the prediction, to the byte.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.tracking.metrics import THROUGHPUT_TOKENS  # noqa: E402
from batchfit.train.device.sizes import format_bytes  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

# The GPT of conf/model/gpt.yaml on the stdlib's source: a model with blocks (FSDP shards
# each) and a real data set; small enough for several epochs on two cores.
WORKLOAD = ["+experiment=gpt", "trainer.max_epochs=null", "search.memory_budget=null"]
LAYOUTS = {
    "1 process": [],
    "DDP, 2 ranks": ["trainer.strategy=ddp", "trainer.devices=2"],
    "FSDP2, 2 ranks": ["trainer.strategy=fsdp", "trainer.devices=2"],
}
# One rank of 8 for full fine-tuning in bf16 weights, predicted for an H100.
PREDICTED = {
    "Llama 3.2 1B": "llama3_2_1b",
    "Llama 3 8B": "llama3_8b",
}
LLM = [
    "+experiment=llm_full",
    "model.dtype=bfloat16",
    "trainer.precision=bf16",
    "search.gpu=H100-80GB",
    "trainer.devices=8",
    "trainer.batch_size=1",
    "data.seq_len=1024",
    "trainer.activation_checkpointing=blocks",
]


def _cfg(overrides: list[str]):  # noqa: ANN202
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def trained(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, layout in LAYOUTS.items():
        geometry = [f"trainer.batch_size={args.batch}", f"trainer.max_steps={args.steps}"]
        cfg = _cfg([*WORKLOAD, *geometry, *layout])
        spec = plan(cfg, None)
        predicted = Workloads().of(cfg).predict(spec, cfg.optimizer).peak_bytes
        started = time.perf_counter()
        result = run(cfg, spec)
        rows.append(
            {
                "name": name,
                "ranks": spec.trainer.devices,
                "throughput": result.throughput_samples_per_sec,
                "tokens": result.metrics().get(THROUGHPUT_TOKENS),
                "peaks": result.rank_peak_bytes or [result.peak_bytes],
                "predicted": predicted,
                "seconds": time.perf_counter() - started,
            }
        )
    return rows


def prediction_times() -> list[dict]:
    rows = []
    for name, config in PREDICTED.items():
        for strategy in ("fsdp", "ddp"):
            cfg = _cfg([*LLM, f"model.config={config}", f"trainer.strategy={strategy}"])
            spec = plan(cfg, None)
            workload = Workloads().of(cfg)
            started = time.perf_counter()
            predictor = workload.predictor(spec, cfg.optimizer)
            built = time.perf_counter() - started
            prediction = predictor.predict(spec.trainer, workload.num_train, spec.limit_bytes)
            one = dataclasses.replace(spec.trainer, batch_size=2, effective_batch_size=None)
            again = predictor.predict(one, workload.num_train, spec.limit_bytes)
            rows.append(
                {
                    "name": name,
                    "strategy": strategy,
                    "built": built,
                    "first": prediction.seconds,
                    "next": again.seconds,
                    "peak": prediction.peak_bytes,
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per layout")
    parser.add_argument("--batch", type=int, default=8, help="sequences per device")
    parser.add_argument("--skip-prediction-times", action="store_true")
    args = parser.parse_args()
    console = Console(width=140)
    console.print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads here")

    rows = trained(args)
    base = rows[0]["throughput"]
    table = Table(
        title=f"GPT on the stdlib's source, batch {args.batch} per device, {args.steps} steps "
        "(2 cores shared by all ranks: the speed-up is bounded by them)"
    )
    for column in ("layout", "samples/s", "tokens/s", "scaling efficiency", "peak per rank",
                   "predicted per rank", "exact", "wall"):  # fmt: skip
        table.add_column(column, justify="right")
    exact = True
    for row in rows:
        efficiency = row["throughput"] / (row["ranks"] * base)
        same = all(peak == row["predicted"] for peak in row["peaks"])
        exact &= same
        table.add_row(
            row["name"],
            f"{row['throughput']:.1f}",
            f"{row['tokens']:.0f}" if row["tokens"] else "-",
            "1 (the reference)" if row["ranks"] == 1 else f"{efficiency:.2f}",
            ", ".join(format_bytes(p) for p in row["peaks"]),
            format_bytes(row["predicted"]),
            "yes" if same else f"no ({[p - row['predicted'] for p in row['peaks']]} B)",
            f"{row['seconds']:.0f} s",
        )
    console.print(table)

    if not args.skip_prediction_times:
        times = Table(
            title="One rank of 8 predicted on fake tensors: full fine-tuning, bf16 weights, "
            "AdamW, batch 1 x 1024 tokens, checkpointed blocks, for an H100-80GB"
        )
        for column in ("model", "strategy", "build (model, shard, state)", "first step",
                       "another batch", "predicted peak per rank"):  # fmt: skip
            times.add_column(column, justify="right")
        for row in prediction_times():
            times.add_row(
                row["name"], row["strategy"], f"{row['built']:.1f} s", f"{row['first']:.1f} s",
                f"{row['next']:.1f} s", format_bytes(row["peak"]),
            )  # fmt: skip
        console.print(times)

    verdict = "PASS" if exact else "FAIL"
    console.print(
        f"verdict: {verdict}: every rank's measured peak "
        f"{'equals' if exact else 'does not equal'} its predicted peak to the byte"
    )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
