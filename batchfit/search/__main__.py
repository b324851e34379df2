"""Run a study: `python -m search +experiment=resnet data=digits`.

compose (Hydra) -> validate (every problem at once, before any trial) -> build (storage,
study, MLflow parent run) -> run (Optuna trials, each re-composing the config) -> report.

Several workers on one study: `python -m search --multirun search.workers=4 ...` (with
`hydra/launcher=submitit_slurm`, `submitit_local` or `joblib`); see docs/workers.md.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import warnings
from pathlib import Path

import hydra
import optuna
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console

from batchfit.common import interrupts
from batchfit.common.checks import ConfigError
from batchfit.common.console import config_error, crashed, stopped
from batchfit.common.overrides import CONF, composed, run_entry_point, unknown_top_level
from batchfit.common.redact import redact_logging
from batchfit.search.core.compose import task_overrides
from batchfit.search.storage.failures import storage_failure
from batchfit.search.study.driver import StudyDriver
from batchfit.search.study.tracking_state import TrackingIncomplete
from batchfit.tracking.mlflow_setup import http_defaults, quiet_logging
from batchfit.train.parallel.threads import plan_threads


class Terminated(KeyboardInterrupt):
    """SIGTERM (SLURM preemption, scancel, a time limit, `kill`): stopped like Ctrl-C."""


class HungUp(Terminated):
    """SIGHUP (the terminal closed, an ssh connection dropped): stopped like SIGTERM."""


STOPS = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated, signal.SIGHUP: HungUp}
EXIT_STATUS = {KeyboardInterrupt: 130, Terminated: 143, HungUp: 129}  # 128 + the signal


def stop_on_signals(errors: Console) -> None:
    """SIGINT, SIGTERM and SIGHUP stop the study the same way: the running trial ends, its
    MLflow run is KILLED and its parameters are queued to run again. The first signal
    interrupts; any later one is said and ignored, so that the records being closed are
    closed (within a few seconds) instead of a second traceback."""

    def first(signum: int, frame: object) -> None:
        for each in STOPS:
            signal.signal(each, later)
        kind = STOPS[signal.Signals(signum)]
        interrupts.request(kind)  # raised again at the next step if this one is swallowed
        if not interrupts.deferring():  # else raised when the write in progress has ended
            raise kind()

    def later(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):  # a terminal that hung up takes no more output
            errors.print(
                f"[yellow]{signal.Signals(signum).name}: already stopping; the records are "
                "being closed[/yellow]"
            )

    default_hook = sys.unraisablehook

    def unraisable(event: sys.UnraisableHookArgs) -> None:
        # The stop raised in a weakref callback or __del__, which Python cannot raise: it
        # is raised again at the next step (common/interrupts.py), not printed as an error.
        if event.exc_type is not None and issubclass(event.exc_type, KeyboardInterrupt):
            return
        default_hook(event)

    try:
        for each in STOPS:
            signal.signal(each, first)
        sys.unraisablehook = unraisable
    except ValueError:  # not the main thread (a launcher's worker thread): leave them be
        pass


def select_gpu(job_num: int) -> None:
    """One worker per GPU: job i of a multirun takes visible device i (modulo their number).
    Under SLURM or submitit_local each job sees only its own GPU, which is then device 0."""
    if torch.cuda.is_available():
        torch.cuda.set_device(job_num % torch.cuda.device_count())


@hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    composed()
    redact_logging()
    http_defaults()
    quiet_logging()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    console = Console()
    if not console.is_terminal:  # piped to a file or CI log: rich would assume 80 columns
        console = Console(width=160)
    errors = Console(stderr=True)
    stop_on_signals(errors)
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun:
        select_gpu(hydra_cfg.job.num)
    try:
        overrides = task_overrides(hydra_cfg)
        problems = unknown_top_level(cfg, overrides)
        if problems:
            raise ConfigError(problems)
        # First, before any torch work: each worker's share of the cores
        # (train/parallel/threads.py).
        # Local launchers (joblib, submitit_local) run search.workers processes at once on
        # these cores; Hydra's basic launcher runs them one after another, and a SLURM job
        # has cores of its own.
        launcher = str(hydra_cfg.launcher.get("_target_", ""))
        alone = any(name in launcher for name in ("BasicLauncher", "SlurmLauncher"))
        sharing = cfg.search.workers if multirun and not alone else 1
        threads = plan_threads(cfg.search.threads, sharing)
        threads.apply()
        console.print(threads.describe(), soft_wrap=True)
        driver = StudyDriver.prepare(
            cfg,
            overrides,
            dict(hydra_cfg.runtime.choices),
            console,
            multirun=multirun,
            output_dir=Path(hydra_cfg.runtime.output_dir),
        )
    except ConfigError as error:
        config_error(errors, error)
    except KeyboardInterrupt as interrupt:
        with contextlib.suppress(OSError):
            errors.print(
                "[yellow]Interrupted before the study started[/yellow]; nothing was trained"
            )
        sys.exit(EXIT_STATUS.get(type(interrupt), 130))
    except Exception as error:  # escaping, Hydra would print the overrides, passwords and all
        failure = storage_failure(error, cfg.search.storage)
        if failure is not None:  # a full disk, a database gone: nothing was trained
            stopped(errors, "Storage error", failure)
        what = f"{type(error).__name__} while preparing it (above); nothing was trained"
        crashed(errors, "The study did not start", what)
    try:
        result = driver.run()
        interrupts.check()  # a stop swallowed after the last step is still a stop
        return result
    except ConfigError as error:  # a trial met a config problem the checks could not see
        driver.parent.log.finish("FAILED")
        config_error(errors, error)
    except TrackingIncomplete as error:
        stopped(errors, "MLflow records incomplete", str(error))
    except KeyboardInterrupt as interrupt:
        interrupts.delivered()
        # (after SIGHUP the terminal may take no more output: the records are closed first)
        with contextlib.suppress(OSError):
            driver.interrupted(type(interrupt).__name__)
        sys.exit(EXIT_STATUS.get(type(interrupt), 130))
    except Exception as error:  # a bug or a store gone for good: its traceback may hold a password
        failure = storage_failure(error, cfg.search.storage)
        if failure is not None:  # a full disk, a database gone: the study resumes later
            driver.storage_failed()
            stopped(errors, "Storage error", failure)
        crashed(errors, "The study stopped", f"{type(error).__name__} while running it (above)")


if __name__ == "__main__":
    run_entry_point(main)
