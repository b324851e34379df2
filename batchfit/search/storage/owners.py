"""Who runs a trial: its owner (host, boot, process namespace, process start, SLURM job), recorded
on the trial, and whether that owner is provably gone or alive.

A worker on the same host can prove a trial's owner gone (its process is dead) and fails its trial
at once (search/storage/heartbeat.py `fail_orphaned_trials`): a study killed and started again
re-runs the killed trial right away, with or without heartbeats. `running_elsewhere` says which
trials of other workers the worker that ends a study waits for.
"""

from __future__ import annotations

import os
import socket
from functools import cache
from pathlib import Path
from typing import Any

# optuna.storages._heartbeat and optuna.storages.journal._file are private (no public name);
# what this module relies on (the heartbeat base class, for which Optuna beats and fails stale
# trials; the journal lock's base class and context) is pinned by tests/test_private_apis.py.
import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import FrozenTrial, TrialState

OWNER_ATTR = "batchfit:owner"  # system attr of a running trial: who runs it


@cache
def this_owner() -> dict[str, Any]:
    """This process, as another process can recognise it: host, kernel boot, pid, and the
    pid's start time (a pid is reused; its start time is not). SLURM's job id when there."""
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid_namespace": _pid_namespace(),  # containers with one hostname and boot differ here
        "pid": os.getpid(),
        "started": _process_start(os.getpid()),
        "slurm_job": _slurm_job(),
    }


def _slurm_job() -> str | None:
    """The SLURM job, as sacct and scancel name it: <array>_<task> for a job array (Hydra's
    submitit launcher submits one), whose first task's SLURM_JOB_ID is the whole array's."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """Clock ticks after boot at which `pid` started (Linux); None if it is not running or
    is a zombie (dead, not yet reaped by its parent). Not psutil's create_time(): that adds
    /proc/stat's btime, which Linux recomputes from the wall clock at each read, so two
    processes (or one, across an NTP step) can see one process start at two times
    (psutil #2526), and a live owner would be taken for gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
    return None if fields[0] == "Z" else int(fields[19])


def _on_this_host(owner: dict[str, Any] | None) -> bool:
    """Whether `owner` is a process this one can see: same host, boot and pid namespace."""
    me = this_owner()
    if not owner or owner.get("boot") is None or owner.get("boot") != me["boot"]:
        return False
    return owner.get("host") == me["host"] and owner.get("pid_namespace") == me["pid_namespace"]


def owner_is_gone(owner: dict[str, Any] | None) -> bool:
    """True only when provably gone: same host and boot as us, and its process is no more
    (or the pid now belongs to a younger process). Another host's worker is never provably
    gone; its heartbeat's grace period decides."""
    if not owner or not _on_this_host(owner):
        return False
    return _process_start(int(owner["pid"])) != owner.get("started")


def owner_is_alive(owner: dict[str, Any] | None) -> bool:
    """True only when provably alive: on this host, and its process is still the one that
    recorded itself."""
    if not owner or not _on_this_host(owner):
        return False
    return _process_start(int(owner["pid"])) == owner.get("started")


def record_owner(study: optuna.Study, trial_id: int) -> None:
    """Say who runs this trial (heartbeats do it on their first beat)."""
    study._storage.set_trial_system_attr(trial_id, OWNER_ATTR, this_owner())


def running_elsewhere(study: optuna.Study, storage: BaseStorage) -> list[FrozenTrial]:
    """The study's running trials that their workers may still finish: with heartbeats,
    those the heartbeat check would not fail (silent past the grace period, or an owner
    provably gone); without, those whose owner is provably alive (its process on this host).
    Without heartbeats a worker on another host that died is never noticed, so its trials
    are not waited for (search.heartbeat_interval_s says the same)."""
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if isinstance(storage, BaseHeartbeat) and storage.get_heartbeat_interval():
        study_id = storage.get_study_id_from_name(study.study_name)
        stale = set(storage._get_stale_trial_ids(study_id))
        return [t for t in running if t._trial_id not in stale]
    return [t for t in running if owner_is_alive(t.system_attrs.get(OWNER_ATTR))]
