"""How many intra-op threads torch uses in this process: the cores it may use, divided among
the worker processes that share them, and no more than other processes leave free.

torch starts one intra-op thread per core in every process. Several processes on one machine
then run more threads than cores, and each step waits for its slowest, descheduled thread.
Measured on a 2-core machine with torch 2.14, a ResNet-18 step of batch 64: 466-598 ms on 1
thread and 756-3406 ms on 2 while other engineers' torch processes ran; 961 ms on 1 and 1135
ms on 2 beside two `while True: pass` processes. So each worker takes its share: the cores
this process may use (`os.sched_getaffinity(0)`: a SLURM job's allocation, a `taskset`)
divided by the workers sharing them, and at most the cores that other processes left idle
over half a second at the start (/proc/stat; 1 at least). A wrong guess one way costs up to
2x (one thread on an idle 2-core machine), the other way 2.6-7x. `search.threads`
overrides it; both entry points apply it first and say so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batchfit.common.checks import ConfigError, is_integer, must_be

KEY = "search.threads"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; all of them where the platform
    has none, e.g. macOS)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


BUSY_SAMPLE_S = 0.5  # how long the start watches the other processes' use of the cores


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(all, idle) jiffies of each of `cpus` from /proc/stat."""
    times = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            times[int(name[3:])] = (sum(values), values[3] + values[4])  # idle + iowait
    return times


def busy_cores(seconds: float = BUSY_SAMPLE_S) -> float:
    """How many of this process's cores other processes kept busy over `seconds` (this one
    sleeps meanwhile); 0 where /proc/stat or affinity masks are not there."""
    try:
        cpus = os.sched_getaffinity(0)
        before = _cpu_times(cpus)
        time.sleep(seconds)
        after = _cpu_times(cpus)
    except (AttributeError, OSError, ValueError):
        return 0.0
    busy = 0.0
    for cpu, (total, idle) in after.items():
        spent = total - before.get(cpu, (total, idle))[0]
        if spent > 0:
            busy += 1 - (idle - before[cpu][1]) / spent
    return busy


@dataclass(frozen=True)
class Threads:
    num_threads: int
    num_cores: int  # the cores this process may use
    sharing: int  # worker processes sharing those cores
    setting: int | None  # search.threads as given (None: automatic)
    busy: float = 0.0  # of those cores, kept busy by other processes at the start

    def apply(self) -> None:
        torch.set_num_threads(self.num_threads)

    def describe(self) -> str:
        """The first line of output: how many threads, and why."""
        threads = _count(self.num_threads, "intra-op thread")
        cores = _count(self.num_cores, "core")
        if self.setting is not None:
            return f"torch: {threads} per worker ({KEY}={self.setting}; {cores} usable)"
        shared = f", shared by search.workers={self.sharing}" if self.sharing > 1 else ""
        if self.num_threads < self.num_cores // self.sharing:
            shared += f", {self.busy:.1f} busy with other processes"
        return (
            f"torch: {threads} per worker ({cores} usable by this process{shared}); "
            f"override with {KEY}=N"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def threads_problems(value: object) -> list[str]:
    if value is None or is_integer(value, 1):
        return []
    what = (
        "an integer >= 1 or null (the cores this process may use, divided by the workers "
        "sharing them)"
    )
    return [must_be(KEY, what, value, hint=f"e.g. {KEY}=1")]


def plan_threads(
    setting: int | None,
    sharing: int,
    num_cores: int | None = None,
    busy: float | None = None,
) -> Threads:
    """The threads of one worker of `sharing` on this process's cores (`num_cores`, of which
    other processes keep `busy` busy; both measured when not given), or `setting`."""
    problems = threads_problems(setting)
    if problems:
        raise ConfigError(problems)
    if setting is not None:
        return Threads(setting, num_cores or usable_cores(), max(1, sharing), setting)
    cores = num_cores if num_cores is not None else usable_cores()
    busy = busy if busy is not None else busy_cores()
    sharing = max(1, sharing)
    free = round(cores - busy)
    return Threads(max(1, min(cores // sharing, free)), cores, sharing, None, busy)
