"""What `python -m search --multirun` says once its workers are done, in the process that
launched them.

With Hydra's submitit launchers each worker is a job whose output goes to a file under the
sweep directory (`.submitit/<job id>/<job id>_<task>_log.out`), so the command that
launched them printed only its launch lines: the study's answer was in those files. After
the jobs, `SayAnswer` (a Hydra callback registered in conf/config.yaml) prints where each
worker's output is, the answer the study stored (search/study/decision.py: made once, by one
worker, for all) and the best.yaml files the workers wrote. Launchers whose workers print to
this console (joblib, the basic one) need none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from batchfit.common.overrides import BEST_FILE
from batchfit.common.redact import redact
from batchfit.search.study.decision import Decision


def _launcher(config: DictConfig) -> str:
    return str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")


def worker_logs(sweep_dir: Path) -> list[Path]:
    """Each submitit job's output file, in job order."""
    return sorted(sweep_dir.glob(".submitit/*/*_log.out"))


def study_name(config: DictConfig) -> str:
    from batchfit.search.study.driver import default_study_name  # the heavy import, only at the end

    name = OmegaConf.select(config, "search.study_name")
    choices = OmegaConf.to_container(config.hydra.runtime.choices) or {}
    return str(name) if name else default_study_name(dict(choices))


def answer_lines(config: DictConfig) -> list[str]:
    """Where the workers' outputs are, the study's stored answer, the best.yaml files."""
    sweep = Path(str(config.hydra.sweep.dir))
    lines = ["The workers' output (one file each):"]
    lines += [f"  {path}" for path in worker_logs(sweep)] or [f"  none found under {sweep}"]
    name = study_name(config)
    try:
        from batchfit.search.storage.opening import open_storage

        storage = open_storage(str(config.search.storage), None)
        decided = Decision.stored(optuna.load_study(study_name=name, storage=storage))
    except Exception as error:  # noqa: BLE001 - say what failed; the workers said the rest
        return [*lines, f"Study {name}: its answer could not be read ({type(error).__name__}: "
                f"{redact(str(error))}); it is at the end of each worker's output"]  # fmt: skip
    if decided is None or decided.best_yaml is None:
        return [*lines, f"Study {name}: no answer stored (no trial completed, or the workers "
                "stopped before the end): see their output"]  # fmt: skip
    header = decided.best_yaml.splitlines()[0].removeprefix("# ")
    lines.append(f"Study {name}, answered once by the worker on {decided.made_by}: {header}")
    written = sorted(sweep.glob(f"*/{BEST_FILE}"))
    lines += [f"  {BEST_FILE}: {path}" for path in written]
    if written:
        lines.append(f"Train it again: python -m train +best={written[0]}")
    return lines


class SayAnswer(Callback):
    """Hydra callback: after a multirun whose workers wrote to files, where they are and
    the study's answer."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if "submitit" not in _launcher(config):
            return
        print("\n".join(answer_lines(config)), flush=True)
