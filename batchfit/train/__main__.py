"""One training run, the same code path as a search trial, logged to MLflow as a plain run:

    python -m train +experiment=resnet data=digits trainer.batch_size=64 \
        trainer.accum_steps=2 trainer.precision=bf16 optimizer.lr=0.05

or the configuration a study recommends, from its best.yaml (more overrides may follow); the
run then goes to the study's MLflow experiment, named and tagged after the trial it retrains:

    python -m train +best=mlruns/hydra/2026-11-30/14-03-12/best.yaml

compose (Hydra) -> validate -> predict (a run predicted not to fit search.memory_budget is
refused, as a trial is pruned; search.preflight=false trains it anyway) -> run -> report and
save the model (MLflow artifact model/model.pt, and `+save=PATH` when given;
train/model_file.py reads it back).
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse
from urllib.request import url2pathname

import hydra
import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape  # messages carry [...]: not markup

from batchfit.common.checks import ConfigError
from batchfit.common.console import config_error, crashed
from batchfit.common.overrides import (
    BEST_KEY,
    CONF,
    composed,
    load_overrides,
    merge_overrides,
    override_key,
    run_entry_point,
    unknown_top_level,
)
from batchfit.common.redact import redact, redact_logging, redact_tree
from batchfit.tracking.metrics import (
    DATA_WAIT_SHARE,
    THROUGHPUT_PREFIX,
    THROUGHPUT_SPREAD,
    VAL_PREFIX,
)
from batchfit.tracking.mlflow_config import MlflowConfig
from batchfit.tracking.mlflow_setup import http_defaults, quiet_logging
from batchfit.tracking.outputs import cannot_create
from batchfit.tracking.runs import RunLog, Tracker
from batchfit.tracking.tags import (
    DIVERGED,
    OOM,
    PRUNE_REASON_TAG,
    ROLE_TAG,
    STATE_TAG,
    STUDY_TAG,
    TRIAL_TAG,
)
from batchfit.train import model_file
from batchfit.train.batches import larger_than_data
from batchfit.train.build import unimportable_targets
from batchfit.train.config import RunSpec
from batchfit.train.device.sizes import format_bytes
from batchfit.train.measure.energy import ENERGY_TAG
from batchfit.train.measure.flops import MFU_NOTE_TAG
from batchfit.train.measure.memory import OutOfMemory
from batchfit.train.measure.noise import NOISE_TAG
from batchfit.train.memory.predict import Prediction
from batchfit.train.memory.preflight import PreflightConfig
from batchfit.train.parallel.threads import KEY as THREADS_KEY
from batchfit.train.parallel.threads import Threads, plan_threads
from batchfit.train.params import lever_params, lever_words
from batchfit.train.plan import plan, planned_elsewhere, with_gpu_budget
from batchfit.train.run import Planned, Trained, check_builds
from batchfit.train.step import Diverged, Hooks
from batchfit.train.workload import Workload, Workloads

# The entry point is the composition root: it wires MLflow (tracking.runs) to the training
# loop's hooks. The train/ library modules themselves know nothing of MLflow.

T = TypeVar("T")
SAVE_KEY = "save"  # python -m train +save=PATH: the trained model's file (train/model_file.py)
SEARCHPATH_KEY = "hydra.searchpath"
EXPERIMENT = "train"  # the MLflow experiment of runs that retrain no study's trial


@dataclass(frozen=True)
class Retrain:
    """The trial a +best=PATH run trains again: best.yaml's `study` and `trial`."""

    study: str
    trial: int
    path: str


@dataclass(frozen=True)
class Prepared:
    """A run validated, predicted to fit, and its MLflow store reached: ready to train."""

    planned: Planned  # the run planned and predicted (train/run.py), ready to train
    overrides: list[str]  # that composed its cfg (best.yaml's, then the command line's)
    retrain: Retrain | None
    save_path: Path | None
    tracker: Tracker

    @property
    def cfg(self) -> DictConfig:
        return self.planned.cfg

    @property
    def spec(self) -> RunSpec:
        return self.planned.spec

    @property
    def workload(self) -> Workload:
        return self.planned.workload

    @property
    def prediction(self) -> Prediction | None:
        return self.planned.prediction


@hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    composed()
    redact_logging()
    http_defaults()
    quiet_logging()
    console, errors = Console(), Console(stderr=True)
    try:
        ready = _prepare(cfg, console)
    except ConfigError as error:
        config_error(errors, error)
    except Exception as error:  # escaping, Hydra would print the overrides, passwords and all
        what = f"{type(error).__name__} while preparing it (above); nothing was trained"
        crashed(errors, "The run failed", what)
    try:
        log = _start_run(ready)
    except Exception as error:
        crashed(errors, "The run failed", f"{type(error).__name__} starting its MLflow run (above)")
    console.print(_training_line(ready, log.run_id), soft_wrap=True)
    trained, model = _fit_logged(ready, log, console, errors)
    try:
        figures = _logged_figures(log, trained, console)
        where = _save(ready, log, model)
    except Exception as error:
        log.finish("FAILED")
        crashed(errors, "The run failed", f"{type(error).__name__} after training (above)")
    log.tags({STATE_TAG: "COMPLETE"})
    log.finish()
    ready.tracker.outbox.drain()  # the artifact written: its path is one to open
    name = f"{model_file.ARTIFACT_PATH}/{model_file.FILE_NAME}"
    console.print(
        f"Model saved: {_artifact_location(log)}{where} (the run's MLflow artifact {name}; "
        "train/model_file.py loads it)",
        soft_wrap=True,
    )
    console.print(figures, soft_wrap=True)  # last: the run's figures


def _prepare(cfg: DictConfig, console: Console) -> Prepared:
    """Compose, validate, predict and refuse what does not fit; every problem a ConfigError."""
    retrain = None
    given = HydraConfig.get().overrides
    # What composed cfg, for the saved model: the task's overrides, after the search path's
    # (a user's config groups; hydra.* overrides are kept apart from the task's).
    overrides = [o for o in given.hydra if override_key(o) == SEARCHPATH_KEY] + list(given.task)
    problems = unknown_top_level(cfg, overrides, own=(BEST_KEY, SAVE_KEY))
    if problems:
        raise ConfigError(problems)
    if BEST_KEY in cfg:
        cfg, overrides, retrain = _recommended(cfg, console)
    overrides = with_gpu_budget(cfg, overrides)  # search.gpu=CARD: the card's budget
    threads = plan_threads(cfg.search.threads, 1)  # first, before any torch work
    threads.apply()
    console.print(_threads_line(threads), soft_wrap=True)
    problems: list[str] = []  # of every section at once
    spec = _collected(problems, lambda: plan(cfg, cfg.search.memory_budget))
    mlflow = OmegaConf.to_container(cfg.mlflow, resolve=True)
    _collected(problems, lambda: MlflowConfig.from_mapping(mlflow))
    preflight = _collected(
        problems, lambda: PreflightConfig(cfg.search.preflight, cfg.search.preflight_margin)
    )
    save_path = _collected(problems, lambda: _save_path(cfg))
    elsewhere = planned_elsewhere(spec) if spec is not None else None
    problems += [elsewhere] if elsewhere else []
    if problems:
        raise ConfigError(problems)
    planned = _preflight(cfg, spec, preflight, console, Workloads())
    experiment = retrain.study if retrain else EXPERIMENT
    tracker = Tracker.from_config(cfg.mlflow, experiment)
    return Prepared(planned, overrides, retrain, save_path, tracker)


def _threads_line(threads: Threads) -> str:
    """The threads this run uses, and the key that sets them: `python -m train` reads the
    study's search.threads, and has no workers to share the cores with."""
    cores = f"{threads.num_cores} core{'s' * (threads.num_cores != 1)}"
    count = f"{threads.num_threads} intra-op thread{'s' * (threads.num_threads != 1)}"
    if threads.setting is not None:
        return f"torch: {count} ({THREADS_KEY}={threads.setting}; {cores} usable)"
    busy = ""
    if threads.num_threads < threads.num_cores:
        busy = f", {threads.busy:.1f} busy with other processes"
    return (
        f"torch: {count} ({cores} usable by this process{busy}); override with "
        f"{THREADS_KEY}=N, which python -m train reads too"
    )


def _collected(problems: list[str], check: Callable[[], T]) -> T:
    """check(), its ConfigError's problems added to `problems` (and None returned)."""
    try:
        return check()
    except ConfigError as error:
        problems += error.problems
        return None  # type: ignore[return-value]  # unused: the problems are raised


def _preflight(
    cfg: DictConfig,
    spec: RunSpec,
    preflight: PreflightConfig,
    console: Console,
    workloads: Workloads,
) -> Planned:
    """The run planned and its step predicted, once data and model build; a ConfigError,
    with what fits instead, when it is over the budget by a trial's rule
    (train/memory/preflight.py, as search/trial/trial_config.py applies it), unless
    search.preflight=false. A model that cannot be predicted has its memory measured."""
    note = check_builds(cfg, spec, workloads)
    workload = workloads.of(cfg)
    larger = larger_than_data(spec.trainer, workload.num_train, workload.data_named)
    if larger:
        raise ConfigError([larger])
    planned = Planned.of(cfg, spec, workloads)
    if planned.unsupported is not None:
        note = (
            f"memory is not predicted for this model ({planned.unsupported}); it is measured "
            "as it trains"
        )
    if note:
        console.print(f"[yellow]note[/yellow] {escape(note)}", soft_wrap=True)
    found = planned.misfit(preflight.preflight_margin)
    if found is not None and preflight.preflight:
        raise ConfigError([found.message()])
    if found is not None:
        console.print(
            f"[yellow]note[/yellow] {escape(found.describe())}; trained anyway, as "
            "search.preflight=false says",
            soft_wrap=True,
        )
    return planned


def _recommended(cfg: DictConfig, console: Console) -> tuple[DictConfig, list[str], Retrain | None]:
    """The config of +best=PATH: the file's overrides (config search path included), then
    the command line's other overrides, which win; and the study's trial it retrains."""
    path = str(cfg[BEST_KEY])
    task = [o for o in HydraConfig.get().overrides.task if override_key(o) != BEST_KEY]
    overrides = merge_overrides(load_overrides(path), task)
    try:
        composed = hydra.compose(config_name="config", overrides=overrides)
    except HydraException as error:
        raise ConfigError([f"{BEST_KEY}={path}: its overrides do not compose: {error}"]) from None
    document = yaml.safe_load(Path(path).expanduser().read_text())  # load_overrides read it
    unimportable = unimportable_targets(composed)
    if unimportable:  # a study of one's own modules, retrained from another directory
        ran_in = document.get("working_dir")
        where = (
            f"the study that wrote it ran in {ran_in}: run there (cd {shlex.quote(ran_in)} && "
            f"python -m train +{BEST_KEY}={shlex.quote(str(Path(path).expanduser().resolve()))})"
            if isinstance(ran_in, str)
            else "run it from the directory the study ran in"
        )
        raise ConfigError([*unimportable, f"{BEST_KEY}={path}: {where}"])
    study, trial = document.get("study"), document.get("trial")
    if not isinstance(study, str) or isinstance(trial, bool) or not isinstance(trial, int):
        console.print(
            f"[yellow]note[/yellow] {BEST_KEY}={path} names no study and trial (keys study: "
            f"and trial:); the run goes to MLflow experiment {EXPERIMENT!r}",
            soft_wrap=True,
        )
        return composed, overrides, None
    return composed, overrides, Retrain(study, trial, path)


def _save_path(cfg: DictConfig) -> Path | None:
    """+save=PATH, checked before training: a file that can be written."""
    value = cfg.get(SAVE_KEY)
    if value is None:
        return None
    fix = f"give a file path, e.g. +{SAVE_KEY}=models/run.pt"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError([f"{SAVE_KEY}={value!r} is not a path; {fix}"])
    path = Path(value).expanduser()
    if path.is_dir():
        raise ConfigError([f"{SAVE_KEY}={value!r} is a directory; {fix} inside it"])
    reason = cannot_create(path.parent)
    if reason is not None:
        raise ConfigError([f"{SAVE_KEY}={value!r} cannot be written ({reason}); {fix}"])
    return path


def _geometry(spec: RunSpec, cfg: DictConfig) -> str:
    """'4x1 fp32 · seq 256 · LoRA r16 · nf4': the batch geometry and the levers it has."""
    t = spec.trainer
    return " · ".join(
        [f"{t.batch_size}x{t.accum_steps} {t.precision}", *lever_words(lever_params(cfg))]
    )


def _start_run(ready: Prepared) -> RunLog:
    tags: dict[str, object] = {ROLE_TAG: "train"}
    name = _geometry(ready.spec, ready.cfg)
    retrain = ready.retrain
    if retrain is not None:
        tags.update({STUDY_TAG: retrain.study, TRIAL_TAG: retrain.trial})
        name = f"retrain trial-{retrain.trial} of {retrain.study} · {name}"
    log = ready.tracker.start_run(name, tags=tags)
    if retrain is not None:
        log.description(
            f"Trains trial {retrain.trial} of study `{retrain.study}` again, from "
            f"`{retrain.path}` (`python -m train +{BEST_KEY}={retrain.path}`)."
        )
    log.params({**ready.spec.params(), **lever_params(ready.cfg), **ready.workload.data_params()})
    log.text(OmegaConf.to_yaml(ready.cfg, resolve=True), "config.yaml")
    return log


def _lr(spec: RunSpec) -> str:
    """The rate trained with, and where it comes from."""
    t = spec.trainer
    rule = spec.lr_rule if t.lr_scaling != "auto" else f"{spec.lr_rule} (auto: the optimizer's)"
    if spec.lr_rule == "none" or spec.lr_ref == t.global_batch_size:
        return f"lr {spec.lr:.4g} (optimizer.lr, used as given: trainer.lr_scaling={rule})"
    return (
        f"lr {spec.lr:.4g} (optimizer.lr={spec.base_lr:g} scaled {rule} to "
        f"{'global' if t.distributed else 'effective'} batch {t.global_batch_size} from "
        f"trainer.lr_ref_batch_size={spec.lr_ref})"
    )


def _training_line(ready: Prepared, run_id: str | None) -> str:
    spec, prediction = ready.spec, ready.prediction
    t = spec.trainer
    where = f"MLflow run {run_id}"
    if ready.retrain is not None:
        where += f" in experiment {ready.retrain.study!r}"
    on = f"{spec.device}"
    if t.distributed:
        on = f"{t.devices} x {spec.device.type} ({t.strategy}, one process each)"
    per_device = f" per device, global batch {t.global_batch_size}" if t.distributed else ""
    return (
        f"Training on {on}: batch {t.batch_size} x {t.accum_steps} = "
        f"{t.effective_batch_size}{per_device}, {t.precision}, {_lr(spec)}"
        + (f", predicted peak {format_bytes(prediction.peak_bytes)}" if prediction else "")
        + f"; {where}"
    )


def _fit_logged(
    ready: Prepared, log: RunLog, console: Console, errors: Console
) -> tuple[Trained, torch.nn.Module]:
    """Train with the loop's hooks logging to the run; a failure ends the run and the process."""

    def on_eval(step: int, metrics: dict) -> None:
        log.validation(step, metrics)
        values = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith(VAL_PREFIX))
        console.print(f"step {step} epoch {metrics['epoch']:.2f}: {values}")

    trained: list[torch.nn.Module] = []
    hooks = Hooks(
        on_log=lambda step, metrics: log.metrics(metrics, step),
        on_eval=on_eval,
        on_end=trained.append,
    )
    try:
        with ready.tracker.system_metrics(log.run_id):
            done = ready.planned.train(hooks)
            return done, trained[0]
    except (OutOfMemory, Diverged) as error:
        reason = OOM if isinstance(error, OutOfMemory) else DIVERGED
        log.tags({STATE_TAG: "PRUNED", PRUNE_REASON_TAG: reason})
        log.finish("FAILED")
        errors.print(f"[bold red]{reason}[/bold red]: {escape(redact(str(error)))}")
        sys.exit(1)
    except ConfigError as error:
        log.finish("FAILED")
        config_error(errors, error)
    except Exception as error:
        log.finish("FAILED")
        crashed(errors, "The run failed", f"{type(error).__name__} while training (above)")
    except BaseException:
        log.finish("FAILED")
        raise


def _logged_figures(log: RunLog, trained: Trained, console: Console) -> str:
    """The run's final figures, logged; and as one line to print."""
    result, mfu_note = trained.result, trained.mfu_note
    if mfu_note:
        log.tags({MFU_NOTE_TAG: mfu_note})
        console.print(f"[yellow]note[/yellow] {escape(mfu_note)}", soft_wrap=True)
    log.tags({NOISE_TAG: result.noise_estimator, ENERGY_TAG: result.energy_note})
    if result.energy is None:  # why not, once: never a zero
        console.print(f"[yellow]note[/yellow] {escape(result.energy_note)}", soft_wrap=True)
    log.end_figures({**trained.metrics, **trained.memory, **trained.perf}, result.num_steps)
    figures = trained.figures
    spread = figures.get(THROUGHPUT_SPREAD)
    steady = "" if spread is None else f" (±{spread / 2:.0%})"  # over the logging intervals
    speeds = [
        f"{v:.0f} {k.split('/')[1].removesuffix('_per_sec')}/s{steady}"
        for k, v in figures.items()
        if k.startswith(THROUGHPUT_PREFIX) and k.endswith("_per_sec")
    ]
    return " | ".join(
        [
            *(f"{k} {v:.4f}" for k, v in result.val.items()),
            *speeds,
            f"{result.step_ms:.0f} ms/step",
            f"waiting for data {figures.get(DATA_WAIT_SHARE, 0):.0%}",
            f"peak {format_bytes(result.peak_bytes)}",
        ]
    )


def _save(ready: Prepared, log: RunLog, model: torch.nn.Module) -> str:
    """The trained model as the run's artifact and at +save=PATH; where it went."""
    saved = model_file.to_bytes(
        model, redact(OmegaConf.to_yaml(ready.cfg, resolve=True)), redact_tree(ready.overrides)
    )
    log.artifacts({model_file.FILE_NAME: saved}, model_file.ARTIFACT_PATH)
    where = ""
    if ready.save_path is not None:
        ready.save_path.parent.mkdir(parents=True, exist_ok=True)
        ready.save_path.write_bytes(saved)
        where += f" and {ready.save_path}"
    return where


def _artifact_location(log: RunLog) -> str:
    """Where the run's model artifact is: a path to open where the artifact store is a local
    directory (relative to the working directory when under it), its URI otherwise."""
    name = f"{model_file.ARTIFACT_PATH}/{model_file.FILE_NAME}"
    try:
        root = log.client.get_run(log.run_id).info.artifact_uri
    except Exception:  # noqa: BLE001 - the store is away: the run and the name still say it
        return f"MLflow run {log.run_id}"
    parsed = urlparse(root)
    if parsed.scheme not in ("", "file"):
        return f"{root.rstrip('/')}/{name}"
    path = Path(url2pathname(parsed.path)) / name
    with contextlib.suppress(ValueError):
        path = path.relative_to(Path.cwd())
    return str(path)


if __name__ == "__main__":
    run_entry_point(main)
