"""The speed check: before a study recommends by throughput, it times its candidate
configurations side by side.

Each trial measured its throughput while it trained, at whatever moment the machine gave
it; on a shared machine two identical configurations measured minutes apart differ by half,
and "the fastest within 1% of the best accuracy" would pick whichever ran while the
machine was quiet. Throughput belongs to a configuration's geometry (batch size,
accumulation, precision, sequence length, checkpointing: every searched key but the
optimizer's and the schedule's numbers), not to its learning rate. So at the end of the
search the geometries of the candidates (the completed trials within the recommendation's
tolerance, the fastest MAX_GEOMETRIES of them) are timed in turn, round after round
(train/launch/speed_probe.py), and the recommendation prefers a faster geometry only when it is
faster in every round than the other in its best one (search/results/recommend.py).

The result is kept in the study (user attr `speed_check`), so a resumed study or another
worker reuses it while the candidates are the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from omegaconf import DictConfig
from optuna.trial import FrozenTrial

from batchfit.search.core.record import TrialRecord
from batchfit.tracking.metrics import THROUGHPUT_SAMPLES, THROUGHPUT_TOKENS
from batchfit.train.config import RunSpec
from batchfit.train.launch.speed_probe import ROUNDS, Speed, measure
from batchfit.train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    CHECKPOINTING_KEY,
    DEVICES_KEY,
    PRECISION_KEY,
    STRATEGY_KEY,
)
from batchfit.train.workload import Workloads

SPEED_ATTR = "speed_check"
MAX_GEOMETRIES = 4  # candidates timed side by side: a few seconds each, ROUNDS times
# Searched keys under these whose values are numbers do not change a step's speed.
SPEED_NEUTRAL = ("optimizer.", "scheduler.")
GEOMETRY_KEYS = (BATCH_KEY, ACCUM_KEY, PRECISION_KEY, CHECKPOINTING_KEY, STRATEGY_KEY, DEVICES_KEY)
THROUGHPUT_UNITS = {THROUGHPUT_SAMPLES: "samples", THROUGHPUT_TOKENS: "tokens"}

Geometry = tuple[tuple[str, Any], ...]


def geometry(trial: FrozenTrial) -> Geometry:
    """What a trial's speed depends on: its batch geometry and precision as it trained
    (derived accumulation included) and every other searched key that is not a number of
    the optimizer or the schedule."""
    run = TrialRecord.of(trial).run
    values = {key: run.get(key) for key in GEOMETRY_KEYS}
    for key, value in trial.params.items():
        neutral = key.startswith(SPEED_NEUTRAL) and isinstance(value, int | float)
        if key not in values and not neutral and key != "trainer.effective_batch_size":
            values[key] = value
    return tuple(values.items())


def label(geom: Geometry) -> str:
    """'64x2 fp32', then the other keys: '64x2 bf16 seq_len=128 checkpointing=blocks'."""
    values = dict(geom)
    text = f"{values.pop(BATCH_KEY)}x{values.pop(ACCUM_KEY)} {values.pop(PRECISION_KEY)}"
    checkpointing = values.pop(CHECKPOINTING_KEY, "none")
    strategy, devices = values.pop(STRATEGY_KEY, "none"), values.pop(DEVICES_KEY, 1)
    if strategy not in (None, "none"):
        text += f" {strategy}x{devices}"
    rest = [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in values.items()]
    if checkpointing not in (None, "none"):
        rest.append(f"checkpointing={checkpointing}")
    return " ".join([text, *rest])


def stored(study: optuna.Study) -> dict[str, Speed]:
    """The study's last speed check: geometry label -> its speed."""
    found = study.user_attrs.get(SPEED_ATTR) or {}
    return {
        name: Speed(tuple(s["samples_per_sec"]), tuple(s["units_per_sec"]), s["unit"])
        for name, s in found.get("geometries", {}).items()
    }


def to_check(candidates: Sequence[tuple[FrozenTrial, float]]) -> list[FrozenTrial]:
    """One trial per geometry (its first), the fastest MAX_GEOMETRIES geometries by the
    trials' own throughput (`candidates`: trial, its throughput). Data-parallel trials are
    not timed again: this times one process on one device (they keep their own figures)."""
    first: dict[Geometry, tuple[FrozenTrial, float]] = {}
    for trial, rate in candidates:
        if TrialRecord.of(trial).run.get(STRATEGY_KEY, "none") != "none":
            continue
        geom = geometry(trial)
        if geom not in first or rate > first[geom][1]:
            first[geom] = (trial, rate)
    ranked = sorted(first.values(), key=lambda pair: -pair[1])
    return [trial for trial, _ in ranked[:MAX_GEOMETRIES]]


def check(
    study: optuna.Study,
    trials: Sequence[FrozenTrial],
    configure: Callable[[FrozenTrial], tuple[DictConfig, RunSpec]],
    say: Callable[[str], None],
    workloads: Workloads | None = None,
) -> dict[str, Speed]:
    """Time the geometries of `trials` side by side, unless the study's last check timed
    exactly these; keep the result in the study and say it. With one, say it is skipped."""
    names = [label(geometry(t)) for t in trials]
    known = stored(study)
    if len(names) == 1:  # the docs promise a check: why there is none
        say(
            f"Speed check skipped: one candidate configuration, {names[0]} (the completed "
            "trials within search.recommend's tolerance of the best, one per configuration): "
            "nothing to time it against, so the recommendation goes by the trials' own "
            "throughput"
        )
    if len(names) < 2 or set(names) == set(known):
        return known
    say(
        f"Speed check: timing {len(names)} candidate configurations side by side, "
        f"{ROUNDS} rounds each (the recommendation compares them by this, not by when "
        "each trial happened to run)"
    )
    started = time.perf_counter()
    runs = [configure(t) for t in trials]
    speeds = dict(zip(names, measure(runs, workloads=workloads), strict=True))
    study.set_user_attr(
        SPEED_ATTR,
        {
            "seconds": round(time.perf_counter() - started, 1),
            "geometries": {
                name: {
                    "samples_per_sec": list(s.samples_per_sec),
                    "units_per_sec": list(s.units_per_sec),
                    "unit": s.unit,
                }
                for name, s in speeds.items()
            },
        },
    )
    return speeds  # the summary's table shows them (once)


def describe(speed: Speed, unit: str) -> str:
    """'412 samples/s (398-420 over 3 rounds, spread 5%)'."""
    rates = speed.rates(unit)
    return (
        f"{speed.median(unit):.0f} {unit}/s ({min(rates):.0f}-{max(rates):.0f} over "
        f"{len(rates)} rounds, spread {speed.spread(unit):.0%})"
    )


def unit_of(metric: str) -> str | None:
    """The unit a throughput metric counts, None for any other metric."""
    return THROUGHPUT_UNITS.get(metric)
