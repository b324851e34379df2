"""Model FLOPs utilisation: the FLOPs a training step needs, and what the device can do.

- FLOPs per sample are counted, not estimated: one forward and backward pass of the run's
  micro-batch is computed on fake tensors (train/predict.py, the step preflight computes
  anyway) under `torch.utils.flop_counter.FlopCounterMode`, which counts matmuls,
  convolutions and attention from their shapes. Element-wise work and the optimizer are not
  counted, as in the usual MFU (PaLM, appendix B).
- The peak: on CUDA from a table of known GPUs per precision (dense, no sparsity), or
  `trainer.peak_flops`; on CPU measured once per machine by a short GEMM probe per dtype and
  cached (`$XDG_CACHE_HOME/batchfit/peak_flops.json`), since CPUs differ by 50x in bf16. A
  probe taken while the machine was busy reads low (MFU then reads high): delete the file to
  measure again, or set `trainer.peak_flops`.
- MFU = FLOPs per sample x samples per second / peak: whether a larger batch still buys
  compute efficiency, or only memory pressure.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import flop_counter

# Dense peak FLOP/s per precision, from the vendors' data sheets (SXM parts where both exist).
# fp32 is plain FP32 (no TF32); tf32, bf16 and fp16 run on the tensor cores.
CUDA_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "H100": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "V100": {"fp32": 15.7e12, "fp16": 125e12},
    "T4": {"fp32": 8.1e12, "fp16": 65e12},
}
CPU_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
              "fp16": torch.float16}  # fmt: skip
PROBE_SIZE = 512  # the GEMM's side: big enough for the kernels' steady state, ~0.3 GFLOP
PROBE_SECONDS = 0.3  # and at least PROBE_BURSTS matmuls: the best one is the peak
PROBE_BURSTS = 20


def _register_cpu_attention() -> None:
    """FlopCounterMode knows the CUDA attention kernels; scaled_dot_product_attention on CPU
    runs another op, counted here with the same formulas (causal attention counted whole,
    as for CUDA)."""
    aten = torch.ops.aten
    pairs = (
        ("_scaled_dot_product_flash_attention_for_cpu", flop_counter.sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", flop_counter.sdpa_backward_flop),
    )
    for name, formula in pairs:
        op = getattr(aten, name, None)
        if op is not None and op.default not in flop_counter.flop_registry:
            # the formulas are already wrapped to take shapes: register them as they are
            flop_counter.register_flop_formula(op, get_raw=True)(formula)


_register_cpu_attention()


def count_flops(step: Callable[[], object]) -> int:
    """FLOPs of what `step()` computes (matmuls, convolutions, attention), by shape."""
    with flop_counter.FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def cuda_peak(name: str, precision: str) -> float | None:
    """The table's peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), or None."""
    for key in sorted(CUDA_PEAKS, key=len, reverse=True):  # L40S before L4
        if key in name.upper():
            return CUDA_PEAKS[key].get(precision)
    return None


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "batchfit" / "peak_flops.json"


def _machine_key(precision: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}|{precision}"


def gemm_probe(precision: str, size: int = PROBE_SIZE, seconds: float = PROBE_SECONDS) -> float:
    """FLOP/s of square matmuls in `precision`'s dtype on this CPU (best of short bursts)."""
    dtype = CPU_DTYPES[precision]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    torch.mm(a, b)  # first call: kernel selection
    best, deadline, bursts = 0.0, time.perf_counter() + seconds, 0
    while time.perf_counter() < deadline or bursts < PROBE_BURSTS:
        bursts += 1
        started = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - started
        best = max(best, 2 * size**3 / elapsed)
    return best


def cpu_peak(precision: str) -> float:
    """This machine's measured GEMM peak for `precision`, from the cache or probed now."""
    path, key = _cache_path(), _machine_key(precision)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = gemm_probe(precision)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cache, indent=1, sort_keys=True))
        except OSError:
            pass  # a read-only home: probe again next time
    return float(cache[key])


def peak_flops(device: torch.device, precision: str, override: float | None = None) -> float | None:
    """The device's peak FLOP/s for `precision`: `override` (trainer.peak_flops) if given,
    the CUDA table, or the CPU probe; None for a GPU the table does not know."""
    if override:
        return float(override)
    if device.type == "cuda":
        return cuda_peak(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        return cpu_peak(precision)
    return None


def mfu_metrics(
    flops_per_sample: float, samples_per_sec: float, peak: float | None
) -> dict[str, float]:
    """perf/* figures of a run: FLOPs per sample, achieved FLOP/s and, with a peak, MFU."""
    achieved = flops_per_sample * samples_per_sec
    figures = {"perf/flops_per_sample": flops_per_sample, "perf/achieved_flops": achieved}
    if peak:
        figures["perf/peak_flops"] = peak
        figures["perf/mfu"] = achieved / peak
    return figures
