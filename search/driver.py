"""The study driver: everything between a composed config and a finished study."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import hydra
import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState
from rich.console import Console
from rich.markup import escape

from search import fit, recommend, report, speed
from search.boundary import FIT_ATTR, fit_cells, frontier
from search.levers import with_default_space
from search.objective import Objective
from search.outcome import TrialFailed
from search.results import Results, StudyRun
from search.sampler import FeasibilityFilter, grid_exhausted
from search.storage import (
    OWNER_ATTR,
    RetryStaleTrial,
    fail_orphaned_trials,
    queue_unretried,
    record_owner,
)
from search.study import (
    SURPLUS_ATTR,
    claims_slot,
    counts_as_finished,
    flatten,
    interrupted_numbers,
    is_unbilled,
    known_configurations,
    num_finished,
    num_running,
    open_study,
    should_start_trial,
)
from search.validate import Checked, validate
from tracking.outbox import is_transient
from tracking.overhead import CallClock, Lap, storage_methods
from tracking.redact import redact
from tracking.runs import RunLog, Tracker, ui_link
from train.config import LoaderConfig
from train.overrides import override_key
from train.predict import PredictionUnsupported

PARENT_ATTR = "mlflow_parent_run_id"
WORKER_KEY = "worker"  # conf/config.yaml: which of search.workers a process is
# Study settings that may change between runs of one study without making it another study.
_RESUMABLE_KEYS = (
    "n_trials", "params", "sampler", "pruner", "trial_time_budget_s", "heartbeat_interval_s",
    "storage", "study_name", "preflight", "preflight_margin", "oom_constraint", "workers",
    "recommend", "threads", "timeout_s", "speed_check", "fit_report_first", "default_space",
)  # fmt: skip
# A worker whose proposals go this many in a row without training (predicted not to fit, or
# already trained) stops: the feasible part of search.params is spent or too small.
MAX_UNBILLED_IN_A_ROW = 50
IDLE_POLL_S = 2.0  # an idle worker looks for dead workers' trials this often
INTERRUPT_WAIT_S = 5.0  # on Ctrl-C, how long queued MLflow writes may still take


class Surplus(Exception):
    """A trial started past search.n_trials by a worker racing another; it does not run."""


class TrackingIncomplete(Exception):
    """MLflow stayed unreachable: some records of this worker were not written."""


def default_study_name(choices: dict[str, str]) -> str:
    experiment = choices.get("experiment") or f"batchfit-{choices.get('model', 'model')}"
    return f"{experiment}-{choices.get('data', 'data')}"


# Config sections added after studies may have begun, at their defaults (conf/config.yaml,
# conf/task/classification.yaml): a study that has them so still resumes.
_ADDED_SECTIONS = {
    "loader": dataclasses.asdict(LoaderConfig()),
    "task": {
        "_target_": "train.tasks.Classification",
        "target_key": "labels",
        "label_smoothing": 0.0,
    },
}


_ADDED_TRAINER_KEYS = {"peak_flops": None, "activation_checkpointing": "none"}


def fixed_config(cfg: DictConfig, searched: Sequence[str]) -> str:
    """The config a study's trials share (searched keys and resumable settings removed)."""
    fixed = OmegaConf.to_container(cfg, resolve=True)
    fixed.pop("mlflow", None)
    fixed.pop(WORKER_KEY, None)
    # Settings added after a study may have begun count only when set to something else, so
    # that such a study still resumes.
    if fixed["search"].get("accumulation") == "searched":
        fixed["search"].pop("accumulation")
    if fixed["search"].get("target", 0) is None:
        fixed["search"].pop("target")
    if fixed.get("trainer", {}).get("effective_batch_size", 0) is None:
        fixed["trainer"].pop("effective_batch_size")
    for key, default in _ADDED_SECTIONS.items():
        if fixed.get(key) == default:
            fixed.pop(key)
    for key, default in _ADDED_TRAINER_KEYS.items():
        if key in fixed.get("trainer", {}) and fixed["trainer"][key] == default:
            fixed["trainer"].pop(key)
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
    cfg: DictConfig, checked: Checked, parent: RunLog, console: Console
) -> list[fit.FitReport]:
    """Predict the space's (precision, batch size) grid, show it and log it to the parent run;
    the trials' own predictions then come from the same cache."""
    try:
        reports = fit.fit_reports(cfg, checked.space, checked.spec, checked.settings)
    except PredictionUnsupported:
        return []  # said by the first trial, which measures instead
    recorder = Console(record=True, width=120, file=io.StringIO())
    rows: dict[str, list] = {}
    for each in reports:
        table = fit.render(each)
        console.print(table)
        recorder.print(table)
        for column, values in each.rows().items():
            rows.setdefault(column, []).extend(values)
    parent.text(recorder.export_text(), "fit_report.txt")
    parent.table(rows, "fit_report.json")
    return reports


SETUP_TAG = "batchfit.setup"  # on the parent run once its params and reports are logged


def setup_done(tracker: Tracker, parent: RunLog) -> bool:
    """Whether the parent run has its params, search space, fixed config and fit report."""
    tracker.outbox.drain()
    try:
        tags = tracker.client.get_run(parent.run_id).data.tags
    except Exception:  # noqa: BLE001 - cannot tell: logging it again is harmless
        return False
    return tags.get(SETUP_TAG) == "complete"


def _owner_text(owner: dict | None) -> str:
    if not owner:
        return "owner unknown"
    job = f", SLURM job {owner['slurm_job']}" if owner.get("slurm_job") else ""
    return f"host {owner.get('host')}, pid {owner.get('pid')}{job}"


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


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
        self.results = Results(
            parent.log,
            checked.settings.metrics,
            checked.settings.recommend,
            lambda trial: report.rerun_overrides(trial, base_overrides, checked.space.fixed),
            output_dir,
            margin=checked.settings.preflight_margin,
        )
        self._killed_seen: set[int] = set()
        self._current: int | None = None  # the trial this worker is running
        self._unbilled_in_a_row = 0  # this worker's proposals answered without training
        self._outage_said = False
        self._failures_said = 0
        self._started = time.monotonic()  # search.timeout_s counts from run()
        self._timeout_said = False

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
        space_note = with_default_space(cfg)
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

        checked = validate(cfg, name, compose, multirun=multirun)
        for note in checked.notes:
            console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
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
        study, created_study = open_study(
            name,
            checked.storage,
            settings.directions,
            _sampler(checked.sampler, settings.oom_constraint),
            checked.pruner,
            fixed,
        )
        if study.metric_names is None:  # objectives by name in optuna-dashboard and its CSV
            study.set_metric_names(settings.metrics)
        if not created_study or settings.workers > 1:
            # A resumed study, or workers started together (by --multirun, or by hand with
            # the same command) must not replay the seeded first proposals.
            study.sampler.reseed_rng()
        parent, created = tracker.study_run(name, study.user_attrs.get(PARENT_ATTR))
        if created:
            study.set_user_attr(PARENT_ATTR, parent.run_id)
        if created or not setup_done(tracker, parent):
            # A worker killed before the end of this is completed by the next one.
            parent.params(flatten(OmegaConf.to_container(OmegaConf.create(fixed))))
            parent.text(OmegaConf.to_yaml(searched), "search_space.yaml")
            parent.text(fixed, "fixed_config.yaml")
            reports = _log_fit_report(cfg, checked, parent, console)
            if reports and FIT_ATTR not in study.user_attrs:  # the summary's memory boundary
                # The first trials are enqueued before the cells are stored: a worker killed
                # in between leaves the next one to enqueue them (once: skip_if_exists). A
                # grid tries every configuration anyway, each once.
                grid = isinstance(checked.sampler, optuna.samplers.GridSampler)
                if settings.fit_report_first and not grid and num_finished(study) == 0:
                    first = frontier(fit_cells(reports), list(checked.space.distributions))
                    for params in first[: settings.n_trials]:  # none left waiting at the end
                        study.enqueue_trial(params, skip_if_exists=True)
                study.set_user_attr(FIT_ATTR, fit_cells(reports))
            parent.tags({SETUP_TAG: "complete"})
        parent_run = StudyRun(parent, settings.metrics)
        return cls(
            checked, compose, base, study, tracker, parent_run, console, storage_clock, output_dir
        )

    def run(self) -> float | None:
        settings = self.checked.settings
        self._started = time.monotonic()
        storage_lap, tracking_lap = Lap(self.storage_clock), Lap(self.tracker.outbox.clock)
        done = num_finished(self.study)
        if done >= settings.n_trials:
            state = (
                f"{done} trials trained, search.n_trials={settings.n_trials}: nothing left to "
                f"train (raise search.n_trials, e.g. search.n_trials={done + 10}, to extend it)"
            )
        elif any(t.state != TrialState.WAITING for t in self.study.get_trials(deepcopy=False)):
            # (the fit report's first trials wait in a new study: enqueued at its setup)
            state = f"resumed: {done} of {settings.n_trials} trials trained"
        else:
            state = f"new, {settings.n_trials} trials to train"
        self.console.print(
            f"Study [bold]{settings.study_name}[/bold] in {redact(settings.storage)}: {state}; "
            f"MLflow: {redact(self.tracker.tracking_uri)}",
            soft_wrap=True,
        )
        progress = report.StudyProgress(self.console, settings.n_trials, done, settings.metrics[0])
        objective = Objective(
            self.compose,
            self.checked.space,
            settings,
            self.tracker,
            self.parent.log.run_id,
            notify=lambda message: self.console.print(f"[yellow]note[/yellow] {message}"),
            overhead=lambda: {"time/storage_s": storage_lap(), "time/tracking_s": tracking_lap()},
            on_epoch=progress.epoch,
        )
        with progress:

            def show(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
                if SURPLUS_ATTR in trial.user_attrs:
                    return
                progress.trial_finished(study, trial)
                self._say_tracking_state(progress.console)

            callbacks = [self.parent, self.results, show, self._count_unbilled]
            self._work(objective, callbacks, progress.console)
        self._speed_check(objective)
        self.parent.update(self.study)
        rec = self.results.publish(self.study)
        self.parent.log.finish("FINISHED")
        self._close_tracking()
        self._say_where_to_browse()
        best_path = self.results.best_path
        report.summary(
            self.console,
            self.study,
            settings.metrics,
            rec,
            self.results.overrides_of(rec.trial) if rec else [],
            _shown(best_path) if rec and best_path else None,
        )
        return rec.trial.values[0] if rec else None

    def _speed_check(self, objective: Objective) -> None:
        """Time the recommendation's candidates side by side (search/speed.py) when it
        prefers a throughput."""
        rule = self.checked.settings.recommend
        if not self.checked.settings.speed_check or speed.unit_of(rule.prefer) is None:
            return
        trials = self.study.get_trials(deepcopy=False)
        _, within = recommend.candidates(trials, rule, self.checked.settings.metrics)
        chosen = speed.to_check([(t, p) for t, _, p in within])
        speed.check(self.study, chosen, objective.configuration, self._say)

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

    def _work(self, objective: Objective, callbacks: list, console: Console) -> None:
        """Take trials until the study (all workers together) has search.n_trials finished.
        While the trials running elsewhere would complete it, wait instead: if their worker
        dies, its trial is failed (fail_stale_trials, Optuna's heartbeat check) and queued
        again with its parameters, and this worker runs it."""
        n_trials = self.checked.settings.n_trials
        said_waiting = False
        beats = bool(self.checked.settings.heartbeat_interval_s)
        while True:
            optuna.storages.fail_stale_trials(self.study)  # with heartbeats only
            failed = fail_orphaned_trials(self.study)  # the owner is gone: needs no beat
            failed += queue_unretried(self.study)  # failed, but died before queueing it
            if failed:
                console.print(
                    f"trials {failed} were left unfinished by a process that died: their "
                    "parameters run again"
                )
            self._end_killed_runs(console)
            start = should_start_trial(self.study, n_trials)
            if start and (self._space_spent(console) or self._timed_out(console)):
                return
            if start is None and not beats:
                # Without heartbeats a trial running in a worker elsewhere is never failed
                # if that worker died: do not wait forever, but say it.
                self._say_orphaned(console)
                return
            if start is False:
                return
            if start is None:
                if not said_waiting:
                    console.print(
                        f"waiting: {num_running(self.study)} trials running in other workers "
                        "complete the study; a trial whose worker dies is run here"
                    )
                    said_waiting = True
                self.tracker.outbox.drain()
                time.sleep(IDLE_POLL_S)
                continue
            said_waiting = False
            self.study.optimize(
                self._within_n_trials(objective),
                n_trials=1,
                catch=(TrialFailed, Surplus),
                callbacks=callbacks,
            )

    def _timed_out(self, console: Console) -> bool:
        """Whether search.timeout_s has passed since this worker began, with a trial
        completed (a study that must end on time still answers)."""
        limit = self.checked.settings.timeout_s
        elapsed = time.monotonic() - self._started
        if limit is None or elapsed < limit:
            return False
        if not self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if not self._timeout_said:
                self._timeout_said = True
                console.print(
                    f"search.timeout_s={limit:g} has passed with no trial completed: trials go "
                    "on until one completes, for a recommendation"
                )
            return False
        console.print(
            f"search.timeout_s={limit:g} reached ({elapsed:.0f} s): no new trial starts; "
            f"{num_finished(self.study)} of {self.checked.settings.n_trials} trials trained, "
            "and the recommendation is from them. Run the same command again to go on (it "
            "resumes the study), or with search.timeout_s=null to run to search.n_trials.",
            soft_wrap=True,
        )
        return True

    def _say_orphaned(self, console: Console) -> None:
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        owners = ", ".join(
            f"#{t.number} ({_owner_text(t.system_attrs.get(OWNER_ATTR))})" for t in running
        )
        console.print(
            f"[yellow]{len(running)} trials are still running elsewhere: {owners}.[/yellow] "
            "With search.heartbeat_interval_s=null a worker that died on another host is "
            "never noticed: if it is gone, its trial stays RUNNING and the study is short of "
            "search.n_trials. Set search.heartbeat_interval_s (e.g. 60) to have it run again.",
            soft_wrap=True,
        )

    def _count_unbilled(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if SURPLUS_ATTR not in trial.user_attrs:
            self._unbilled_in_a_row = self._unbilled_in_a_row + 1 if is_unbilled(trial) else 0

    def _space_spent(self, console: Console) -> bool:
        """Whether the study ends short of search.n_trials, and why: every configuration of a
        finite space is known, or proposals keep landing where nothing new trains."""
        n_trials = self.checked.settings.n_trials
        done = f"{num_finished(self.study)} trials trained of search.n_trials={n_trials}"
        if grid_exhausted(self.study.sampler, self.study):
            console.print(
                f"the grid is exhausted: every configuration of search.params was proposed ({done})"
            )
            return True
        size = self.checked.space.size()
        known = known_configurations(self.study, self.checked.space.distributions)
        if size is not None and len(known) >= size:
            console.print(
                f"every one of the {size} configurations of search.params has been tried or "
                f"predicted not to fit ({done}); the study ends here"
            )
            return True
        if self._unbilled_in_a_row >= MAX_UNBILLED_IN_A_ROW:
            console.print(
                f"[yellow]the last {self._unbilled_in_a_row} proposals were all predicted not "
                f"to fit or trained before, so this worker stops ({done}).[/yellow] Little of "
                "search.params fits search.memory_budget: raise the budget, or keep "
                "search.params to the batch sizes and precisions the fit report shows fitting",
                soft_wrap=True,
            )
            return True
        return False

    def _within_n_trials(self, objective: Objective) -> Callable[[optuna.Trial], list[float]]:
        n_trials = self.checked.settings.n_trials
        beats = bool(self.checked.settings.heartbeat_interval_s)

        def run_if_within(trial: optuna.Trial) -> list[float]:
            if not beats:  # heartbeats record it; without them the owner still counts
                record_owner(self.study, trial._trial_id)
            if not claims_slot(self.study, trial.number, n_trials):
                # Nothing sampled or recorded yet; FAIL without an error: not counted.
                trial.set_user_attr(SURPLUS_ATTR, True)
                raise Surplus(f"trial {trial.number} started past search.n_trials={n_trials}")
            self._current = trial.number
            values = objective(trial)
            self._current = None
            return values

        return run_if_within

    def _say_tracking_state(self, console: Console) -> None:
        """Say once when MLflow writes start to queue, and once when they are through; say
        every write MLflow refused."""
        for failure in self.tracker.outbox.failed[self._failures_said :]:
            console.print(f"[red]MLflow refused a record[/red]: {failure}", soft_wrap=True)
        self._failures_said = len(self.tracker.outbox.failed)
        queued = len(self.tracker.outbox)
        if queued and not self._outage_said:
            console.print(
                f"[yellow]MLflow unreachable ({self.tracker.outbox.last_error}): {queued} "
                "records queued; the study goes on and they are written when it is back[/yellow]",
                soft_wrap=True,
            )
        elif not queued and self._outage_said:
            console.print("MLflow reachable again: the queued records are written")
        self._outage_said = bool(queued)

    def _check_refused(self) -> None:
        failed = self.tracker.outbox.failed
        if failed:
            raise TrackingIncomplete(
                f"MLflow refused {len(failed)} records of this worker (first: {failed[0]}); "
                "the study itself is complete in search.storage"
            )

    def _end_killed_runs(self, console: Console) -> None:
        """Trials whose worker died: their MLflow runs end as KILLED (once, by any worker)."""
        new = interrupted_numbers(self.study) - self._killed_seen
        if new:
            try:
                ended = self.tracker.end_killed_runs(new)
            except Exception as error:
                if not is_transient(error):
                    raise
                return  # MLflow is away: try again on the next pass
            for number in ended:
                console.print(f"#{number:<3} KILLED: its worker died; its parameters run again")
            self._killed_seen |= new

    def _close_tracking(self) -> None:
        outbox = self.tracker.outbox
        if not outbox.drain():
            wait_s = self.checked.settings.outage_wait_s
            self._outage_said = True
            self.console.print(
                f"[yellow]MLflow at {redact(self.tracker.tracking_uri)} is unreachable "
                f"({outbox.last_error}); waiting up to {wait_s:g} s to write {len(outbox)} "
                "queued records[/yellow]",
                soft_wrap=True,
            )
            if not self.tracker.close(wait_s):
                raise TrackingIncomplete(
                    f"{len(outbox)} MLflow records of this worker could not be written to "
                    f"{redact(self.tracker.tracking_uri)} ({outbox.last_error}); the study "
                    "itself is complete in search.storage. Raise mlflow.outage_wait_s to wait "
                    "longer."
                )
        self._say_tracking_state(self.console)
        self._check_refused()

    def interrupted(self, kind: str = "KeyboardInterrupt") -> None:
        """Ctrl-C or SIGTERM: the running trial's parameters are queued to run again (as a
        dead worker's are), the parent run ends KILLED, queued MLflow writes get a few
        seconds."""
        self._queue_again_interrupted()
        self.parent.update(self.study)
        self.results.publish(self.study)
        self.parent.log.finish("KILLED")
        if not self.tracker.close(INTERRUPT_WAIT_S):
            self.console.print(
                f"[yellow]{len(self.tracker.outbox)} MLflow records were not written "
                f"({self.tracker.outbox.last_error})[/yellow]"
            )
        stopped = "Terminated (SIGTERM)" if kind == "Terminated" else "Interrupted"
        self.console.print(
            f"[yellow]{stopped}.[/yellow] Finished trials are saved and the interrupted one "
            "is queued to run again; run the same command to resume the study."
        )

    def _queue_again_interrupted(self) -> None:
        number, self._current = self._current, None
        if number is None:
            return
        trial = self.study.get_trials(deepcopy=False)[number]
        if trial.state == TrialState.RUNNING:  # stopped before Optuna could tell it
            self.study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            trial = self.study._storage.get_trial(trial._trial_id)
        if trial.state == TrialState.FAIL and not counts_as_finished(trial):
            RetryStaleTrial()(self.study, trial)

    def storage_failed(self) -> None:
        """The study's storage failed (a full disk): nothing more is written to it. The
        running trial stays RUNNING there, and the next run of the study, seeing its owner
        gone, runs it again; its MLflow run and the parent run end KILLED."""
        number, self._current = self._current, None
        with contextlib.suppress(Exception):  # MLflow may be on the same full disk
            if number is not None:
                self.tracker.end_killed_runs({number})
            self.parent.log.finish("KILLED")
            self.tracker.close(INTERRUPT_WAIT_S)
