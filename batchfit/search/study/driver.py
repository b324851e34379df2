"""The study driver: everything between a composed config and a finished study."""

from __future__ import annotations

import contextlib
import io
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import hydra
import optuna
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from batchfit.common.checks import ConfigError
from batchfit.common.overrides import override_key
from batchfit.common.redact import redact
from batchfit.search.core.record import TrialRecord
from batchfit.search.core.trial_count import TrialBudget, num_trained, study_records
from batchfit.search.fit.advice import what_would_fit
from batchfit.search.fit.layouts import COMMAND, NOTHING_FITS, nothing_fits, show_fit_reports
from batchfit.search.fit.render import summary_lines
from batchfit.search.fit.report import FitReport
from batchfit.search.results import recommend, speed_check, summary
from batchfit.search.results.boundary import FIT_ATTR, fit_cells, frontier
from batchfit.search.results.recommend import Recommendation
from batchfit.search.sampling.levers import with_default_space
from batchfit.search.sampling.sampler import FeasibilityFilter
from batchfit.search.storage.opening import located
from batchfit.search.study import decision
from batchfit.search.study.opening import flatten, open_study, refuse_a_second_study_of_the_name
from batchfit.search.study.publish import Results, StudyRun
from batchfit.search.study.tracking_state import TrackingState
from batchfit.search.study.validate import Checked, validate
from batchfit.search.study.worker import TrialLoop
from batchfit.search.trial.objective import Objective
from batchfit.search.trial.trial_config import Configurer
from batchfit.tracking.metrics import STORAGE_S, TRACKING_S
from batchfit.tracking.mlflow_ui import ui_link
from batchfit.tracking.overhead import CallClock, Lap, storage_methods
from batchfit.tracking.runs import RunLog, Tracker
from batchfit.train.build import unimportable_targets
from batchfit.train.config import RunSpec
from batchfit.train.memory.predict import PredictionUnsupported
from batchfit.train.plan import (
    planned_elsewhere,
    resolve_device,
    with_gpu_budget,
    with_lr_reference,
)
from batchfit.train.run import OverBudget
from batchfit.train.workload import Workloads

PARENT_ATTR = "mlflow_parent_run_id"
WORKER_KEY = "worker"  # conf/config.yaml: which of search.workers a process is
# Study settings that may change between runs of one study without making it another study.
_RESUMABLE_KEYS = (
    "n_trials", "params", "sampler", "pruner", "trial_time_budget_s", "heartbeat_interval_s",
    "storage", "study_name", "preflight", "preflight_margin", "oom_constraint", "workers",
    "recommend", "threads", "timeout_s", "speed_check", "fit_report_first", "default_space",
    "validations_per_epoch",
)  # fmt: skip
INTERRUPT_WAIT_S = 5.0  # on Ctrl-C, how long queued MLflow writes may still take


def default_study_name(choices: dict[str, str]) -> str:
    experiment = choices.get("experiment") or f"batchfit-{choices.get('model', 'model')}"
    return f"{experiment}-{choices.get('data', 'data')}"


def fixed_config(cfg: DictConfig, searched: Sequence[str]) -> str:
    """The config a study's trials share (searched keys and resumable settings removed)."""
    fixed = OmegaConf.to_container(cfg, resolve=True)
    fixed.pop("mlflow", None)
    fixed.pop(WORKER_KEY, None)
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


def _sampler(
    sampler: optuna.samplers.BaseSampler, oom_constraint: bool
) -> optuna.samplers.BaseSampler:
    # Memory-infeasible trials (constraint `memory` > 0) keep the sampler off their region.
    return FeasibilityFilter(sampler) if oom_constraint else sampler


def _log_fit_report(
    cfg: DictConfig,
    checked: Checked,
    workloads: Workloads,
    parent: RunLog,
    console: Console,
    given: list[str],
    output_dir: Path | None = None,
) -> list[FitReport]:
    """Predict the space's (precision, batch size) grid and log its tables to the parent run
    (and the Hydra output directory); say in a few lines what is searched and the boundary,
    with where the tables are, and what would fit when nothing does. The trials' own
    predictions then come from the same cache."""
    recorder = Console(record=True, width=120, file=io.StringIO())
    try:
        reports = _shown_fit_reports(cfg, checked, workloads, console, given, recorder, False)
    except PredictionUnsupported:
        return []  # said by the first trial, which measures instead
    rows: dict[str, list] = {}
    for each in reports:
        for column, values in each.rows().items():
            rows.setdefault(column, []).extend(values)
    text = recorder.export_text()
    parent.text(text, FIT_REPORT_FILE)
    parent.table(rows, "fit_report.json")
    where = f"{FIT_REPORT_FILE} on the study's MLflow parent run"
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / FIT_REPORT_FILE).write_text(text)
        where = f"{_shown(output_dir / FIT_REPORT_FILE)} (and {where})"
    say = {"soft_wrap": True, "markup": False, "highlight": False}
    if reports:
        space = checked.space
        searched = ", ".join(
            f"{k}={space.describe(k) if k in space.distributions else v}"
            for k, v in (cfg.search.params or {}).items()
            if v
        )
        console.print(f"Searching {searched or 'nothing'}", **say)
        for line in summary_lines(reports):
            console.print(line, **say)
        command = redact(shlex.join([*COMMAND.split(), *given]))
        console.print(f"The full tables: {where}, or {command}", **say)
    return reports


FIT_REPORT_FILE = "fit_report.txt"


def _shown_fit_reports(
    cfg: DictConfig,
    checked: Checked,
    workloads: Workloads,
    console: Console,
    given: list[str],
    record: Console | None = None,
    tables: bool = True,
) -> list[FitReport]:
    """The fit reports, each shown as it is done (its tables in `record` only, not
    `tables`), then, when no cell fits, what would (search/fit/advice.py) with `python -m
    search` commands."""
    space, spec, settings = checked.space, checked.spec, checked.settings
    reports = show_fit_reports(
        console, cfg, space, spec, settings, workloads, record, tables=tables
    )
    if nothing_fits(reports):
        console.print(NOTHING_FITS, soft_wrap=True, highlight=False)
        for line in what_would_fit(cfg, given, STUDY_COMMAND, workloads):
            for each in (console, record) if record is not None else (console,):
                each.print(line, soft_wrap=True, markup=False, highlight=False)
    return reports


STUDY_COMMAND = "python -m search"


def _trains_here(cfg: DictConfig) -> bool:
    """False when search.gpu names a card this run would not train on (the CPU, or a device
    that is not one): decided from the config alone, so that nothing is opened for a plan
    whatever else is wrong with it (validate says what)."""
    if OmegaConf.select(cfg, "search.gpu") is None:
        return True
    try:
        return resolve_device(str(cfg.trainer.device)).type == "cuda"
    except (RuntimeError, ValueError):
        return False


def _show_fit_reports(
    cfg: DictConfig,
    checked: Checked,
    workloads: Workloads,
    console: Console,
    elsewhere: str,
    given: list[str],
) -> None:
    try:
        _shown_fit_reports(cfg, checked, workloads, console, given)
    except PredictionUnsupported:
        return
    except ConfigError as error:  # said with the reason the study stops
        raise ConfigError([*error.problems, elsewhere]) from None


def _open(name: str, checked: Checked, fixed: str) -> optuna.Study:
    """The study, created or resumed, named and seeded for this worker."""
    settings = checked.settings
    study, created = open_study(
        name,
        checked.storage,
        settings.directions,
        _sampler(checked.sampler, settings.oom_constraint),
        checked.pruner,
        fixed,
    )
    if study.metric_names is None:  # objectives by name in optuna-dashboard and its CSV
        study.set_metric_names(settings.metrics)
    if not created or settings.workers > 1:
        # A resumed study, or workers started together (by --multirun, or by hand with the
        # same command) must not replay the seeded first proposals.
        study.sampler.reseed_rng()
    return study


def _set_up(
    cfg: DictConfig,
    checked: Checked,
    workloads: Workloads,
    study: optuna.Study,
    parent: RunLog,
    searched: dict[str, str],
    fixed: str,
    console: Console,
    given: list[str],
    output_dir: Path | None = None,
) -> None:
    """The parent run's params, search space, fixed config and fit report; the fit report's
    cells (the summary's memory boundary) and first trials into the study."""
    settings = checked.settings
    parent.params(flatten(OmegaConf.to_container(OmegaConf.create(fixed))))
    parent.text(OmegaConf.to_yaml(searched), "search_space.yaml")
    parent.text(fixed, "fixed_config.yaml")
    reports = _log_fit_report(cfg, checked, workloads, parent, console, given, output_dir)
    if reports and FIT_ATTR not in study.user_attrs:
        # The first trials are enqueued before the cells are stored: a worker killed in
        # between leaves the next one to enqueue them (once: skip_if_exists). A grid tries
        # every configuration anyway, each once.
        grid = isinstance(checked.sampler, optuna.samplers.GridSampler)
        fresh = num_trained(study_records(study)) == 0
        if settings.fit_report_first and not grid and fresh:
            first = frontier(fit_cells(reports), list(checked.space.distributions))
            for params in first[: settings.n_trials]:  # none left waiting at the end
                study.enqueue_trial(params, skip_if_exists=True)
        study.set_user_attr(FIT_ATTR, fit_cells(reports))
    parent.tags({SETUP_TAG: "complete"})


SETUP_TAG = "batchfit.setup"  # on the parent run once its params and reports are logged


def setup_done(tracker: Tracker, parent: RunLog) -> bool:
    """Whether the parent run has its params, search space, fixed config and fit report."""
    tracker.outbox.drain()
    try:
        tags = tracker.client.get_run(parent.run_id).data.tags
    except Exception:  # noqa: BLE001 - cannot tell: logging it again is harmless
        return False
    return tags.get(SETUP_TAG) == "complete"


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _say_where(console: Console, study: optuna.Study, checked: Checked, tracker: Tracker) -> None:
    """Before the fit report and any trial: where the study and its MLflow runs are, and
    whether it is new, resumed, or has nothing left to train."""
    settings = checked.settings
    records = study_records(study)
    done = num_trained(records)
    if done >= settings.n_trials:
        state = (
            f"{done} trials trained, search.n_trials={settings.n_trials}: nothing left to "
            f"train (raise search.n_trials, e.g. search.n_trials={done + 10}, to extend it)"
        )
    elif any(t.state != "WAITING" for t in records):
        # (the fit report's first trials wait in a new study: enqueued at its setup)
        state = f"resumed: {done} of {settings.n_trials} trials trained"
    else:
        state = f"new, {settings.n_trials} trial{'s' * (settings.n_trials != 1)} to train"
    console.print(
        f"Study [bold]{escape(settings.study_name)}[/bold] in "
        f"{escape(redact(located(settings.storage)))}: {state}; "
        f"MLflow: {escape(redact(located(tracker.tracking_uri)))}",
        soft_wrap=True,
    )


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
        workloads: Workloads,
        storage_clock: CallClock | None = None,
        output_dir: Path | None = None,
    ):
        self.checked = checked
        self.compose = compose  # the command line's overrides + a trial's, composed by Hydra
        self.base_overrides = base_overrides
        self.study = study
        self.tracker = tracker
        self.parent = parent
        self.console = console
        self.storage_clock = storage_clock or CallClock()  # times the study's storage calls
        # A decision made before this (the same study run again) is an earlier run's.
        self.started_at = time.time()
        self.results = Results(
            parent.log,
            checked.settings.metrics,
            checked.settings.recommend,
            lambda trial: summary.rerun_overrides(trial, base_overrides, checked.space.fixed),
            output_dir,
            margin=checked.settings.preflight_margin,
            target=checked.settings.target,
        )
        self.budget = TrialBudget(
            checked.settings.n_trials, checked.space.size(), checked.space.distributions
        )
        self.configure = Configurer(compose, checked.space, checked.settings, workloads, self._note)
        self.loop = TrialLoop(study, checked.settings, self.budget, tracker)
        self.tracking = TrackingState(tracker)
        # After run: the recommendation and the overrides that train it (None: no answer)
        self.recommendation: Recommendation | None = None
        self.rerun_overrides: list[str] | None = None

    @classmethod
    def prepare(
        cls,
        cfg: DictConfig,
        overrides: list[str],
        choices: dict[str, str],
        console: Console,
        multirun: bool = False,
        output_dir: Path | None = None,
    ) -> StudyDriver:
        name = cfg.search.study_name or default_study_name(choices)
        given = list(overrides)  # as typed: the advice's commands extend them
        overrides = with_gpu_budget(cfg, overrides)  # search.gpu=CARD: the card's budget
        searched_keys = list(cfg.search.params or {})
        overrides = with_lr_reference(cfg, overrides, searched_keys)  # lr at one batch
        # The data and memory predictors of the study: the checks, the fit report and the
        # trials build each once.
        workloads = Workloads()
        unimportable = unimportable_targets(cfg)  # a project's modules, from elsewhere
        if unimportable:
            raise ConfigError(unimportable)
        space_note = with_default_space(cfg, workloads)
        if space_note:
            console.print(f"[yellow]note[/yellow] {escape(space_note)}", soft_wrap=True)
        params = (
            OmegaConf.to_container(cfg.search.params, resolve=True) if cfg.search.params else {}
        )
        searched = {key: text for key, text in params.items() if text is not None}  # null: dropped
        # A trial's overrides replace the command line's for the same key; which worker this
        # is never reaches a trial.
        base = [o for o in overrides if override_key(o) not in {*searched, WORKER_KEY}]

        def compose(trial_overrides: list[str]) -> DictConfig:
            return hydra.compose(config_name="config", overrides=base + trial_overrides)

        # A GPU planned for (search.gpu) but not here: the preflight, then stop, with no
        # storage opened, no study, no run.
        here = _trains_here(cfg)
        try:
            checked = validate(
                cfg, name, compose, open_store=here, multirun=multirun, workloads=workloads
            )
        except OverBudget as error:  # no batch helps: what would, predicted
            console.print(NOTHING_FITS, soft_wrap=True, highlight=False)
            advice = what_would_fit(cfg, given, STUDY_COMMAND, workloads, error.needed_bytes)
            raise ConfigError([*error.problems, "\n".join(advice)]) from None
        for note in checked.notes:
            console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
        elsewhere = planned_elsewhere(checked.spec)
        if elsewhere:
            _show_fit_reports(cfg, checked, workloads, console, elsewhere, given)
            raise ConfigError([elsewhere])
        settings = checked.settings
        # What every trial shares: the config with the space's fixed values applied, less the
        # searched keys. A resume must find the same, or it would mix incomparable trials.
        fixed = fixed_config(compose(checked.space.overrides({})), list(searched))
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own lines report each trial
        for note in getattr(getattr(checked.storage, "_backend", None), "notes", []):
            console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
        # MLflow first: a store that cannot be reached must fail before the study exists.
        tracker = Tracker.from_config(cfg.mlflow, name)
        storage_clock = CallClock()
        storage_clock.time_methods(checked.storage, storage_methods(checked.storage))
        refuse_a_second_study_of_the_name(name, checked.storage, checked.settings, tracker)
        study = _open(name, checked, fixed)
        _say_where(console, study, checked, tracker)
        parent, created = tracker.study_run(name, study.user_attrs.get(PARENT_ATTR))
        if created:
            study.set_user_attr(PARENT_ATTR, parent.run_id)
        if created or not setup_done(tracker, parent):
            # A worker killed before the end of this is completed by the next one.
            _set_up(
                cfg, checked, workloads, study, parent, searched, fixed, console, given, output_dir
            )
        parent_run = StudyRun(parent, settings.metrics)
        return cls(
            checked,
            compose,
            base,
            study,
            tracker,
            parent_run,
            console,
            workloads,
            storage_clock,
            output_dir,
        )

    def run(self) -> float | None:
        settings = self.checked.settings
        storage_lap, tracking_lap = Lap(self.storage_clock), Lap(self.tracker.outbox.clock)
        done = num_trained(study_records(self.study))
        progress = summary.StudyProgress(
            self.console, settings.n_trials, done, settings.metrics[0], settings.metrics,
            settings.timeout_s,
        )  # fmt: skip
        objective = Objective(
            self.configure,
            settings,
            self.tracker,
            self.parent.log.run_id,
            notify=self._note,
            overhead=lambda: {STORAGE_S: storage_lap(), TRACKING_S: tracking_lap()},
            on_epoch=progress.epoch,
        )
        with progress:

            def show(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
                if TrialRecord.of(trial).surplus:
                    return
                progress.trial_finished(study, trial)
                self.tracking.say_state(progress.console)

            callbacks = [self.parent, self.results, show, self.budget.trial_finished]
            self.loop.run(objective, callbacks, progress.console)
        decided = self._decide()
        self.parent.update(self.study)
        rec = self.results.publish(self.study, decided)
        self.parent.log.finish("FINISHED")
        self.tracking.close(self.console, settings.outage_wait_s)
        self._say_where_to_browse()
        best_path = self.results.best_path
        self.recommendation, self.rerun_overrides = rec, self.results.overrides(rec)
        summary.summary(
            self.console,
            self.study,
            settings.metrics,
            rec,
            self.rerun_overrides,
            _shown(best_path) if rec and best_path else None,
        )
        return rec.trial.values[0] if rec else None

    def _note(self, message: str) -> None:
        self.console.print(f"[yellow]note[/yellow] {message}")

    def _decide(self) -> decision.Decision:
        """The study's answer, made once for all its workers (search/study/decision.py): wait for
        the other workers' trials; then the first to take the study's lock runs the speed
        check and the recommendation, and the others reuse what it stored."""
        storage, settings = self.checked.storage, self.checked.settings
        decision.wait_for_others(self.study, storage, settings.n_trials, self._say)

        def make() -> tuple[int | None, str | None]:
            self._speed_check()
            rec = self.results.recommendation(self.study)
            return (rec.trial.number if rec else None), self.results.best_yaml(self.study, rec)

        decided, made_here = decision.decide(self.study, storage, make)
        if not made_here:
            # counted as the summary counts them (search/results/summary.py counts_line)
            finished = [t for t in study_records(self.study) if t.number in decided.finished]
            free = sum(t.is_unbilled for t in finished)
            self._say(decided.reused(self.started_at, len(finished) - free, free))
        return decided

    def _speed_check(self) -> None:
        """Time the recommendation's candidates side by side (search/results/speed_check.py) when it
        prefers a throughput."""
        rule = self.checked.settings.recommend
        if not self.checked.settings.speed_check or speed_check.unit_of(rule.prefer) is None:
            return
        trials = self.study.get_trials(deepcopy=False)
        _, within = recommend.candidates(trials, rule)
        chosen = speed_check.to_check([(t, p) for t, _, p in within])

        def configuration(trial: optuna.trial.FrozenTrial) -> tuple[DictConfig, RunSpec]:
            configured = self.configure(trial.params)  # as the trial trained
            return configured.cfg, configured.spec

        speed_check.check(self.study, chosen, configuration, self._say, self.configure.workloads)

    def _say(self, text: str) -> None:
        self.console.print(text, soft_wrap=True, highlight=False, markup=False)

    def _say_where_to_browse(self) -> None:
        uri = self.tracker.tracking_uri
        link = ui_link(uri, self.tracker.experiment_id)
        if uri.startswith("http"):
            self.console.print(f"In MLflow: {link}", soft_wrap=True)
        else:
            self.console.print(
                f"In MLflow: mlflow ui --backend-store-uri {shlex.quote(redact(uri))}, then open "
                f"{link}",
                soft_wrap=True,
            )

    def interrupted(self, kind: str = "KeyboardInterrupt") -> None:
        """Ctrl-C, SIGTERM or SIGHUP: the running trial's parameters are queued to run again (as a
        dead worker's are), the parent run ends KILLED, queued MLflow writes get a few
        seconds."""
        self.loop.queue_again_interrupted()
        self.parent.update(self.study)
        self.results.publish(self.study)
        self.parent.log.finish("KILLED")
        if not self.tracker.close(INTERRUPT_WAIT_S):
            self.console.print(
                f"[yellow]{len(self.tracker.outbox)} MLflow records were not written "
                f"({self.tracker.outbox.last_error})[/yellow]"
            )
        stopped = {
            "Terminated": "Terminated (SIGTERM)",
            "HungUp": "Hung up (SIGHUP: the terminal closed or the connection dropped)",
        }.get(kind, "Interrupted")
        self.console.print(
            f"[yellow]{stopped}.[/yellow] Finished trials are saved and the interrupted one "
            "is queued to run again; run the same command to resume the study."
        )

    def storage_failed(self) -> None:
        """The study's storage failed (a full disk): nothing more is written to it. The
        running trial stays RUNNING there, and the next run of the study, seeing its owner
        gone, runs it again; its MLflow run and the parent run end KILLED."""
        number, self.loop.current = self.loop.current, None
        with contextlib.suppress(Exception):  # MLflow may be on the same full disk
            if number is not None:
                self.tracker.end_killed_runs({number})
            self.parent.log.finish("KILLED")
            self.tracker.close(INTERRUPT_WAIT_S)
