"""torch's intra-op threads per worker: the cores this process may use over the workers that
share them, or search.threads; applied and said first by the entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from batchfit.common.checks import ConfigError
from batchfit.train.parallel.threads import busy_cores, plan_threads, usable_cores
from tests.sweeps import clean_env


@pytest.mark.parametrize(
    ("setting", "sharing", "cores", "busy", "expected"),
    [
        (None, 1, 2, 0.0, 2),  # one process: every core it may use
        (None, 2, 2, 0.0, 1),  # two workers on two cores: one each, not two each
        (None, 3, 8, 0.0, 2),
        (None, 4, 2, 0.0, 1),  # more workers than cores: at least one
        (None, 1, 2, 0.2, 2),  # a daemon's blip is not a busy core
        (None, 1, 2, 1.9, 1),  # two CPU-bound processes beside it: one thread, not two
        (None, 1, 8, 5.0, 3),  # the cores other processes leave free
        (None, 2, 2, 2.0, 1),  # at least one
        (3, 2, 2, 2.0, 3),  # search.threads wins
    ],
)
def test_threads_are_the_free_cores_over_the_workers_sharing_them(
    setting: int | None, sharing: int, cores: int, busy: float, expected: int
) -> None:
    assert plan_threads(setting, sharing, num_cores=cores, busy=busy).num_threads == expected


def test_the_first_line_says_why() -> None:
    assert plan_threads(None, 2, num_cores=4, busy=0.0).describe() == (
        "torch: 2 intra-op threads per worker (4 cores usable by this process, shared by "
        "search.workers=2); override with search.threads=N"
    )
    assert plan_threads(None, 1, num_cores=2, busy=1.9).describe() == (
        "torch: 1 intra-op thread per worker (2 cores usable by this process, 1.9 busy with "
        "other processes); override with search.threads=N"
    )
    assert plan_threads(2, 1, num_cores=1).describe() == (
        "torch: 2 intra-op threads per worker (search.threads=2; 1 core usable)"
    )


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_busy_cores_sees_a_cpu_bound_process_beside_it() -> None:
    # A CPU-bound child pinned to one of this process's cores keeps that core ~100% busy
    # (>= 0.7 of it allows for the scheduler and other processes' share); idle cores
    # can only add to it.
    core = min(os.sched_getaffinity(0))
    hog = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    try:
        time.sleep(0.3)
        assert busy_cores(0.5) >= 0.7
    finally:
        hog.kill()
        hog.wait()


def test_the_cores_are_this_processes_affinity() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity mask on this platform")
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("value", [0, -1, 1.5, "two", True])
def test_a_bad_threads_setting_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"search.threads must be an integer >= 1 or null.*"):
        plan_threads(value, 1)


def test_apply_sets_torchs_threads() -> None:
    before = torch.get_num_threads()
    try:
        plan_threads(1, 1).apply()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs affinity masks")
@pytest.mark.slow  # fresh Python processes: a minute on 2 busy cores
def test_python_m_train_says_its_threads_first(tmp_path) -> None:
    # Pinned to one core (as a SLURM job or `taskset -c 0` would be): one thread, said first.
    core = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [
            sys.executable, "-m", "train", "model=small_cnn", "model.width=4", "data=digits",
            "trainer.max_steps=2", "trainer.device=cpu", "mlflow.system_metrics=false",
        ],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first == (
        "torch: 1 intra-op thread (1 core usable by this process); override with "
        "search.threads=N, which python -m train reads too"
    )  # no workers: python -m train has none
