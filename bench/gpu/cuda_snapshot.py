"""Memory snapshots of real training steps on a GPU, written as the allocator model's fixtures
(tests/fixtures/cuda-traces: gzipped JSON, stack frames dropped) so that what a card really
allocates, cuDNN's convolution workspaces included, stays tested on machines without one.

For small_cnn and resnet18 (fp32, batch 64, 32 px images: the cells the H200 under-predicted
most), the caching allocator's history (`torch.cuda.memory._record_memory_history`, no stack
frames) is recorded, its cache emptied first, over a whole run of `train.run.run`, the code path
of a trial: the model moved to the card, 3 optimizer steps, the validation. Then
`torch.cuda.memory._snapshot()` is compacted to the fixtures' format (`segments`,
`device_traces`, `allocator_settings`; events keep `action`, `addr`, `size`, `stream`,
`time_us`) plus a `batchfit` entry saying what ran: the overrides, torch, CUDA and cuDNN
versions, the card, the prediction, `max_memory_reserved` and `max_memory_allocated`, the
reserve when recording began (0 unless something stayed on the card), and the host clock (µs
since the epoch) at the end of each optimizer step, to find the steps among the events by
`time_us`.

    python bench/gpu/cuda_snapshot.py                  # on a GPU: into $OUT, else mlruns/gpu-checks
    python bench/gpu/cuda_snapshot.py --out /tmp/traces --models resnet18
    python bench/gpu/cuda_snapshot.py --device cpu     # the same runs on CPU; nothing to record

Replay one with `python -m bench.gpu.cuda_trace FOLDER`. The verdict (every snapshot written,
complete, its final segments summing to `torch.cuda.memory_reserved()`) sets the exit status.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from batchfit.train.device.sizes import format_bytes  # noqa: E402
from batchfit.train.measure.memory import release_memory  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.step import Hooks  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402

MODELS = ("small_cnn", "resnet18")
MAX_ENTRIES = 200_000  # events kept; a resnet18 run of 3 steps and validation is far below
EVENT_KEYS = ("action", "addr", "size", "stream", "time_us")
SEGMENT_KEYS = (
    "device", "address", "total_size", "allocated_size", "active_size", "requested_size",
    "stream", "segment_type", "segment_pool_id", "is_expandable",
)  # fmt: skip
BLOCK_KEYS = ("address", "size", "requested_size", "state")


def overrides(model: str, device: str) -> list[str]:
    return [
        f"model={model}", "data=synthetic", "data.image_size=32", "data.num_samples=400",
        "data.val_fraction=0.02", "trainer.batch_size=64", "trainer.accum_steps=1",
        "trainer.precision=fp32", "trainer.max_epochs=null", "trainer.max_steps=3",
        "trainer.warmup_steps=0", "search.memory_budget=null", f"trainer.device={device}",
    ]  # fmt: skip


def compact(snapshot: dict) -> dict:
    """The fixtures' format: segments, device traces and allocator settings, no frames."""

    def keep(d: dict, keys: tuple[str, ...]) -> dict:
        return {k: d[k] for k in keys if k in d}

    segments = [
        {**keep(s, SEGMENT_KEYS), "blocks": [keep(b, BLOCK_KEYS) for b in s.get("blocks", [])]}
        for s in snapshot["segments"]
    ]
    traces = [[keep(e, EVENT_KEYS) for e in events] for events in snapshot["device_traces"]]
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": snapshot.get("allocator_settings"),
    }


def write(snapshot: dict, path: Path) -> int:
    """Gzipped JSON at `path`; its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(snapshot, f, separators=(",", ":"))
    return path.stat().st_size


def problems(snapshot: dict, reserved_bytes: int, max_entries: int) -> list[str]:
    """What makes a recorded snapshot unfit for a fixture."""
    found = []
    events = [e for trace in snapshot["device_traces"] for e in trace]
    if not events:
        found.append("no event recorded")
    if len(events) >= max_entries:
        found.append(f"{len(events)} events: the history's first ones were dropped")
    total = sum(s["total_size"] for s in snapshot["segments"])
    if total != reserved_bytes:
        found.append(f"segments sum to {total} B, memory_reserved() is {reserved_bytes} B")
    return found


def record(model: str, device: str, out: Path, max_entries: int) -> list[str]:
    """Run the cell, recording on CUDA; the problems found (none: written)."""
    step_end_us: list[int] = []

    def on_step(step: int, num_steps: int, elapsed_s: float) -> None:
        step_end_us.append(time.time_ns() // 1000)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides(model, device))
    spec = plan(cfg, None)
    workload = Workloads().of(cfg)
    prediction = workload.predict(spec, cfg.optimizer)
    cuda = spec.device.type == "cuda"
    release_memory(spec.device)
    reserved_at_start = torch.cuda.memory_reserved(spec.device) if cuda else 0
    if cuda:  # from an emptied cache: every segment but what stayed live is in the trace
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=max_entries
        )
    try:
        result = run(cfg, spec, Hooks(on_step=on_step), workload)
    finally:
        if cuda:
            raw = torch.cuda.memory._snapshot()
            reserved = torch.cuda.memory_reserved()
            torch.cuda.memory._record_memory_history(enabled=None)
    name = f"batchfit_{model}_fp32_64_training"
    if not cuda:
        print(f"{name}: ran on {device}, peak {format_bytes(result.peak_bytes)}; no CUDA history")
        return []
    snapshot = compact(raw)
    snapshot["batchfit"] = {
        "overrides": overrides(model, device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device_name": torch.cuda.get_device_name(spec.device),
        "predicted_reserved_bytes": prediction.reserved_bytes,
        "predicted_tensor_bytes": prediction.tensor_bytes,
        "max_memory_reserved": result.reserved_bytes,
        "max_memory_allocated": result.peak_bytes,
        "reserved_at_start_bytes": reserved_at_start,
        "step_end_unix_us": step_end_us,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    found = problems(snapshot, reserved, max_entries)
    size = write(snapshot, out / f"{name}.json.gz")
    num_events = sum(len(t) for t in snapshot["device_traces"])
    print(
        f"{name}: {num_events} events, {len(snapshot['segments'])} segments at the end, "
        f"max reserved {format_bytes(result.reserved_bytes or 0)}, predicted "
        f"{format_bytes(prediction.reserved_bytes or prediction.peak_bytes)}; "
        f"{size / 2**10:.0f} KiB at {out / (name + '.json.gz')}"
    )
    if size > 16 * 2**20:
        found.append(f"{size} B: over the 16 MiB a file can take back from the GPU machine")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_out = os.environ.get("OUT") or str(REPO / "mlruns" / "gpu-checks")
    parser.add_argument("--out", default=default_out, help="the folder written ($OUT)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-entries", type=int, default=MAX_ENTRIES)
    args = parser.parse_args()
    failed = []
    for model in args.models:
        try:
            found = record(model, args.device, Path(args.out), args.max_entries)
        except Exception as error:  # this model's FAIL; the next one still records
            traceback.print_exc()
            found = [f"{type(error).__name__}: {error}"]
        finally:
            release_memory(torch.device(args.device))
        for problem in found:
            print(f"{model}: {problem}")
        failed += [model] if found else []
    ran = len(args.models) - len(failed)
    if args.device != "cuda":
        print(f"{ran}/{len(args.models)} runs on {args.device}; nothing recorded (CUDA only)")
    else:
        verdict = "FAIL" if failed else "PASS"
        print(f"snapshots: {ran}/{len(args.models)} fit for a fixture: {verdict}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
