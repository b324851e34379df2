"""The energy meter without the hardware: a fake NVML (the functions nvidia-ml-py exposes,
a counter that advances, samples it does not keep, a MIG slice), a fake powercap tree
(packages, a subzone, psys, a counter that wraps while the reader's thread polls it, an
unreadable zone), the clock reading it at its synchronised points, windows too short for a
counter, the ranks' sum, and a run's figures."""

from __future__ import annotations

import gc
import inspect
import os
import threading
import time
from ctypes import c_uint
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from batchfit.tracking.metrics import (
    DEVICE_UTILIZATION,
    ENERGY_J,
    ENERGY_PER_SAMPLE,
    MEAN_WATTS,
    joules_per,
)
from batchfit.train import loop
from batchfit.train.config import TrainerConfig
from batchfit.train.measure import energy
from batchfit.train.measure.energy import (
    NVML_COUNTER,
    NVML_SAMPLES,
    RAPL,
    UNMEASURED,
    Energy,
    EnergyMeter,
    RaplReader,
    energy_meter,
    nvml_meter,
    rapl_meter,
    rapl_zones,
    time_weighted_mean,
)
from batchfit.train.measure.throughput import ThroughputClock
from tests.train.test_loop import _fit, _flat_linear, _splits

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- a fake NVML


class FakeNvml:
    """The part of nvidia-ml-py's pynvml module the meter calls, over one card whose
    energy counter (mJ), power samples (mW) and utilisation samples (%) the test sets."""

    NVML_TOTAL_POWER_SAMPLES = 0
    NVML_GPU_UTILIZATION_SAMPLES = 1
    NVML_VALUE_TYPE_UNSIGNED_INT = 1
    NVML_ERROR_NOT_FOUND = 6
    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
        pass

    class NVMLError_NotFound(NVMLError):  # noqa: N801 - pynvml's name
        def __str__(self) -> str:
            return "Not Found"  # as pynvml's, whatever it was raised with

    class NVMLError_FunctionNotFound(NVMLError):  # noqa: N801 - pynvml's name
        pass

    def __init__(self, counter: bool = True, power_mw: int = 250_000):
        self.counter = counter
        self.mig_slice = False  # the handle is a MIG slice's
        self.mig_mode: int | None = 0  # the card's current MIG mode; None: a card without MIG
        self.energy_mj = 1_000_000  # since the driver loaded: never read from zero
        self.power_mw = power_mw
        self.samples: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
        self.utilization = 40
        self.inits = 0
        self.uuids: list[str] = []

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.inits += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802
        self.uuids.append(uuid)
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # noqa: N802
        return "handle"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:  # noqa: N802
        if not self.counter:
            raise self.NVMLError_NotSupported("Not Supported")
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:  # noqa: N802
        return self.power_mw

    def nvmlDeviceGetSamples(self, handle: str, kind: int, since: int):  # noqa: N802
        found = [
            SimpleNamespace(timeStamp=t, sampleValue=SimpleNamespace(uiVal=v))
            for t, v in self.samples[kind]
            if t > since
        ]
        if not found:
            raise self.NVMLError_NotFound("Not Found")
        return self.NVML_VALUE_TYPE_UNSIGNED_INT, found

    def nvmlDeviceGetUtilizationRates(self, handle: str):  # noqa: N802
        return SimpleNamespace(gpu=self.utilization, memory=0)

    def nvmlDeviceIsMigDeviceHandle(self, handle: str) -> c_uint:  # noqa: N802
        return c_uint(self.mig_slice)  # pynvml's answer: a c_uint, not an int

    def nvmlDeviceGetMigMode(self, handle: str) -> list[int]:  # noqa: N802
        if self.mig_mode is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return [self.mig_mode, self.mig_mode]  # current, pending


def test_the_fake_nvml_is_shaped_like_nvidia_ml_py() -> None:
    """Every function and constant the fake gives the meter exists in pynvml with the same
    parameters: the meter cannot call what the real module lacks."""
    pynvml = pytest.importorskip("pynvml")
    for name, member in vars(FakeNvml).items():
        if name.startswith("nvml"):
            real = getattr(pynvml, name)
            ours = list(inspect.signature(member).parameters)[1:]  # less self
            assert len(inspect.signature(real).parameters) == len(ours), name
        elif name.startswith("NVML"):
            assert hasattr(pynvml, name), name
    assert issubclass(pynvml.NVMLError_NotSupported, pynvml.NVMLError)
    assert pynvml.NVML_VALUE_TYPE_UNSIGNED_INT == 1


class Clock:
    """perf_counter seconds and NVML's CPU microseconds, moved by the test."""

    def __init__(self) -> None:
        self.s = 100.0

    def now(self) -> float:
        return self.s

    def now_us(self) -> int:
        return round(self.s * 1e6)


def test_the_nvml_counter_gives_the_joules_of_each_window_and_the_mean_utilisation() -> None:
    nvml, clock = FakeNvml(), Clock()
    meter = nvml_meter(CPU, nvml, clock.now_us, uuid="GPU-1234")
    assert isinstance(meter, EnergyMeter)
    meter._now = clock.now
    assert nvml.uuids == ["GPU-1234"]
    meter.start()
    nvml.energy_mj += 300_000  # 300 J over 2 s
    nvml.samples[1] = [(clock.now_us() + 500_000, 60), (clock.now_us() + 1_500_000, 80)]
    clock.s += 2
    meter.stop()
    nvml.energy_mj += 999_000  # between windows (a validation): not counted
    clock.s += 5
    meter.start()
    nvml.energy_mj += 100_000  # 100 J over 1 s
    clock.s += 1
    nvml.utilization = 10  # no sample in this window: the last reading
    meter.stop()
    reading = meter.reading()
    assert reading is not None
    assert reading.source == NVML_COUNTER
    assert reading.joules == pytest.approx(400.0)
    assert reading.seconds == pytest.approx(3.0)
    assert reading.mean_watts == pytest.approx(400 / 3)
    # window means 0.70 (2 s) and 0.10 (1 s), weighted by their seconds
    assert reading.utilization == pytest.approx((0.7 * 2 + 0.1 * 1) / 3)
    assert reading.counters == ("GPU-1234",)


def test_without_an_energy_counter_the_power_samples_are_integrated_over_the_window() -> None:
    nvml, clock = FakeNvml(counter=False, power_mw=999_000), Clock()
    meter = nvml_meter(CPU, nvml, clock.now_us, uuid="GPU-1")
    assert isinstance(meter, EnergyMeter)
    meter._now = clock.now
    start = clock.now_us()
    # 200 W for 1 s then a ramp to 300 W over 1 s: trapezoid mean (200 + 250) / 2 = 225 W
    nvml.samples[0] = [(start - 10, 5_000_000), (start + 1, 200_000), (start + 1_000_001, 200_000),
                       (start + 2_000_001, 300_000)]  # fmt: skip
    meter.start()
    clock.s += 4  # a window of 4 s whose samples span 2 s: their mean over its seconds
    meter.stop()
    reading = meter.reading()
    assert reading is not None and reading.source == NVML_SAMPLES
    assert reading.joules == pytest.approx(225 * 4)
    # A window with no sample in it: the power reading at its end.
    meter.start()
    clock.s += 0.5
    meter.stop()
    assert meter.reading().joules == pytest.approx(225 * 4 + 999 * 0.5)


def test_time_weighted_mean_by_hand() -> None:
    assert time_weighted_mean([(0, 10.0)]) == 10.0
    assert time_weighted_mean([(0, 0.0), (2, 2.0), (3, 2.0)]) == pytest.approx((2 + 2) / 3)


def test_nvml_without_the_package_or_a_card_says_why() -> None:
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:  # noqa: N802
            raise self.NVMLError("Driver Not Loaded")

    why = nvml_meter(CPU, Broken(), uuid="GPU-1")
    assert why == "energy: not measured here: NVML: Driver Not Loaded"
    # No power reading at all either: no meter, not a meter of zeros.

    class Blind(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle: str) -> int:  # noqa: N802
            raise self.NVMLError_NotSupported("Not Supported")

    assert nvml_meter(CPU, Blind(counter=False), uuid="GPU-1").startswith(
        "energy: not measured here: NVML"
    )


def test_a_counter_failing_mid_run_ends_the_measurement_not_the_run() -> None:
    nvml, clock = FakeNvml(), Clock()
    meter = nvml_meter(CPU, nvml, clock.now_us, uuid="GPU-1")
    meter._now = clock.now
    meter.start()
    clock.s += 1
    nvml.energy_mj += 50_000
    meter.stop()
    assert meter.reading() is not None
    nvml.counter = False  # the driver went away
    meter.start()
    assert meter.reading() is None
    assert meter.failed is not None and "NotSupported" in meter.failed
    meter.stop()  # nothing raised


def test_power_samples_nvml_does_not_keep_fall_back_to_the_power_reading() -> None:
    """A card without the energy counter whose driver keeps no power or utilisation samples
    (nvmlDeviceGetSamples: NVML_ERROR_NOT_SUPPORTED, not NOT_FOUND): each window is the power
    reading at its end times its seconds, the utilisation the last reading; not a failure."""

    class NoSamples(FakeNvml):
        def nvmlDeviceGetSamples(self, handle: str, kind: int, since: int):  # noqa: N802
            raise self.NVMLError_NotSupported("Not Supported")

    nvml, clock = NoSamples(counter=False, power_mw=180_000), Clock()
    meter = nvml_meter(CPU, nvml, clock.now_us, uuid="GPU-1")
    assert isinstance(meter, EnergyMeter)
    meter._now = clock.now
    meter.start()
    clock.s += 2
    meter.stop()
    assert meter.failed is None
    reading = meter.reading()
    assert reading is not None and reading.source == NVML_SAMPLES
    assert reading.joules == pytest.approx(180 * 2)
    assert reading.utilization == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("slice_", "mode", "what"),
    [(True, 0, "a MIG slice"), (False, 1, "in MIG mode")],
)
def test_a_mig_slice_or_a_card_in_mig_mode_is_refused_in_one_line(
    slice_: bool, mode: int, what: str
) -> None:
    """NVML measures no MIG slice (a slice's counter and power reading: NOT_SUPPORTED; a card
    in MIG mode counts every slice's): no meter, and the one line that says why, not NVML's
    'Not Supported'. A card without MIG (its mode NOT_SUPPORTED) is measured."""

    class Mig(FakeNvml):
        def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:  # noqa: N802
            if self.mig_slice:
                raise self.NVMLError_NotSupported("Not Supported")
            return super().nvmlDeviceGetTotalEnergyConsumption(handle)

        def nvmlDeviceGetPowerUsage(self, handle: str) -> int:  # noqa: N802
            if self.mig_slice:
                raise self.NVMLError_NotSupported("Not Supported")
            return super().nvmlDeviceGetPowerUsage(handle)

    nvml = Mig()
    nvml.mig_slice, nvml.mig_mode = slice_, mode
    assert nvml_meter(torch.device("cuda", 3), nvml, uuid="GPU-1") == (
        f"energy: not measured here: GPU 3 is {what}; NVML measures no MIG slice's energy"
    )
    before_ampere = Mig()
    before_ampere.mig_mode = None
    assert isinstance(nvml_meter(torch.device("cuda", 3), before_ampere, uuid="GPU-1"), EnergyMeter)


# --------------------------------------------------------------------------- a powercap tree


def _zone(root: Path, name: str, label: str, energy_uj: int, range_uj: int = 10**9) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(f"{label}\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{range_uj}\n")
    return zone


def _set(zone: Path, energy_uj: int) -> None:
    """The zone's counter moved to `energy_uj`, atomically as the kernel's: a reader's thread
    polling it sees the old count or the new one, never a half-written file."""
    (zone / "energy_uj.tmp").write_text(f"{energy_uj}\n")
    os.replace(zone / "energy_uj.tmp", zone / "energy_uj")


def _unreadable(zone: Path) -> None:
    """Its counter as an unprivileged process finds it since CVE-2020-8694 (mode 0400, root's);
    as root, where modes do not stop a read, a counter that is not there."""
    counter = zone / "energy_uj"
    if os.geteuid() == 0:
        counter.unlink()
        counter.symlink_to(zone / "gone")
    else:
        counter.chmod(0)


def _powercap(root: Path) -> dict[str, Path]:
    return {
        "package-0": _zone(root, "intel-rapl:0", "package-0", 5_000_000),
        "core": _zone(root, "intel-rapl:0:0", "core", 1_000_000),  # inside package-0
        "package-1": _zone(root, "intel-rapl:1", "package-1", 990_000_000),  # about to wrap
        "psys": _zone(root, "intel-rapl:2", "psys", 7_000_000),  # holds the packages
        "locked": _zone(root, "intel-rapl:3", "package-3", 1_000),
        "mmio": _zone(root, "intel-rapl-mmio:0", "package-0", 0),  # package-0 through MMIO
    }


def test_rapl_reads_the_readable_packages_only(tmp_path: Path) -> None:
    zones = _powercap(tmp_path)
    _unreadable(zones["locked"])
    found = rapl_zones(tmp_path)
    assert [z.name for z in found] == ["intel-rapl:0", "intel-rapl:1"]


def test_rapl_counts_a_wrap_around(tmp_path: Path) -> None:
    zones = _powercap(tmp_path)
    _unreadable(zones["locked"])
    clock = Clock()
    meter = rapl_meter(tmp_path)
    assert isinstance(meter, EnergyMeter)
    meter._now = clock.now
    meter.start()
    _set(zones["package-0"], 35_000_000)  # +30 J
    _set(zones["package-1"], 20_000_000)  # wrapped: +10 J +20 J
    _set(zones["core"], 99_000_000)  # inside package-0: not added
    _set(zones["psys"], 99_000_000)  # the packages again: not added
    clock.s += 2
    meter.stop()
    reading = meter.reading()
    assert reading is not None and reading.source == RAPL
    assert reading.joules == pytest.approx(30 + 30)
    assert reading.mean_watts == pytest.approx(30)


def test_rapl_reader_by_hand(tmp_path: Path) -> None:
    zone = _zone(tmp_path, "intel-rapl:0", "package-0", 900, range_uj=1000)
    reader = RaplReader(zone)
    reader.start()
    _set(zone, 100)  # 900 -> 1000 (= 0) -> 100: 200 uJ
    assert reader.stop(1.0) == pytest.approx(200e-6)


def test_no_readable_counter_is_said_never_a_zero(tmp_path: Path) -> None:
    assert rapl_meter(tmp_path / "absent") == UNMEASURED
    zones = _powercap(tmp_path / "locked")
    for zone in zones.values():
        _unreadable(zone)
    assert rapl_meter(tmp_path / "locked") == UNMEASURED
    assert UNMEASURED == "energy: not measured here: no RAPL or NVML counter readable"


# --------------------------------------------------------------------------- figures, ranks


def test_the_figures_of_a_reading_by_hand() -> None:
    reading = Energy(joules=120.0, seconds=4.0, source=RAPL, counters=("h:intel-rapl:0",),
                     utilization=0.5)  # fmt: skip
    assert reading.metrics(samples=600, units=600, unit="samples") == {
        ENERGY_J: 120.0, MEAN_WATTS: 30.0, ENERGY_PER_SAMPLE: 0.2, DEVICE_UTILIZATION: 0.5,
    }  # fmt: skip
    tokens = reading.metrics(samples=60, units=12_000, unit="tokens")
    assert tokens[ENERGY_PER_SAMPLE] == 2.0
    assert tokens[joules_per("tokens")] == pytest.approx(0.01)
    assert joules_per("tokens") == "energy/joules_per_token"


def test_ranks_sum_their_cards_and_count_a_shared_package_once() -> None:
    def card(uuid: str, joules: float, util: float) -> Energy:
        return Energy(joules, 2.0, NVML_COUNTER, (uuid,), util)

    both = Energy.combine([card("GPU-a", 100, 0.9), card("GPU-b", 140, 0.7)])
    assert both.joules == 240 and both.utilization == pytest.approx(0.8)
    assert both.mean_watts == 120
    # Two ranks on one CPU package read the same counter over windows a little apart.
    shared = [Energy(52, 2.1, RAPL, ("h:intel-rapl:0",), 0.9),
              Energy(50, 2.0, RAPL, ("h:intel-rapl:0",), 0.8)]  # fmt: skip
    once = Energy.combine(shared)
    assert once.joules == 52 and once.seconds == 2.1
    assert Energy.combine(shared[::-1]).joules == 52
    # A rank that measured nothing: no sum that would read as the whole.
    assert Energy.combine([card("GPU-a", 100, 0.9), None]) is None


# --------------------------------------------------------------------------- on the clock


class Watts:
    """A reader of a constant power over the meter's windows."""

    source = RAPL
    key = "fake"
    update_s = 0.0  # a figure from any window

    def __init__(self, watts: float):
        self.watts = watts
        self.windows = 0

    def start(self) -> None:
        self.windows += 1

    def stop(self, seconds: float) -> float:
        return self.watts * seconds


def test_the_meter_reads_where_the_clock_reads_so_validation_is_out() -> None:
    clock = Clock()
    meter = EnergyMeter([Watts(50.0)], now=clock.now)
    throughput = ThroughputClock(CPU, first_timed_step=1, now=clock.now, meter=meter)
    for step in range(4):
        throughput.begin(step)
        clock.s += 0.25  # a step
        throughput.step(step, 8, 8, 0.0)
        if step == 1:
            throughput.pause()
            clock.s += 10  # a validation
            throughput.resume(step)
        if step == 2:
            throughput.interval(step)
    throughput.stop()
    reading = throughput.energy()
    assert throughput.seconds == pytest.approx(0.75)  # steps 1-3
    assert reading.seconds == pytest.approx(throughput.seconds)
    assert reading.joules == pytest.approx(50 * 0.75)
    assert throughput.energy_note == RAPL


def test_a_clock_without_a_meter_says_why() -> None:
    throughput = ThroughputClock(CPU, first_timed_step=0, meter=UNMEASURED)
    throughput.begin(0)
    throughput.stop()
    assert throughput.energy() is None and throughput.energy_note == UNMEASURED


def test_a_run_logs_its_energy_over_its_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on a 50 W device whose validations sleep 0.5 s each: its joules are the timed
    steps', not the validations' (which alone would be over 50 J)."""
    watts = Watts(50.0)
    busy = energy.ProcessBusy()
    monkeypatch.setattr(loop, "energy_meter", lambda device: EnergyMeter([watts], busy))
    real_evaluate = loop.evaluate

    def slow_evaluate(*args, **kwargs):  # noqa: ANN002, ANN003
        time.sleep(0.5)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    data = _splits()
    cfg = TrainerConfig(batch_size=16, max_steps=6, max_epochs=None, val_every_steps=2,
                        warmup_steps=0, device="cpu", noise_scale_window=0)  # fmt: skip
    result = _fit(_flat_linear(data), data, cfg)
    reading = result.energy
    assert reading is not None
    assert reading.joules == pytest.approx(50 * reading.seconds)
    assert reading.joules < 50 * 0.5  # one validation alone would be 25 J
    figures = result.metrics()
    assert figures[ENERGY_J] == reading.joules
    assert figures[ENERGY_PER_SAMPLE] == pytest.approx(reading.joules / result.timed_samples)
    assert figures[MEAN_WATTS] == pytest.approx(50)
    assert DEVICE_UTILIZATION in figures and figures[DEVICE_UTILIZATION] > 0
    assert result.energy_note == RAPL


def test_a_run_without_a_counter_has_no_energy_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "energy_meter", lambda device: UNMEASURED)
    data = _splits()
    cfg = TrainerConfig(batch_size=16, max_steps=4, max_epochs=None, device="cpu")
    result = _fit(_flat_linear(data), data, cfg)
    assert result.energy is None and result.energy_note == UNMEASURED
    assert not [k for k in result.metrics() if k.startswith(("energy/", "device/"))]


def test_the_device_picks_its_counter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHFIT_POWERCAP", str(tmp_path / "none"))
    assert energy_meter(CPU) == UNMEASURED
    _zone(tmp_path / "tree", "intel-rapl:0", "package-0", 0)
    monkeypatch.setenv("BATCHFIT_POWERCAP", str(tmp_path / "tree"))
    assert isinstance(energy_meter(CPU), EnergyMeter)
    assert energy.why_unmeasured(CPU) is None
    assert energy.why_unmeasured(torch.device("meta")) == (
        "energy: not measured here: no counter read on a meta device"
    )


def test_a_card_is_found_by_its_uuid_in_nvmls_spelling_never_by_a_guessed_index() -> None:
    """torch spells a UUID bare; NVML as GPU-... or, for a MIG instance, MIG-...: both are
    tried (a MIG instance is then refused). A UUID NVML knows under neither is not measured
    (CUDA's order of the cards need not be NVML's); the index serves only where torch gives
    no UUID."""

    class Cards(FakeNvml):
        def __init__(self, known: str) -> None:
            super().__init__()
            self.known, self.tried, self.indices = known, [], []

        def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802
            self.tried.append(uuid)
            if uuid != self.known:
                raise self.NVMLError_NotFound(self.NVML_ERROR_NOT_FOUND)
            return "handle"

        def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # noqa: N802
            self.indices.append(index)
            return "handle"

    mig = Cards("MIG-5d6c")
    mig.mig_slice = True  # found: a MIG slice, which NVML does not measure
    assert nvml_meter(torch.device("cuda", 1), mig, uuid="5d6c") == (
        "energy: not measured here: GPU 1 is a MIG slice; NVML measures no MIG slice's energy"
    )
    assert mig.tried == ["GPU-5d6c", "MIG-5d6c"] and mig.indices == []
    card = Cards("GPU-5d6c")
    assert isinstance(nvml_meter(torch.device("cuda", 1), card, uuid="5d6c"), EnergyMeter)
    elsewhere = Cards("GPU-other")
    assert nvml_meter(torch.device("cuda", 1), elsewhere, uuid="5d6c") == (
        "energy: not measured here: NVML: Not Found"
    )
    assert elsewhere.indices == []
    unnamed = Cards("GPU-other")
    assert isinstance(nvml_meter(torch.device("cuda", 1), unnamed, uuid=None), EnergyMeter)
    assert unnamed.indices == [1]


class Watched(RaplReader):
    """A RAPL reader whose thread's polls the test can wait for."""

    def __init__(self, zone: Path, poll_s: float):
        super().__init__(zone, poll_s)
        self.polls = 0
        self._polled = threading.Condition()

    def poll(self) -> None:
        super().poll()
        with self._polled:
            self.polls += 1
            self._polled.notify_all()

    def polled_since(self) -> None:
        """Returns once a poll begun after this call has ended: it read the counter as the
        test left it."""
        with self._polled:
            seen = self.polls
            assert self._polled.wait_for(lambda: self.polls >= seen + 2, timeout=10)


def test_a_thread_reads_rapl_through_wraps_the_training_loop_never_polls(tmp_path: Path) -> None:
    """A range of 1000 uJ, 2400 uJ spent in one window whose training loop never calls
    poll() (one long step): read only at its ends, the counter would show 400 (two wraps
    unseen); the reader's own thread reads it after each move, and each read sees one wrap."""
    zone = _zone(tmp_path, "intel-rapl:0", "package-0", 0, range_uj=1000)
    reader = Watched(zone, poll_s=0.005)
    meter = EnergyMeter([reader])
    meter.start()
    for value in (800, 600, 400):  # +800, +800 (wrapped), +800 (wrapped)
        _set(zone, value)
        reader.polled_since()
    meter.stop()
    assert meter.reading().joules == pytest.approx(2400e-6)


def _threads(meter: EnergyMeter) -> list[threading.Thread]:
    """The meter's RAPL readers' polling threads, as they run now."""
    threads = [reader._thread for reader in meter.readers]
    assert all(t is not None and t.daemon and t.is_alive() for t in threads)
    return threads


def test_no_rapl_thread_outlives_stop_a_failure_or_an_unstopped_meter(tmp_path: Path) -> None:
    """stop() joins each zone's thread; a zone that fails ends its thread, and the meter's
    failure the others'; a meter dropped without stop() (a run that raised) ends them
    within a poll."""
    zones = [_zone(tmp_path, f"intel-rapl:{n}", f"package-{n}", 0) for n in range(2)]
    meter = EnergyMeter([RaplReader(zone, poll_s=0.005) for zone in zones])
    meter.start()
    threads = _threads(meter)
    meter.stop()
    assert not any(t.is_alive() for t in threads)
    meter.start()
    threads = _threads(meter)
    (zones[0] / "energy_uj").unlink()  # the zone went away mid-window
    threads[0].join(timeout=10)  # its thread's poll failed: it ended
    assert not threads[0].is_alive() and threads[1].is_alive()
    meter.stop()
    assert meter.failed is not None and "FileNotFoundError" in meter.failed
    assert not any(t.is_alive() for t in threads) and meter.reading() is None
    _set(zones[0], 0)
    unstopped = EnergyMeter([RaplReader(zone, poll_s=0.005) for zone in zones])
    unstopped.start()
    threads = _threads(unstopped)
    del unstopped
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


def test_windows_too_short_for_the_counter_give_no_figure_and_say_why(tmp_path: Path) -> None:
    """Under MIN_UPDATES of the counter's updates (NVML's ~0.1 s: 1 s), a window's joules are
    a tick more or less, or none: no figure, and the reason, not 0 J; more windows that
    reach it give one. Past it, counters that never advanced give none either. RAPL, which
    updates every ~1 ms, gives a figure from 10 ms."""
    nvml, clock = FakeNvml(), Clock()
    meter = nvml_meter(CPU, nvml, clock.now_us, uuid="GPU-1")
    meter._now = clock.now
    meter.start()
    clock.s += 0.4  # a counter that updates every 100 ms: 4 updates, or none yet
    meter.stop()
    assert meter.reading() is None
    assert meter.failed == (
        "energy: not measured: the timed steps lasted 0.4 s, under the 1 s a counter needs "
        "(NVML energy counter: 10 updates of ~0.1 s); more timed steps (trainer.max_steps) "
        "give a figure"
    )
    meter.start()
    nvml.energy_mj += 150_000
    clock.s += 0.6
    meter.stop()
    assert meter.failed is None and meter.reading().joules == pytest.approx(150)

    zone = _zone(tmp_path, "intel-rapl:0", "package-0", 500)
    still = EnergyMeter([RaplReader(zone)], now=clock.now)
    still.start()
    clock.s += 0.005
    still.stop()
    assert still.reading() is None and "lasted 0.005 s, under the 0.01 s" in still.failed
    still.start()
    clock.s += 1.5
    still.stop()
    assert still.reading() is None
    assert still.failed == "energy: not measured: the counters did not advance in 1.5 s"
    still.start()
    _set(zone, 20_500)
    clock.s += 0.5
    still.stop()
    assert still.reading().joules == pytest.approx(0.02) and still.failed is None


def test_the_cpu_busy_share_stops_at_one() -> None:
    busy = energy.ProcessBusy(threads=lambda: 1)
    busy.start()
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # 50 ms of CPU
        pass
    assert busy.stop(0.001) == 1.0  # 50x the window's wall seconds: a share, at most 1
