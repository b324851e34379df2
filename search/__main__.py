"""Run a study: `python -m search +experiment=resnet data=digits`.

compose (Hydra) -> validate (every problem at once, before any trial) -> build (storage,
study, MLflow parent run) -> run (Optuna trials, each re-composing the config) -> report.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console

from search.driver import StudyDriver
from train.config import ConfigError


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    console = Console()
    if not console.is_terminal:  # piped to a file or CI log: rich would assume 80 columns
        console = Console(width=160)
    hydra_cfg = HydraConfig.get()
    try:
        driver = StudyDriver.prepare(
            cfg, list(hydra_cfg.overrides.task), dict(hydra_cfg.runtime.choices), console
        )
    except ConfigError as error:
        Console(stderr=True).print(f"[bold red]Configuration error[/bold red]\n{error}")
        sys.exit(2)
    try:
        return driver.run()
    except ConfigError as error:  # a trial met a config problem the checks could not see
        driver.parent.log.finish("FAILED")
        Console(stderr=True).print(f"[bold red]Configuration error[/bold red]\n{error}")
        sys.exit(2)
    except KeyboardInterrupt:
        driver.interrupted()
        sys.exit(130)


if __name__ == "__main__":
    main()
