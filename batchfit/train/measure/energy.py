"""Energy the hardware counts over a run's timed steps, and how busy the device was.

The meter is read where the throughput clock already synchronises the device (the
Stopwatch of train/measure/throughput.py, at its starts and stops: logging intervals and
validations, never in the hot loop), so its window is the one `time/step_ms` times: warm-up,
memory-measured steps and validation stay out. What counts the joules, never a TDP times
seconds:

- **NVIDIA GPUs**: NVML's total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`,
  millijoules since the driver loaded; Volta and later) through nvidia-ml-py (the
  `energy` extra). A card without it: NVML's power samples (`nvmlDeviceGetSamples` with
  NVML_TOTAL_POWER_SAMPLES, milliwatts, each stamped in CPU microseconds) in the window,
  their time-weighted mean times the window's seconds; with no sample in it, or where NVML
  keeps none for the card (NVML_ERROR_NOT_SUPPORTED), the power reading at its end. The
  source is said (`Energy.source`, the run's tag). A MIG slice, or a card in MIG mode, is
  refused: NVML measures no slice's energy (a card's counter in MIG mode holds every
  slice's), as Zeus refuses MIG devices (zeus/device/gpu/nvidia.py, NVIDIAGPUs._init_gpus).
- **CPUs**: Linux powercap RAPL (`/sys/class/powercap/intel-rapl:N/energy_uj`, the package
  zones; AMD's RAPL shows under the same names), which wraps to 0 past
  `max_energy_range_uj`: a reading below the previous one adds the range. A thread of the
  reader reads it about once a second while the meter runs (POLL_S), not the training
  loop, whose one step or stall can outlast a wrap (AMD's 32-bit counter wraps after
  ~65 kJ, 4 minutes at 250 W): each read sees one wrap at most. Zeus polls its RAPL
  counters every second too, in a process (zeus/device/cpu/rapl.py, _polling_process).
  Its subzones (core, uncore) are inside the package's count, the `psys` zone holds the packages and
  `intel-rapl-mmio:N` is package N again through MMIO: none is added. A zone whose
  counter this process cannot read (root-only since CVE-2020-8694) is left out; none
  readable, no meter.
- Elsewhere, or with none of these readable, no meter and no energy figures: a run says
  so once (`why_unmeasured`), never a zero.

Nor a figure from windows too short for their counter: the timed seconds must span
MIN_UPDATES of its updates (NVML's every ~100 ms, slower on some cards: 1 s; RAPL's every
~1 ms: 10 ms), lest one update more or less be a tenth of the joules or all of them; and
joules that never advanced are none either (a stub some virtual machines expose). The
meter's `failed` says which, once, in the run's tag.

Outside every counter: the host's other parts on a GPU run, DRAM (RAPL's dram zone is not
added), fans, cooling and the power supply's losses. RAPL counts the whole package, other
processes included: on a shared machine it overstates a run's share.

The device's utilisation over the same window: on a GPU, NVML's utilisation samples (the
share of each sample period a kernel ran) in the window, their mean (the last reading
where the window has none); on a CPU, the process's CPU seconds over wall seconds times
its torch threads, so that a batch too small to keep the device busy shows.

A data-parallel run sums its ranks' joules, once per counter (ranks on one CPU package
read the same RAPL counter): `Energy.combine`.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from batchfit.tracking.metrics import (
    DEVICE_PREFIX,
    DEVICE_UTILIZATION,
    ENERGY_J,
    ENERGY_PREFIX,
    MEAN_WATTS,
    joules_per,
)

ENERGY_TAG = "batchfit.energy"  # a run's tag: what counted its joules, or why nothing did
POWERCAP = Path("/sys/class/powercap")
NVML_COUNTER = "NVML energy counter"
NVML_SAMPLES = "NVML power samples"
RAPL = "RAPL"
UNMEASURED = "energy: not measured here: no RAPL or NVML counter readable"
NVML_UPDATE_S = 0.1  # NVML's energy counter and power samples update about this often
RAPL_UPDATE_S = 0.001  # RAPL's, about every millisecond (Intel's SDM, MSR_PKG_ENERGY_STATUS)
MIN_UPDATES = 10  # a figure's windows span this many of its counter's updates at least
POLL_S = 1.0  # a RAPL counter's thread reads it this often, lest it wrap twice unseen


@dataclass(frozen=True)
class Energy:
    """What the counters saw over a run's timed windows."""

    joules: float
    seconds: float  # the windows' wall seconds
    source: str  # NVML_COUNTER, NVML_SAMPLES or RAPL, with what it read
    counters: tuple[str, ...]  # which counters (a GPU's UUID, a host's RAPL zone)
    utilization: float | None = None  # the device's mean busy share, 0-1

    @property
    def mean_watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else math.nan

    def metrics(self, samples: int, units: int, unit: str) -> dict[str, float]:
        """The run's energy/* and device/utilization figures: per sample and, for a task
        counting another unit (tokens), per that unit too."""
        figures = {ENERGY_J: self.joules, MEAN_WATTS: self.mean_watts}
        if samples:
            figures[joules_per("samples")] = self.joules / samples
        if unit != "samples" and units:
            figures[joules_per(unit)] = self.joules / units
        if self.utilization is not None:
            figures[DEVICE_UTILIZATION] = self.utilization
        return {k: v for k, v in figures.items() if math.isfinite(v)}

    @staticmethod
    def combine(readings: Sequence[Energy | None]) -> Energy | None:
        """A data-parallel run's energy from its ranks': each counter's joules once (the
        largest reading of it: ranks sharing a RAPL package read it over windows a little
        apart), summed; the windows' longest seconds; the ranks' mean utilisation. None
        where a rank measured nothing: a partial sum would read as the whole."""
        if not readings or any(r is None for r in readings):
            return None
        per_counter: dict[tuple[str, ...], Energy] = {}
        for r in readings:
            assert r is not None
            kept = per_counter.get(r.counters)
            if kept is None or r.joules > kept.joules:
                per_counter[r.counters] = r
        utils = [r.utilization for r in readings if r is not None and r.utilization is not None]
        kept = list(per_counter.values())
        return Energy(
            joules=sum(r.joules for r in kept),
            seconds=max(r.seconds for r in kept),
            source=kept[0].source,
            counters=tuple(c for r in kept for c in r.counters),
            utilization=statistics.fmean(utils) if utils else None,
        )


class Reader(Protocol):
    """One counter over the meter's windows: start() at a window's start, stop() at its
    end returns the joules in it."""

    key: str
    source: str
    update_s: float  # how often the counter updates: a figure needs MIN_UPDATES of them

    def start(self) -> None: ...

    def stop(self, seconds: float) -> float: ...


class EnergyMeter:
    """Joules and busy share over the windows between start() and stop(), summed over its
    readers (a card, or a host's RAPL packages); `busy` reads the utilisation. A counter
    that fails to read mid-run ends the measurement, never the run; `failed` says why
    reading() gives no figure."""

    def __init__(
        self,
        readers: Sequence[Reader],
        busy: Busy | None = None,
        now: Callable[[], float] = time.perf_counter,
    ):
        self.readers = list(readers)
        self.busy = busy
        self._now = now
        self._started: float | None = None
        self.joules = 0.0
        self.seconds = 0.0
        self._busy_s = 0.0  # busy share x seconds, summed over the windows
        self._failure: str | None = None  # a counter that failed: for good

    def start(self) -> None:
        if self._failure is not None:
            return
        try:
            for reader in self.readers:
                reader.start()
            if self.busy is not None:
                self.busy.start()
        except Exception as error:  # noqa: BLE001 - any counter's failure: measure no more
            self._fail(error)
            return
        self._started = self._now()

    def stop(self) -> None:
        if self._started is None:
            return
        seconds = self._now() - self._started
        self._started = None
        try:
            joules = sum(reader.stop(seconds) for reader in self.readers)
            busy = self.busy.stop(seconds) if self.busy is not None else 0.0
        except Exception as error:  # noqa: BLE001 - as in start
            self._fail(error)
            return
        self.joules += joules
        self.seconds += seconds
        self._busy_s += busy * seconds

    def _fail(self, error: Exception) -> None:
        """Measures no more, each reader stopped (a RAPL reader's thread with it)."""
        self._failure = f"energy: not measured: a counter failed: {error!r}"
        for reader in self.readers:
            try:
                reader.stop(0.0)
            except Exception:  # noqa: BLE001, S112 - the failure that matters is said above
                continue

    @property
    def failed(self) -> str | None:
        """Why reading() gives no figure after a window: a counter that failed (for good),
        timed seconds shorter than MIN_UPDATES of the slowest counter's updates, or
        counters that never advanced (a stub some virtual machines expose): no zero that
        would read as a free configuration. None where it gives one, or before any window."""
        if self._failure is not None or self.seconds <= 0:
            return self._failure
        slowest = max(self.readers, key=lambda reader: reader.update_s, default=None)
        needed_s = MIN_UPDATES * slowest.update_s if slowest is not None else 0.0
        if self.seconds < needed_s:
            assert slowest is not None
            return (
                f"energy: not measured: the timed steps lasted {_seconds(self.seconds)} s, "
                f"under the {needed_s:g} s a counter needs ({slowest.source}: {MIN_UPDATES} "
                f"updates of ~{slowest.update_s:g} s); more timed steps (trainer.max_steps) "
                "give a figure"
            )
        if self.joules <= 0:
            seconds = _seconds(self.seconds)
            return f"energy: not measured: the counters did not advance in {seconds} s"
        return None

    def reading(self) -> Energy | None:
        """What the windows so far counted; None before any window, or where `failed`
        says why not."""
        if self.seconds <= 0 or self.failed is not None:
            return None
        sources = sorted({reader.source for reader in self.readers})
        return Energy(
            joules=self.joules,
            seconds=self.seconds,
            source=", ".join(sources),
            counters=tuple(reader.key for reader in self.readers),
            utilization=self._busy_s / self.seconds if self.busy is not None else None,
        )


def _seconds(seconds: float) -> str:
    """Seconds as a reader reads them: 0.4, 0.005, 1.5, 120.0."""
    return f"{seconds:.2g}" if seconds < 1 else f"{seconds:.1f}"


class Busy(Protocol):
    """A device's busy share over a window."""

    def start(self) -> None: ...

    def stop(self, seconds: float) -> float: ...


# ----------------------------------------------------------------------------- NVML


def _sample_value(value_type: int, sample: Any) -> float:
    """An NVML sample's value by its declared type (nvmlValueType_t)."""
    field = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")[value_type]
    return float(getattr(sample.sampleValue, field))


def _samples(nvml: ModuleType, handle: Any, kind: int, since_us: int) -> list[tuple[int, float]]:
    """NVML's samples of `kind` stamped after `since_us` (CPU microseconds): (stamp, value),
    oldest first; none when NVML has none (NVML_ERROR_NOT_FOUND) or keeps none of `kind`
    for the card (NVML_ERROR_NOT_SUPPORTED)."""
    try:
        value_type, samples = nvml.nvmlDeviceGetSamples(handle, kind, since_us)
    except (nvml.NVMLError_NotFound, nvml.NVMLError_NotSupported):
        return []
    found = [(int(s.timeStamp), _sample_value(value_type, s)) for s in samples]
    return sorted(p for p in found if p[0] > since_us)


def time_weighted_mean(points: Sequence[tuple[int, float]]) -> float:
    """The mean of a sampled signal [(stamp, value), ...] over the samples' span, by the
    trapezoid rule; one sample: its value."""
    if len(points) == 1:
        return points[0][1]
    area = sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in itertools.pairwise(points))
    span = points[-1][0] - points[0][0]
    return area / span if span > 0 else statistics.fmean(v for _, v in points)


def _now_us() -> int:
    return time.time_ns() // 1000


class NvmlReader:
    """One card's joules: its energy counter, or its power samples (module docstring)."""

    update_s = NVML_UPDATE_S

    def __init__(self, nvml: ModuleType, handle: Any, key: str, now_us: Callable[[], int]):
        self.nvml, self.handle, self.key, self._now_us = nvml, handle, key, now_us
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self.source = NVML_COUNTER
        except nvml.NVMLError_NotSupported:  # before Volta
            nvml.nvmlDeviceGetPowerUsage(handle)  # raises where the card has no power reading
            self.source = NVML_SAMPLES
        self._at: int = 0  # the window's start: mJ on the counter, else CPU microseconds

    def start(self) -> None:
        if self.source == NVML_COUNTER:
            self._at = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        else:
            self._at = self._now_us()

    def stop(self, seconds: float) -> float:
        if self.source == NVML_COUNTER:
            return (self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - self._at) / 1e3
        points = _samples(self.nvml, self.handle, self.nvml.NVML_TOTAL_POWER_SAMPLES, self._at)
        if points:
            milliwatts = time_weighted_mean(points)
        else:  # a window shorter than NVML's sampling period, or no samples kept
            milliwatts = self.nvml.nvmlDeviceGetPowerUsage(self.handle)
        return milliwatts / 1e3 * seconds


class NvmlBusy:
    """A card's utilisation samples over a window, their mean as a share."""

    def __init__(self, nvml: ModuleType, handle: Any, now_us: Callable[[], int]):
        self.nvml, self.handle, self._now_us = nvml, handle, now_us
        self._since = 0

    def start(self) -> None:
        self._since = self._now_us()

    def stop(self, seconds: float) -> float:
        kind = self.nvml.NVML_GPU_UTILIZATION_SAMPLES
        points = _samples(self.nvml, self.handle, kind, self._since)
        if points:
            return statistics.fmean(v for _, v in points) / 100
        return self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100


def _nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def nvml_meter(
    device: torch.device,
    nvml: ModuleType | None = None,
    now_us: Callable[[], int] = _now_us,
    uuid: str | None = None,
) -> EnergyMeter | str:
    """The meter of a CUDA device through NVML, or why there is none. The card is found by
    its UUID (torch's index counts CUDA_VISIBLE_DEVICES's cards, NVML's every card)."""
    nvml = nvml or _nvml()
    if nvml is None:
        return (
            "energy: not measured here: nvidia-ml-py is not installed "
            "(pip install 'batchfit[energy]')"
        )
    try:
        nvml.nvmlInit()
        if uuid is None:
            uuid = _torch_uuid(device)
        handle = _handle(nvml, device, uuid)
        if (mig := _mig(nvml, handle)) is not None:
            return (
                f"energy: not measured here: GPU {device.index or 0} is {mig}; "
                "NVML measures no MIG slice's energy"
            )
        key = uuid or f"{socket.gethostname()}:nvml:{device.index or 0}"
        reader = NvmlReader(nvml, handle, key, now_us)
        return EnergyMeter([reader], NvmlBusy(nvml, handle, now_us))
    except nvml.NVMLError as error:
        return f"energy: not measured here: NVML: {error}"


def _handle(nvml: ModuleType, device: torch.device, uuid: str | None) -> Any:
    """NVML's handle of the card, by its UUID: torch's spelling has no prefix, NVML's is
    `GPU-...` (a MIG instance: `MIG-...`). By index only where torch gives no UUID: CUDA's
    order (CUDA_VISIBLE_DEVICES, FASTEST_FIRST) need not be NVML's, and another card's
    joules are worse than none."""
    if uuid is None:
        return nvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    bare = uuid.removeprefix("GPU-").removeprefix("MIG-")
    spellings = [uuid] if uuid.startswith(("GPU-", "MIG-")) else []
    spellings += [f"GPU-{bare}", f"MIG-{bare}"]
    for spelling in dict.fromkeys(spellings):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(spelling)
        except nvml.NVMLError_NotFound:
            continue
    raise nvml.NVMLError_NotFound(nvml.NVML_ERROR_NOT_FOUND)


def _mig(nvml: ModuleType, handle: Any) -> str | None:
    """'a MIG slice' or 'in MIG mode' where the handle is one, else None. A card without
    MIG (before Ampere) or a driver before it (R450) answers NOT_SUPPORTED or has no such
    function: no MIG."""
    absent = (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound)
    try:
        if nvml.nvmlDeviceIsMigDeviceHandle(handle):
            return "a MIG slice"
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except absent:
        return None
    return "in MIG mode" if current == nvml.NVML_DEVICE_MIG_ENABLE else None


def _torch_uuid(device: torch.device) -> str | None:
    """The card's UUID as torch spells it, where it says."""
    try:
        uuid = getattr(torch.cuda.get_device_properties(device.index or 0), "uuid", None)
    except (AssertionError, RuntimeError):  # no CUDA in this torch or process
        return None
    return None if uuid is None else str(uuid)


# ----------------------------------------------------------------------------- RAPL


class RaplReader:
    """One RAPL package zone's joules, its wrap-around counted: between start() and stop()
    a daemon thread of its own reads the counter every `poll_s`, so that each read sees one
    wrap at most however long the training loop's steps. The counter's state is read under
    a lock (the thread's poll, the caller's start, poll and stop)."""

    source = RAPL
    update_s = RAPL_UPDATE_S

    def __init__(self, zone: Path, poll_s: float = POLL_S):
        self.zone = zone
        self.key = f"{socket.gethostname()}:{zone.name}"
        self.range_uj = int((zone / "max_energy_range_uj").read_text())
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._at = self._read()
        self._kept = 0  # microjoules read by poll() in the current window
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None  # what stopped the thread, raised by stop()

    def _read(self) -> int:
        return int((self.zone / "energy_uj").read_text())

    def start(self) -> None:
        self._halt_thread()
        with self._lock:
            self._at = self._read()
            self._kept = 0
        self._error = None
        self._halt = threading.Event()
        # The thread holds the reader weakly: a meter dropped unstopped ends it.
        self._thread = threading.Thread(
            target=_poll_until, args=(weakref.ref(self), self._halt, self.poll_s),
            name=f"batchfit-rapl-{self.zone.name}", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _advance(self) -> int:
        now = self._read()
        delta = now - self._at if now >= self._at else now + self.range_uj - self._at
        self._at = now
        return delta

    def poll(self) -> None:
        """Reads the counter mid-window: each read sees one wrap at most."""
        with self._lock:
            self._kept += self._advance()

    def _halt_thread(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def stop(self, seconds: float) -> float:
        self._halt_thread()
        if self._error is not None:
            raise self._error
        with self._lock:
            return (self._kept + self._advance()) / 1e6


def _poll_until(ref: weakref.ref[RaplReader], halt: threading.Event, poll_s: float) -> None:
    """A RAPL reader's thread: polls it every `poll_s` until halted or the reader is gone;
    a failed read is kept for its stop() to raise."""
    while not halt.wait(poll_s):
        reader = ref()
        if reader is None:
            return
        try:
            reader.poll()
        except (OSError, ValueError) as error:  # a zone gone, a counter made unreadable
            reader._error = error
            return
        del reader  # asleep, the thread holds no reference to it


def rapl_zones(root: Path = POWERCAP) -> list[Path]:
    """The package zones of `root` whose counters this process can read: `intel-rapl:N`
    (the MSR interface, AMD's too; not its `:M` subzones, inside it, nor `intel-rapl-mmio:N`,
    the same package through MMIO) whose name is not psys (which holds the packages)."""
    zones = []
    for zone in sorted(root.glob("intel-rapl:*")) if root.is_dir() else []:
        if zone.name.count(":") != 1:
            continue
        try:
            if (zone / "name").read_text().strip() == "psys":
                continue
            int((zone / "energy_uj").read_text())
            int((zone / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        zones.append(zone)
    return zones


class ProcessBusy:
    """A CPU's busy share: this process's CPU seconds (every thread) over the window's
    wall seconds times its torch threads."""

    def __init__(self, threads: Callable[[], int] = torch.get_num_threads):
        self._threads = threads
        self._cpu = 0.0

    def start(self) -> None:
        self._cpu = time.process_time()

    def stop(self, seconds: float) -> float:
        cpu = time.process_time() - self._cpu
        # Every thread's CPU seconds count (loader, MLflow's, OpenMP's spin-waits), so the
        # share can pass 1; it is a share of the device, so it stops there.
        return min(cpu / (seconds * self._threads()), 1.0) if seconds > 0 else 0.0


def rapl_meter(root: Path = POWERCAP) -> EnergyMeter | str:
    """The meter of this host's CPU packages through RAPL, or why there is none."""
    zones = rapl_zones(root)
    if not zones:
        return UNMEASURED
    try:
        return EnergyMeter([RaplReader(zone) for zone in zones], ProcessBusy())
    except (OSError, ValueError) as error:  # readable a moment ago
        return f"energy: not measured here: RAPL: {error}"


# ----------------------------------------------------------------------------- either


def energy_meter(device: torch.device) -> EnergyMeter | str:
    """The energy meter of the device a run trains on, or why there is none. The powercap
    tree is BATCHFIT_POWERCAP where set (a host's /sys mounted elsewhere in a container)."""
    if device.type == "cuda":
        return nvml_meter(device)
    if device.type == "cpu":
        return rapl_meter(Path(os.environ.get("BATCHFIT_POWERCAP", POWERCAP)))
    return f"energy: not measured here: no counter read on a {device.type} device"


def why_unmeasured(device: torch.device) -> str | None:
    """Why a run on `device` would measure no energy (UNMEASURED and the like); None where
    a counter is readable."""
    found = energy_meter(device)
    return None if isinstance(found, EnergyMeter) else found


def needs_energy(metric: str) -> bool:
    """Whether `metric` is a figure only an energy meter gives."""
    return metric.startswith((ENERGY_PREFIX, DEVICE_PREFIX))
