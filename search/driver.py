"""The study driver: everything between a composed config and a finished study."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable, Sequence

import hydra
import optuna
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from search import fit, report
from search.objective import Objective, TrialFailed
from search.sampler import FeasibilityFilter
from search.study import StopWhenFinished, flatten, num_finished, open_study
from search.tracking import ROLE_TAG, RunLog, StudyRun, Tracker
from search.validate import Checked, validate
from train.predict import PredictionUnsupported

PARENT_ATTR = "mlflow_parent_run_id"
# Study settings that may change between runs of one study without making it another study.
_RESUMABLE_KEYS = (
    "n_trials", "params", "sampler", "pruner", "trial_time_budget_s", "heartbeat_interval_s",
    "storage", "study_name", "preflight", "preflight_margin", "oom_constraint",
)  # fmt: skip


def default_study_name(choices: dict[str, str]) -> str:
    experiment = choices.get("experiment") or f"batchfit-{choices.get('model', 'model')}"
    return f"{experiment}-{choices.get('data', 'data')}"


def fixed_config(cfg: DictConfig, searched: Sequence[str]) -> str:
    """The config a study's trials share (searched keys and resumable settings removed)."""
    fixed = OmegaConf.to_container(cfg, resolve=True)
    fixed.pop("mlflow", None)
    # Settings added after a study may have begun count only when set to something else, so
    # that such a study still resumes.
    if fixed["search"].get("accumulation") == "searched":
        fixed["search"].pop("accumulation")
    if fixed.get("trainer", {}).get("effective_batch_size", 0) is None:
        fixed["trainer"].pop("effective_batch_size")
    for key in _RESUMABLE_KEYS:
        fixed["search"].pop(key, None)
    for key in searched:
        node = fixed
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.get(part, {})
        if isinstance(node, dict):
            node.pop(leaf, None)
    return OmegaConf.to_yaml(OmegaConf.create(fixed), sort_keys=True)


def _sampler(cfg: DictConfig, oom_constraint: bool) -> optuna.samplers.BaseSampler:
    sampler = instantiate(cfg.search.sampler)
    # Memory-infeasible trials (constraint `memory` > 0) keep the sampler off their region.
    return FeasibilityFilter(sampler) if oom_constraint else sampler


def _log_fit_report(cfg: DictConfig, checked: Checked, parent: RunLog, console: Console) -> None:
    """Predict the space's (precision, batch size) grid, show it and log it to the parent run;
    the trials' own predictions then come from the same cache."""
    try:
        report = fit.fit_report(cfg, checked.space, checked.spec, checked.settings)
    except PredictionUnsupported:
        return  # said by the first trial, which measures instead
    table = fit.render(report)
    console.print(table)
    recorder = Console(record=True, width=120, file=io.StringIO())
    recorder.print(table)
    parent.text(recorder.export_text(), "fit_report.txt")
    parent.table(report.rows(), "fit_report.json")


class StudyDriver:
    def __init__(
        self,
        checked: Checked,
        compose: Callable[[list[str]], DictConfig],
        base_overrides: list[str],
        study: optuna.Study,
        tracker: Tracker,
        parent: StudyRun,
        console: Console,
    ):
        self.checked = checked
        self.compose = compose  # the command line's overrides + a trial's, composed by Hydra
        self.base_overrides = base_overrides
        self.study = study
        self.tracker = tracker
        self.parent = parent
        self.console = console

    @classmethod
    def prepare(
        cls, cfg: DictConfig, overrides: list[str], choices: dict[str, str], console: Console
    ) -> StudyDriver:
        name = cfg.search.study_name or default_study_name(choices)
        searched = (
            OmegaConf.to_container(cfg.search.params, resolve=True) if cfg.search.params else {}
        )
        # A trial's overrides replace the command line's for the same key.
        base = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in searched]

        def compose(trial_overrides: list[str]) -> DictConfig:
            return hydra.compose(config_name="config", overrides=base + trial_overrides)

        checked = validate(cfg, name, compose)
        for note in checked.notes:
            console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
        settings = checked.settings
        # What every trial shares: the config with the space's fixed values applied, less the
        # searched keys. A resume must find the same, or it would mix incomparable trials.
        fixed = fixed_config(compose(checked.space.overrides({})), list(searched))
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own lines report each trial
        study = open_study(
            name,
            checked.storage,
            settings.directions,
            _sampler(cfg, settings.oom_constraint),
            instantiate(cfg.search.pruner),
            fixed,
        )
        if study.trials:
            # A resumed study (or another worker) must not replay the seeded first proposals.
            study.sampler.reseed_rng()
        tracker = Tracker(cfg.mlflow.tracking_uri, name, cfg.mlflow.artifact_root)
        parent = tracker.resume_run(study.user_attrs.get(PARENT_ATTR))
        if parent is None:
            parent = tracker.start_run(name, tags={ROLE_TAG: "study", "batchfit.study": name})
            study.set_user_attr(PARENT_ATTR, parent.run_id)
            parent.params(flatten(OmegaConf.to_container(OmegaConf.create(fixed))))
            parent.text(OmegaConf.to_yaml(searched), "search_space.yaml")
            parent.text(fixed, "fixed_config.yaml")
            _log_fit_report(cfg, checked, parent, console)
        parent_run = StudyRun(parent, settings.metrics)
        return cls(checked, compose, base, study, tracker, parent_run, console)

    def run(self) -> float | None:
        settings = self.checked.settings
        objective = Objective(
            self.compose,
            self.checked.space,
            settings,
            self.tracker,
            self.parent.log.run_id,
            notify=lambda message: self.console.print(f"[yellow]note[/yellow] {message}"),
        )
        done = num_finished(self.study)
        self.console.print(
            f"Study [bold]{settings.study_name}[/bold] in {settings.storage}: {done} of "
            f"{settings.n_trials} trials finished; MLflow: {self.tracker.tracking_uri}",
            soft_wrap=True,
        )
        with report.progress_bar(self.console) as progress:
            task = progress.add_task("trials", total=settings.n_trials, completed=done)

            def show(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
                progress.console.print(report.trial_line(trial), soft_wrap=True)
                progress.update(task, completed=num_finished(study))

            if done < settings.n_trials:
                self.study.optimize(
                    objective,
                    n_trials=settings.n_trials - done,
                    catch=(TrialFailed,),
                    callbacks=[self.parent, show, StopWhenFinished(settings.n_trials)],
                )
        self.parent.update(self.study)
        self.parent.log.finish("FINISHED")
        report.summary(
            self.console,
            self.study,
            settings.metrics,
            self.base_overrides,
            self.checked.space.fixed,
        )
        best = report.best_trials(self.study, limit=1)
        return best[0].values[0] if best else None

    def interrupted(self) -> None:
        self.parent.update(self.study)
        self.parent.log.finish("KILLED")
        self.console.print(
            "[yellow]Interrupted.[/yellow] Finished trials are saved; run the same command "
            "again to resume the study."
        )


# Library chatter (database migrations, experimental-API notices) would bury the trial lines.
logging.getLogger("alembic").setLevel(logging.WARNING)
logging.getLogger("mlflow").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
