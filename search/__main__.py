"""Run a study: `python -m search +experiment=resnet data=digits`.

compose (Hydra) -> validate (every problem at once, before any trial) -> build (storage,
study, MLflow parent run) -> run (Optuna trials, each re-composing the config) -> report.

Several workers on one study: `python -m search --multirun search.workers=4 ...` (with
`hydra/launcher=submitit_slurm`, `submitit_local` or `joblib`); see the README.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

import hydra
import optuna
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape  # messages carry [...]: not markup

from search.compose import task_overrides
from search.driver import StudyDriver, TrackingIncomplete
from tracking.redact import redact, redact_logging
from tracking.runs import http_defaults, quiet_logging
from train.config import ConfigError


def select_gpu(job_num: int) -> None:
    """One worker per GPU: job i of a multirun takes visible device i (modulo their number).
    Under SLURM or submitit_local each job sees only its own GPU, which is then device 0."""
    if torch.cuda.is_available():
        torch.cuda.set_device(job_num % torch.cuda.device_count())


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    redact_logging()
    http_defaults()
    quiet_logging()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    console = Console()
    if not console.is_terminal:  # piped to a file or CI log: rich would assume 80 columns
        console = Console(width=160)
    errors = Console(stderr=True)
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun:
        select_gpu(hydra_cfg.job.num)
    try:
        driver = StudyDriver.prepare(
            cfg,
            task_overrides(hydra_cfg),
            dict(hydra_cfg.runtime.choices),
            console,
            multirun=multirun,
            output_dir=Path(hydra_cfg.runtime.output_dir),
        )
    except ConfigError as error:
        errors.print(
            f"[bold red]Configuration error[/bold red]\n{escape(redact(str(error)))}",
            soft_wrap=True,  # one problem per line, whole, in logs too
        )
        sys.exit(2)
    try:
        return driver.run()
    except ConfigError as error:  # a trial met a config problem the checks could not see
        driver.parent.log.finish("FAILED")
        errors.print(
            f"[bold red]Configuration error[/bold red]\n{escape(redact(str(error)))}",
            soft_wrap=True,  # one problem per line, whole, in logs too
        )
        sys.exit(2)
    except TrackingIncomplete as error:
        errors.print(f"[bold red]MLflow records incomplete[/bold red]\n{escape(str(error))}")
        sys.exit(1)
    except KeyboardInterrupt:
        driver.interrupted()
        sys.exit(130)
    except Exception:  # a bug or a store gone for good: its traceback may carry a password
        errors.print(redact(traceback.format_exc()), markup=False, highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
