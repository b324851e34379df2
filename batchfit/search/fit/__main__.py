"""`python -m search.fit`: the study's checks, then the fit reports of its space, and what would
fit when nothing does.
"""

from __future__ import annotations

from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape  # messages carry [...]: not markup

from batchfit.common.checks import ConfigError
from batchfit.common.console import config_error, crashed, stopped
from batchfit.common.overrides import CONF, composed, run_entry_point, unknown_top_level
from batchfit.common.redact import redact_logging
from batchfit.search.core.compose import task_overrides
from batchfit.search.fit.advice import what_would_fit
from batchfit.search.fit.layouts import COMMAND, NOTHING_FITS, nothing_fits, show_fit_reports
from batchfit.search.sampling.levers import with_default_space
from batchfit.train.build import unimportable_targets
from batchfit.train.memory.predict import PredictionUnsupported
from batchfit.train.plan import with_gpu_budget
from batchfit.train.run import OverBudget
from batchfit.train.workload import Workloads

UNSUPPORTED_STATUS = 3  # the model does not run on fake tensors: nothing to report


@hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from batchfit.search.study.validate import (
        validate,  # the study's own checks, storage left alone
    )

    composed()
    redact_logging()
    console, errors = Console(), Console(stderr=True)
    if not console.is_terminal:
        console = Console(width=160)
    hydra_cfg = HydraConfig.get()
    name = cfg.search.study_name or "fit-report"  # checked, not used: nothing is recorded
    given = task_overrides(hydra_cfg)  # the command line, which the advice's commands extend
    workloads = Workloads()  # one data set and predictor for the checks and the report
    try:
        problems = unknown_top_level(cfg, given) or unimportable_targets(cfg)
        if problems:
            raise ConfigError(problems)
        base = with_gpu_budget(cfg, given)  # search.gpu=CARD: the card's budget

        def compose(trial_overrides: list[str]) -> DictConfig:
            return hydra.compose(config_name="config", overrides=base + trial_overrides)

        space_note = with_default_space(cfg, workloads)
        if space_note:
            console.print(f"[yellow]note[/yellow] {escape(space_note)}", soft_wrap=True)
        checked = validate(cfg, name, compose, open_store=False, workloads=workloads)
    except OverBudget as error:  # no batch helps: what would, predicted
        errors.print(NOTHING_FITS, soft_wrap=True, highlight=False)
        advice = what_would_fit(cfg, given, COMMAND, workloads, error.needed_bytes)
        config_error(errors, ConfigError([*error.problems, "\n".join(advice)]))
    except ConfigError as error:
        config_error(errors, error)
    except PredictionUnsupported as error:
        unpredictable(errors, error)
    except Exception as error:  # escaping, Hydra would print the overrides, passwords and all
        crashed(errors, "The fit report failed", f"{type(error).__name__} (above)")
    for note in checked.notes:
        console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
    try:
        reports = show_fit_reports(
            console, cfg, checked.space, checked.spec, checked.settings, workloads, beside=True
        )
        if nothing_fits(reports):
            console.print(NOTHING_FITS, soft_wrap=True, highlight=False)
            for line in what_would_fit(cfg, given, COMMAND, workloads):
                console.print(line, soft_wrap=True, markup=False, highlight=False)
    except ConfigError as error:
        config_error(errors, error)
    except PredictionUnsupported as error:
        unpredictable(errors, error)
    except Exception as error:  # escaping, Hydra would print the overrides, passwords and all
        crashed(errors, "The fit report failed", f"{type(error).__name__} (above)")


def unpredictable(errors: Console, error: PredictionUnsupported) -> NoReturn:
    stopped(
        errors,
        "Memory cannot be predicted for this model",
        f"{error.because()}. A study still runs: its trials measure their memory.",
        UNSUPPORTED_STATUS,
    )


if __name__ == "__main__":
    run_entry_point(main)
