"""Language-model steps predicted, then run: the cells of the first GPU measurement (Llama 3.2 1B
with LoRA, three cells; full fine-tuning in bf16 besides) and a Llama 3 8B LoRA step, with the
seconds to its first step and the host's peak memory.

Each cell is composed, planned for the whole device (`search.memory_budget=null`), predicted
(`Workloads().of(cfg).predict`) and run for 3 optimizer steps through `train.run.run`, the code
path of a trial, as `bench/prediction.py --qlora` does. Targets, as the prediction grid's:

- CUDA: the predicted reserve against `max_memory_reserved`: median |error| <= 5%, worst <= 15%
  over the cells run; the predicted live tensors against `max_memory_allocated` are shown too;
- CPU: the prediction against the tracked tensor peak, every cell within 1% (a consistency check).

The 8B cells (bf16 weights, blocks checkpointed, 2048 tokens, batch 1 and 4) also have to reach
their first optimizer step within 60 s of the cell's start (compose, plan, predict, build,
step 0), with the process's peak host memory (ru_maxrss) under 4 GiB. The peak is the whole
process's: run one 8B cell per process for its own figure.

    python bench/gpu/gpu_llm.py                        # on a GPU: the 1B cells
    python bench/gpu/gpu_llm.py --cells 8b-lora-1x2048 # one 8B cell (a process each)
    python bench/gpu/gpu_llm.py --cells 1b 8b          # groups and cell names mix
    python bench/gpu/gpu_llm.py --device cpu --tiny    # llama3_tiny, 1/8 the tokens, on CPU

`--tiny` swaps each cell's architecture for `llama3_tiny` (2 layers 64 wide, the same layer
types) and divides its sequence length by 8, so that the same code runs on a CPU in seconds.
Every cell is reported, a failing one included; the verdict sets the exit status.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before torch, transformers and Hydra are imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.train.device.sizes import format_bytes  # noqa: E402
from batchfit.train.measure.memory import release_memory  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.step import Hooks  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

GiB = 2**30
FIRST_STEP_LIMIT_S, HOST_LIMIT_BYTES = 60.0, 4 * GiB  # the 8B cells' start-up targets

LORA_1B = ("+experiment=llm_lora", "model.config=llama3_2_1b")
LORA_8B = ("+experiment=llm_lora", "model.config=llama3_8b", "model.dtype=bfloat16")
BLOCKS = "trainer.activation_checkpointing=blocks"
NONE = "trainer.activation_checkpointing=none"


@dataclasses.dataclass(frozen=True)
class Cell:
    overrides: tuple[str, ...]
    group: str
    startup: bool = False  # the first-step and host-memory targets apply


CELLS = {
    # The three cells of the H200 measurement (bf16 autocast; fp32 weights unless said).
    "1b-lora-4x1024": Cell((*LORA_1B, "trainer.batch_size=4", "data.seq_len=1024", NONE), "1b"),
    "1b-lora-8x1024-blocks": Cell(
        (*LORA_1B, "trainer.batch_size=8", "data.seq_len=1024", BLOCKS), "1b"
    ),
    "1b-lora-4x2048-blocks-bf16w": Cell(
        (*LORA_1B, "model.dtype=bfloat16", "trainer.batch_size=4", "data.seq_len=2048", BLOCKS),
        "1b",
    ),
    # Full fine-tuning in bf16: every weight, its gradient and AdamW's two moments in bf16
    # (4 x 2.5 GB), activations of 4 x 1024 tokens without checkpointing: predicted on a CPU
    # for an H100-80GB (search.gpu), a 20.6 GiB reserve: a quarter of the card.
    "1b-full-bf16-4x1024": Cell(
        (
            "+experiment=llm_full",
            "model.config=llama3_2_1b",
            "model.dtype=bfloat16",
            "trainer.batch_size=4",
            "data.seq_len=1024",
            NONE,
        ),
        "1b",
    ),
    "8b-lora-1x2048": Cell(
        (*LORA_8B, "trainer.batch_size=1", "data.seq_len=2048", BLOCKS), "8b", startup=True
    ),
    "8b-lora-4x2048": Cell(
        (*LORA_8B, "trainer.batch_size=4", "data.seq_len=2048", BLOCKS), "8b", startup=True
    ),
}
COMMON = (
    "trainer.precision=bf16", "trainer.accum_steps=1", "trainer.max_epochs=null",
    "trainer.max_steps=3", "trainer.warmup_steps=0", "search.memory_budget=null",
)  # fmt: skip


@dataclasses.dataclass
class Outcome:
    """What one cell predicted and measured, or why it could not."""

    name: str
    startup: bool
    predicted_bytes: int | None = None  # CUDA: the reserve under the limit; CPU: the peak
    measured_bytes: int | None = None  # CUDA: max_memory_reserved; CPU: the tracked peak
    error: float | None = None  # Prediction.error: (predicted - measured) / measured
    live_error: float | None = None  # CUDA: live tensors against max_memory_allocated
    predict_s: float | None = None
    first_step_s: float | None = None  # from the cell's start to its first optimizer step
    host_peak_bytes: int | None = None  # the process's ru_maxrss so far
    step_ms: float | None = None  # a timed optimizer step's (time/step_ms): the card's speed
    failure: str | None = None

    @property
    def startup_ok(self) -> bool:
        if not self.startup:
            return True
        return (
            self.first_step_s is not None
            and self.first_step_s < FIRST_STEP_LIMIT_S
            and self.host_peak_bytes is not None
            and self.host_peak_bytes < HOST_LIMIT_BYTES
        )


def cell_overrides(name: str, device: str, tiny: bool) -> list[str]:
    """The cell's overrides on `device`; tiny: llama3_tiny and 1/8 of the tokens."""
    overrides = [*CELLS[name].overrides, *COMMON, f"trainer.device={device}"]
    if not tiny:
        return overrides
    smaller = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "model.config":
            override = "model.config=llama3_tiny"
        elif key == "data.seq_len":
            override = f"data.seq_len={int(value) // 8}"
        smaller.append(override)
    return smaller


def measure(name: str, overrides: list[str], workloads: Workloads) -> Outcome:
    """Predict the cell, run it for 3 steps, and compare; a failure is the outcome's."""
    outcome = Outcome(name, CELLS[name].startup)
    started = time.perf_counter()

    def on_step(step: int, num_steps: int, elapsed_s: float) -> None:
        if outcome.first_step_s is None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels done, not only queued
            outcome.first_step_s = time.perf_counter() - started
            print(f"{name}: first optimizer step done at {outcome.first_step_s:.1f} s", flush=True)

    device = torch.device("cpu")
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        spec = plan(cfg, None)
        device = spec.device
        workload = workloads.of(cfg)
        prediction = workload.predict(spec, cfg.optimizer)
        outcome.predict_s = time.perf_counter() - started
        outcome.predicted_bytes = prediction.reserved_bytes or prediction.peak_bytes
        print(  # before the run: a timeout during it still shows how far the cell got
            f"{name}: predicted {format_bytes(outcome.predicted_bytes)} at "
            f"{outcome.predict_s:.1f} s; building and running",
            flush=True,
        )
        result = run(cfg, spec, Hooks(on_step=on_step), workload)
        outcome.measured_bytes = result.reserved_bytes or result.peak_bytes
        outcome.step_ms = result.step_ms
        outcome.error = prediction.error(result)
        if result.reserved_bytes is not None:  # CUDA: what the allocator adds, apart
            outcome.live_error = (prediction.tensor_bytes - result.peak_bytes) / result.peak_bytes
    except Exception as error:  # this cell's FAIL; the next cell still runs
        traceback.print_exc()
        outcome.failure = f"{type(error).__name__}: {error}"[:300]
    finally:
        outcome.host_peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        release_memory(device)
    return outcome


def verdict(outcomes: list[Outcome], cuda: bool) -> tuple[bool, str]:
    """PASS when every cell ran, the errors meet the targets and the start-up targets hold."""
    errors = [abs(o.error) for o in outcomes if o.error is not None]
    failed = [o.name for o in outcomes if o.error is None]
    slow = [o.name for o in outcomes if not o.startup_ok]
    if not errors:
        return False, f"nothing measured; failed: {', '.join(failed)}"
    median, worst = statistics.median(errors), max(errors)
    if cuda:
        met, target = median <= 0.05 and worst <= 0.15, "median <= 5%, worst <= 15%"
    else:
        met, target = worst <= 0.01, "every cell within 1%"
    said = f"{len(errors)} cells measured: median |error| {median:.2%}, worst {worst:.2%} "
    said += f"(target {target})"
    if failed:
        said += f"; did not run: {', '.join(failed)}"
    if slow:
        said += (
            f"; over {FIRST_STEP_LIMIT_S:.0f} s to the first step or "
            f"{format_bytes(HOST_LIMIT_BYTES)} of host memory: {', '.join(slow)}"
        )
    return met and not failed and not slow, said


def table(outcomes: list[Outcome], device: str) -> Table:
    cuda = device == "cuda"
    what = "max_memory_reserved" if cuda else "the tracked tensor peak"
    out = Table(title=f"Language-model steps on {_device_name(device)}: predicted vs {what}")
    columns = ["cell", "predicted", "measured", "error"]
    columns += ["live vs allocated"] if cuda else []
    columns += ["predict s", "first step s", "step ms", "host peak"]
    for column in columns:
        out.add_column(column, justify="right")
    for o in outcomes:
        cells = [o.name, _bytes(o.predicted_bytes), _bytes(o.measured_bytes)]
        cells.append(f"{o.error:+.2%}" if o.error is not None else (o.failure or "-"))
        if cuda:
            cells.append(f"{o.live_error:+.2%}" if o.live_error is not None else "-")
        step = f"{o.step_ms:.1f}" if o.step_ms is not None else "-"
        cells += [_seconds(o.predict_s), _seconds(o.first_step_s), step, _bytes(o.host_peak_bytes)]
        out.add_row(*cells)
    return out


def _bytes(n: int | None) -> str:
    return format_bytes(n) if n is not None else "-"


def _seconds(s: float | None) -> str:
    return f"{s:.1f}" if s is not None else "-"


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def selected(names: list[str]) -> list[str]:
    """Cell names from names and groups, in CELLS' order."""
    unknown = [n for n in names if n not in CELLS and n not in {c.group for c in CELLS.values()}]
    if unknown:
        groups = sorted({c.group for c in CELLS.values()})
        raise SystemExit(f"--cells: unknown {unknown}; one of {[*CELLS, *groups]}")
    return [n for n, c in CELLS.items() if n in names or c.group in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", default=["1b"], help="cell names or groups")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="llama3_tiny, 1/8 of the tokens")
    args = parser.parse_args()
    console = Console(width=160)
    console.print(f"imports: {time.perf_counter() - _STARTED:.1f} s")
    workloads, outcomes = Workloads(), []
    for name in selected(args.cells):
        outcome = measure(name, cell_overrides(name, args.device, args.tiny), workloads)
        outcomes.append(outcome)
        console.print(  # as each cell ends: a timeout keeps what was measured
            f"{name}: predicted {_bytes(outcome.predicted_bytes)}, measured "
            f"{_bytes(outcome.measured_bytes)}, "
            + (f"error {outcome.error:+.2%}" if outcome.error is not None else "no comparison")
            + f"; first step {_seconds(outcome.first_step_s)} s, host peak "
            f"{_bytes(outcome.host_peak_bytes)}"
            + (f"; FAIL: {outcome.failure}" if outcome.failure else "")
        )
    console.print(table(outcomes, args.device))
    passed, said = verdict(outcomes, args.device == "cuda")
    console.print(f"{said}: [bold]{'PASS' if passed else 'FAIL'}[/bold]")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
