"""Model FLOPs utilisation: the FLOPs a training step needs, and what the device can do.

- FLOPs per sample are counted, not estimated: one forward and backward pass of the run's
  micro-batch is computed on fake tensors (train/memory/predict.py, the step preflight computes
  anyway) under `torch.utils.flop_counter.FlopCounterMode`, which counts matmuls,
  convolutions and attention from their shapes. Element-wise work and the optimizer are not
  counted, as in the usual MFU (PaLM, appendix B).
- The peak: on CUDA from a table of known GPUs per precision (dense, no sparsity), or
  `trainer.peak_flops`; on CPU measured once per machine by a short GEMM probe per dtype and
  cached (`$XDG_CACHE_HOME/batchfit/peak_flops.json`), since CPUs differ by 50x in bf16. The
  probe is the best of several rounds spread over about a second, so that a busy spell
  spoils some, not all; a probe taken on a machine busy all along still reads low, so a run
  that achieves more than the cached peak contradicts it: the peak is measured again and
  the cache keeps the higher of the two.
- MFU = FLOPs per sample x samples per second / peak: whether a larger batch still buys
  compute efficiency, or only memory pressure. It is never above 1 unless the peak is an
  underestimate; `perf_metrics` then says so (e.g. a `trainer.peak_flops` set too low)
  beside the figure, which it does not clamp.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import flop_counter

from batchfit.tracking.metrics import ACHIEVED_FLOPS, FLOPS_PER_SAMPLE, MFU, PEAK_FLOPS
from batchfit.tracking.outputs import cache_folder
from batchfit.train.device.gpus import gpu_of_device_name

CPU_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
              "fp16": torch.float16}  # fmt: skip
# The MLflow tag beside a perf/mfu above 1, saying why (perf_metrics).
MFU_NOTE_TAG = "batchfit.mfu_note"
PROBE_SIZE = 512  # the GEMM's side: big enough for the kernels' steady state, ~0.3 GFLOP
# PROBE_ROUNDS rounds of PROBE_SECONDS each (and at least PROBE_BURSTS matmuls), PROBE_PAUSE_S
# apart: the best matmul of all is the peak. A single 0.3 s round read 2.4-2.8x low while
# other processes were busy (issue 16); rounds spread over ~1 s outlast a passing spell.
PROBE_ROUNDS = 4
PROBE_SECONDS = 0.15
PROBE_PAUSE_S = 0.1
PROBE_BURSTS = 10


def _register_cpu_attention() -> None:
    """FlopCounterMode knows the CUDA attention kernels; scaled_dot_product_attention on CPU
    runs another op, counted here with the same formulas (causal attention counted whole,
    as for CUDA). torch 2.15 counts them itself (flop_registry is keyed by the op packet):
    those are left as they are."""
    aten = torch.ops.aten
    pairs = (
        ("_scaled_dot_product_flash_attention_for_cpu", flop_counter.sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", flop_counter.sdpa_backward_flop),
    )
    for name, formula in pairs:
        op = getattr(aten, name, None)
        if op is not None and op not in flop_counter.flop_registry:
            # the formulas are already wrapped to take shapes: register them as they are
            flop_counter.register_flop_formula(op, get_raw=True)(formula)


_register_cpu_attention()


def count_flops(step: Callable[[], object]) -> int:
    """FLOPs of what `step()` computes (matmuls, convolutions, attention), by shape."""
    with flop_counter.FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def cuda_peak(name: str, precision: str) -> float | None:
    """The dense peak of a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3') from the GPU table
    (train/device/gpus.py), or None for a card or precision it does not know."""
    entry = gpu_of_device_name(name)
    return None if entry is None else entry.peak_flops.get(precision)


def _cache_path() -> Path:
    return cache_folder() / "peak_flops.json"


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


def best_rate(
    burst: Callable[[], float],
    rounds: int = PROBE_ROUNDS,
    seconds: float = PROBE_SECONDS,
    pause_s: float = PROBE_PAUSE_S,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """The best rate that `burst()` (one timed matmul: its FLOP/s) reaches in `rounds` rounds
    of at least `seconds` and PROBE_BURSTS bursts each, `pause_s` apart."""
    best = 0.0
    for round_index in range(rounds):
        if round_index:
            sleep(pause_s)
        deadline, bursts = time.perf_counter() + seconds, 0
        while time.perf_counter() < deadline or bursts < PROBE_BURSTS:
            bursts += 1
            best = max(best, burst())
    return best


def gemm_probe(precision: str, size: int = PROBE_SIZE) -> float:
    """FLOP/s of square matmuls in `precision`'s dtype on this CPU (the best of rounds)."""
    dtype = CPU_DTYPES[precision]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    torch.mm(a, b)  # first call: kernel selection

    def burst() -> float:
        started = time.perf_counter()
        torch.mm(a, b)
        return 2 * size**3 / (time.perf_counter() - started)

    return best_rate(burst)


def _read_cache(path: Path) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, cache: dict[str, float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home: probe again next time


def cpu_peak(precision: str, probe: Callable[[str], float] | None = None) -> float:
    """This machine's measured GEMM peak for `precision`, from the cache or probed now."""
    path, key = _cache_path(), _machine_key(precision)
    cache = _read_cache(path)
    if key not in cache:
        cache[key] = (probe or gemm_probe)(precision)
        _write_cache(path, cache)
    return float(cache[key])


def reprobe_cpu_peak(precision: str, probe: Callable[[str], float] | None = None) -> float:
    """Measure the peak again (the cached one was contradicted) and cache the higher of the
    two: a probe can read low on a busy machine, never high."""
    path, key = _cache_path(), _machine_key(precision)
    cache = _read_cache(path)
    cache[key] = max(float(cache.get(key, 0.0)), (probe or gemm_probe)(precision))
    _write_cache(path, cache)
    return cache[key]


def peak_flops(
    device: torch.device,
    precision: str,
    override: float | None = None,
    probe: Callable[[str], float] | None = None,
) -> float | None:
    """The device's peak FLOP/s for `precision`: `override` (trainer.peak_flops) if given,
    the CUDA table, or the CPU probe; None for a GPU the table does not know."""
    if override:
        return float(override)
    if device.type == "cuda":
        return cuda_peak(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        return cpu_peak(precision, probe)
    return None


def perf_metrics(
    flops_per_sample: float,
    samples_per_sec: float,
    device: torch.device,
    precision: str,
    override: float | None = None,
    probe: Callable[[str], float] | None = None,
) -> tuple[dict[str, float], str | None]:
    """perf/* figures of a run (mfu_metrics against `peak_flops`), and a note when its MFU is
    above 1, which only a peak below the truth gives. A CPU peak the run contradicts is
    measured again first (reprobe_cpu_peak); an MFU still above 1 is logged as measured,
    with the note saying why and what to set. Both entry points (a trial, `python -m
    train`) take their perf/* figures from here."""
    achieved = flops_per_sample * samples_per_sec
    peak = peak_flops(device, precision, override, probe)
    if peak and achieved > peak and not override and device.type == "cpu":
        peak = reprobe_cpu_peak(precision, probe)
    note = None
    if peak and achieved > peak:
        ratio = (
            f"perf/mfu={achieved / peak:.2f} is above 1: this run achieved {achieved:.3g} FLOP/s"
        )
        if override:
            note = f"{ratio}, over trainer.peak_flops={override:g}; raise trainer.peak_flops"
        elif device.type == "cpu":
            note = (
                f"{ratio}, over this CPU's {precision} GEMM peak of {peak:.3g} measured again "
                f"just now ({_cache_path()}), so that peak is an underestimate (the machine may "
                f"be busy); set trainer.peak_flops to the CPU's true {precision} peak"
            )
        else:
            note = (
                f"{ratio}, over the table's {precision} peak of {peak:.3g} for this device; set "
                "trainer.peak_flops to its true peak"
            )
    return mfu_metrics(flops_per_sample, samples_per_sec, peak), note


def mfu_metrics(
    flops_per_sample: float, samples_per_sec: float, peak: float | None
) -> dict[str, float]:
    """perf/* figures of a run: FLOPs per sample, achieved FLOP/s and, with a peak, MFU."""
    achieved = flops_per_sample * samples_per_sec
    figures = {FLOPS_PER_SAMPLE: flops_per_sample, ACHIEVED_FLOPS: achieved}
    if peak:
        figures[PEAK_FLOPS] = peak
        figures[MFU] = achieved / peak
    return figures
