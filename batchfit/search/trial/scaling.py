"""Scaling efficiency of a data-parallel trial: its throughput (all ranks') over its number
of devices times the throughput of the same per-device configuration on one device, when
the study has trained that one. 1.0 is perfect scaling; communication, and on a shared
machine the ranks' competition for its cores, make it less."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from batchfit.search.core.record import TrialRecord
from batchfit.search.results.speed_check import GEOMETRY_KEYS
from batchfit.train.params import DEVICES_KEY, STRATEGY_KEY

# Keys that say how a configuration is spread, not what each device runs
LAYOUT_KEYS = (STRATEGY_KEY, DEVICES_KEY)
# Keys that do not change a step's speed
NEUTRAL_PREFIXES = ("optimizer.", "scheduler.", "trainer.fsdp.")


def per_device(params: Mapping[str, Any]) -> dict[str, Any]:
    """What each device runs: the searched values less the layout and the numbers of the
    optimizer and schedule."""
    return {
        key: value
        for key, value in params.items()
        if key not in LAYOUT_KEYS and not key.startswith(NEUTRAL_PREFIXES)
    }


def scaling_efficiency(
    records: Iterable[TrialRecord],
    params: Mapping[str, Any],
    run: Mapping[str, Any],
    throughput: float,
) -> float | None:
    """`throughput` (the trial's, of `run`'s devices) against the best completed one-device
    trial with the same per-device values; None for a one-device trial or without one."""
    devices = int(run.get(DEVICES_KEY) or 1)
    if devices <= 1 or not throughput:
        return None
    mine = per_device({**params, **_geometry(run)})
    rates = [
        r.outcome.throughput
        for r in records
        if r.state == "COMPLETE"
        and r.outcome.throughput
        and int(r.run.get(DEVICES_KEY) or 1) == 1
        and per_device({**r.params, **_geometry(r.run)}) == mine
    ]
    return throughput / (devices * max(rates)) if rates else None


def _geometry(run: Mapping[str, Any]) -> dict[str, Any]:
    return {key: run.get(key) for key in GEOMETRY_KEYS}
