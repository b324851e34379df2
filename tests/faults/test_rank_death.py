"""Ranks die with their worker: SIGKILL of a real `python -m train` running a 2-rank gloo DDP
run on CPU (a child of tests/faults/forkserver.py), while its ranks still start (importing
torch: no code of ours has run in them yet but train/parallel/lifeline.py's) and while
they train. Every rank and multiprocessing's resource tracker must be gone within seconds,
none left running with parent 1."""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from pathlib import Path

import psutil
import pytest

from batchfit.train.parallel.lifeline import tied
from tests.faults import forkserver
from tests.sweeps import LONG_DDP, REPO, clean_env

# Calibration, on the 2-core CI machine at load 7: after the fix every rank and the tracker
# were gone 0.24-0.29 s after the SIGKILL; before it, ranks killed while importing lived on
# 49-60 s (until their imports ended and they looked for their parent). The issue asks for a
# second or two.
GONE_WITHIN_S = 2.0
START_TIMEOUT_S = 600  # the fork server's imports, under load, come first
ARGS = LONG_DDP


def _children(worker: int) -> dict[str, list[psutil.Process]]:
    """The worker's ranks (`multiprocessing.spawn`) and its resource tracker."""
    found: dict[str, list[psutil.Process]] = {"ranks": [], "tracker": []}
    try:
        children = psutil.Process(worker).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            line = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "resource_tracker" in line:
            found["tracker"].append(child)
        elif "spawn_main" in line:
            found["ranks"].append(child)
    return found


def _connected(rank: psutil.Process) -> bool:
    """Whether the rank reached its process group (TCP to the worker's store): past its
    start-up."""
    try:
        return any(c.status == psutil.CONN_ESTABLISHED for c in rank.net_connections("tcp"))
    except psutil.NoSuchProcess:
        return False


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["importing 0.3 s", "importing 1.5 s", "training"])
def test_every_rank_and_the_resource_tracker_die_with_a_killed_worker(
    tmp_path: Path, when: str
) -> None:
    worker = forkserver.start("train", ARGS, tmp_path, clean_env(PYTHONPATH=str(REPO)))
    started: list[psutil.Process] = []
    try:
        _wait_for(lambda: len(_children(worker.pid)["ranks"]) == 2, "2 ranks", START_TIMEOUT_S)
        if when == "training":
            ranks = _children(worker.pid)["ranks"]
            _wait_for(lambda: all(map(_connected, ranks)), "ranks connected", START_TIMEOUT_S)
            time.sleep(1.0)  # into the steps
        else:
            time.sleep(float(when.split()[1]))
        found = _children(worker.pid)
        started = found["ranks"] + found["tracker"]
        starting = [not _connected(rank) for rank in found["ranks"]]
        assert worker.poll() is None, "the run ended before the test killed it"
        assert len(found["tracker"]) == 1, found
        assert all(starting) if when != "training" else not any(starting), (when, starting)

        worker.kill()
        killed_at = time.monotonic()
        while any(map(_alive, started)) and time.monotonic() - killed_at < 60:
            time.sleep(0.02)
        gone_s = time.monotonic() - killed_at
        left = [p.pid for p in started if _alive(p)]
    finally:
        worker.kill()
        for process in started:  # only what this test started, by pid
            if _alive(process):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
        worker.communicate(timeout=60)  # its pipes close with the last rank
    print(f"{when}: every rank and the tracker gone {gone_s:.2f} s after the SIGKILL")
    assert not left, f"alive 60 s after the worker's SIGKILL: {left}"
    assert gone_s < GONE_WITHIN_S, f"ranks and tracker lived {gone_s:.2f} s after the worker"


def _lifeline_loaded(pid: int) -> bool:
    """Whether the child imported train/parallel/lifeline.py (ctypes' library mapped: nothing
    else a spawned `time.sleep` child loads imports ctypes)."""
    try:
        return "_ctypes" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux: PR_SET_PDEATHSIG")
def test_a_child_spawned_by_the_tied_thread_dies_with_that_thread() -> None:
    """The kernel's death signal follows the thread that spawned the child (the launcher's
    thread, which outlives its ranks): a `time.sleep(60)` child, which runs nothing of
    batchfit's but the lifeline it unpickles, is killed as the tied thread ends, while this
    process lives on."""
    children: list[multiprocessing.Process] = []

    def spawning() -> None:
        with tied():
            child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
            child.start()
            children.append(child)
            _wait_for(lambda: _lifeline_loaded(child.pid), "the lifeline unpickled", 120)
            time.sleep(0.5)  # from the import to the prctl call: microseconds

    thread = threading.Thread(target=spawning)
    thread.start()
    thread.join()
    child = children[0]
    try:
        child.join(GONE_WITHIN_S)
        assert child.exitcode == -9, f"alive {GONE_WITHIN_S} s after its thread ended"
    finally:
        if child.is_alive():
            child.kill()
            child.join()
