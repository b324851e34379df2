"""A study from Python: `batchfit.study([...overrides])` runs what `python -m search ...`
runs, in this process, and returns its recommendation as an object.

    result = batchfit.study(["+experiment=resnet", "data=digits", "search.n_trials=4"])
    rec = result.recommendation
    print(rec.batch_size, rec.accum_steps, rec.precision, rec.lr)
    print(rec.command)        # python -m train ... : the configuration trained again

The overrides are the command line's, composed by Hydra from batchfit's configs; the study
writes the same Optuna storage and MLflow records, and prints the same lines (to `console`).
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.common.overrides import CONF, unknown_top_level
from batchfit.search.core.record import TrialRecord
from batchfit.search.results.rates import planned_lr
from batchfit.search.results.recommend import Recommendation as Decided
from batchfit.search.results.recommend import metric_value
from batchfit.search.study.driver import StudyDriver
from batchfit.train.params import ACCUM_KEY, BATCH_KEY, PRECISION_KEY


@dataclass(frozen=True)
class Recommendation:
    """The configuration a study recommends, and how to train it again.

    `configuration` holds every searched key's value (`trainer.batch_size`,
    `trainer.precision`, `optimizer.lr`, ...); `figures` the recommended trial's metrics
    (`val/loss`, `throughput/samples_per_sec`, ...); `why` the study's own sentence."""

    trial: int  # the Optuna trial that trained it (or whose learning rate it takes)
    configuration: dict[str, Any]
    figures: dict[str, float]
    why: str
    lr: float | None  # the learning rate at this configuration's global batch (scaled)
    overrides: list[str]  # what trains it again: `python -m train` + these
    best_yaml: Path | None  # the study's best.yaml: `python -m train +best=PATH`

    @property
    def batch_size(self) -> int | None:
        value = self.configuration.get(BATCH_KEY)
        return None if value is None else int(value)

    @property
    def accum_steps(self) -> int | None:
        value = self.configuration.get(ACCUM_KEY)
        return None if value is None else int(value)

    @property
    def precision(self) -> str | None:
        value = self.configuration.get(PRECISION_KEY)
        return None if value is None else str(value)

    @property
    def command(self) -> str:
        """The shell command that trains it again."""
        return shlex.join(["python", "-m", "train", *self.overrides])


@dataclass(frozen=True)
class StudyResult:
    """A study's end: its recommendation (None when no trial reached an answer), the study
    (Optuna's, every trial in it) and its name."""

    study_name: str
    recommendation: Recommendation | None
    study: optuna.Study = field(repr=False)


def study(
    overrides: Sequence[str] = (),
    *,
    console: Console | None = None,
    output_dir: str | Path | None = None,
) -> StudyResult:
    """Run a study, as `python -m search OVERRIDES` does, in this process.

    Args:
        overrides: Hydra overrides, as on the command line
            (`["+experiment=resnet", "data=digits", "search.n_trials=4"]`).
        console: where the study prints its lines (default: the terminal).
        output_dir: where best.yaml and the fit report go (default: a new folder under
            mlruns/hydra/, as the command's).

    Returns:
        The StudyResult, its `recommendation` an object: configuration, learning rate,
        figures, the command that trains it again.

    Raises:
        ConfigError: a problem in the composed config (a ValueError naming each key and the
            fix), raised before any trial starts.
    """
    overrides = list(overrides)
    console = console or Console()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="study"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        choices = dict(cfg.hydra.runtime.choices)
        folder = Path(output_dir or cfg.hydra.run.dir)
        cfg = _without_hydra(cfg)
        problems = unknown_top_level(cfg, overrides)
        if problems:
            raise ConfigError(problems)
        driver = StudyDriver.prepare(cfg, overrides, choices, console, output_dir=folder)
        try:
            driver.run()
        except KeyboardInterrupt:
            with contextlib.suppress(OSError):
                driver.interrupted()
            raise
    decided = driver.recommendation
    rec = None
    if decided is not None:
        rec = _recommendation(decided, driver.rerun_overrides or [], driver.results.best_path)
    return StudyResult(driver.study.study_name, rec, driver.study)


def _without_hydra(cfg: DictConfig) -> DictConfig:
    """The composed config as a trial sees it: Hydra's own section left out."""
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _recommendation(decided: Decided, overrides: list[str], best: Path | None) -> Recommendation:
    trial = decided.trial
    record = TrialRecord.of(trial)  # what it trained with, searched or not
    geometry = {BATCH_KEY: record.batch_size, ACCUM_KEY: record.accum_steps,
                PRECISION_KEY: record.precision}  # fmt: skip
    configuration = {**{k: v for k, v in geometry.items() if v is not None}, **trial.params}
    cell = decided.untrained  # a fit report cell no trial trained: its own geometry
    if cell is not None:
        configuration.update(dict(cell.sets))
    figures = {
        name: value
        for name in decided.rule.known
        if (value := metric_value(trial, name)) is not None
    }
    lr = planned_lr(trial, cell.batch if cell is not None else None)
    on_disk = best if best is not None and best.is_file() else None
    return Recommendation(
        trial.number, configuration, figures, decided.describe(), lr, list(overrides), on_disk
    )


__all__ = ["Recommendation", "StudyResult", "study"]
