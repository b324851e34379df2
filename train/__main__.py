"""One training run, the same code path as a search trial, logged to MLflow as a plain run:

    python -m train +experiment=resnet data=digits trainer.batch_size=64 \
        trainer.accum_steps=2 trainer.precision=bf16 optimizer.lr=0.05

or the configuration a study recommends, from its best.yaml (more overrides may follow):

    python -m train +best=mlruns/hydra/2026-11-30/14-03-12/best.yaml

compose (Hydra) -> validate -> run -> report. `search.memory_budget` applies here too.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape  # messages carry [...]: not markup

from tracking.redact import redact_logging
from tracking.runs import (
    ROLE_TAG,
    STATE_TAG,
    MlflowConfig,
    Tracker,
    http_defaults,
    quiet_logging,
)
from train.config import ConfigError
from train.flops import MFU_NOTE_TAG, perf_metrics
from train.loop import Diverged, Hooks
from train.memory import OutOfMemory, format_bytes
from train.overrides import BEST_KEY, load_overrides, merge_overrides, override_key
from train.predict import PredictionUnsupported
from train.run import check_builds, data_params, memory_predictor, plan, predict, run
from train.threads import plan_threads

# The entry point is the composition root: it wires MLflow (tracking.runs) to the training
# loop's hooks. The train/ library modules themselves know nothing of MLflow.


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    redact_logging()
    http_defaults()
    quiet_logging()
    console, errors = Console(), Console(stderr=True)
    try:
        if BEST_KEY in cfg:
            cfg = _recommended(cfg)
        threads = plan_threads(cfg.search.threads, 1)  # first, before any torch work
        threads.apply()
        console.print(threads.describe(), soft_wrap=True)
        spec = plan(cfg, cfg.search.memory_budget)
        MlflowConfig.from_mapping(OmegaConf.to_container(cfg.mlflow, resolve=True))
        note = check_builds(cfg, spec)
    except ConfigError as error:
        errors.print(
            f"[bold red]Configuration error[/bold red]\n{escape(str(error))}", soft_wrap=True
        )
        sys.exit(2)
    prediction = None
    try:
        prediction = predict(cfg, spec)
    except PredictionUnsupported as error:
        note = f"memory is not predicted for this model ({error}); it is measured as it trains"
    if note:
        console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
    tracker = Tracker.from_config(cfg.mlflow, "train")
    log = tracker.start_run("train", tags={ROLE_TAG: "train"})
    log.params({**spec.params(), **data_params(cfg)})
    log.text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
    console.print(
        f"Training on {spec.device}: batch {spec.trainer.batch_size} x {spec.trainer.accum_steps} "
        f"= {spec.trainer.effective_batch_size}, {spec.trainer.precision}, lr {spec.lr:.4g}"
        + (f", predicted peak {format_bytes(prediction.peak_bytes)}" if prediction else "")
        + f"; MLflow run {log.run_id}",
        soft_wrap=True,
    )

    def on_eval(step: int, metrics: dict) -> None:
        log.metrics({k: v for k, v in metrics.items() if "/" in k}, step, flush=True)
        values = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("val/"))
        console.print(f"step {step} epoch {metrics['epoch']:.2f}: {values}")

    hooks = Hooks(on_log=lambda step, metrics: log.metrics(metrics, step), on_eval=on_eval)
    failure = None
    try:
        with tracker.system_metrics(log.run_id):
            result = run(cfg, spec, hooks)
    except (OutOfMemory, Diverged) as error:
        failure = ("oom" if isinstance(error, OutOfMemory) else "diverged", str(error))
    except ConfigError as error:
        log.finish("FAILED")
        errors.print(
            f"[bold red]Configuration error[/bold red]\n{escape(str(error))}", soft_wrap=True
        )
        sys.exit(2)
    except BaseException:
        log.finish("FAILED")
        raise
    if failure:
        log.tags({STATE_TAG: "PRUNED", "batchfit.prune_reason": failure[0]})
        log.finish("FAILED")
        errors.print(f"[bold red]{failure[0]}[/bold red]: {escape(failure[1])}")
        sys.exit(1)
    extra = {"memory/budget_bytes": spec.budget_bytes} if spec.budget_bytes else {}
    if prediction is not None:
        measured = result.reserved_bytes or result.peak_bytes
        extra["memory/predicted_bytes"] = prediction.peak_bytes
        extra["memory/prediction_error"] = (prediction.peak_bytes - measured) / measured
    try:  # MFU, from the FLOPs the predictor's fake model counts (train/flops.py)
        flops = memory_predictor(cfg, spec).flops_per_sample(spec.trainer.batch_size)
        perf, mfu_note = perf_metrics(
            flops,
            result.throughput_samples_per_sec,
            spec.device,
            spec.trainer.precision,
            spec.trainer.peak_flops,
        )
        extra.update(perf)
        if mfu_note:
            log.tags({MFU_NOTE_TAG: mfu_note})
            console.print(f"[yellow]note[/yellow] {escape(mfu_note)}", soft_wrap=True)
    except PredictionUnsupported:
        pass
    log.metrics({**result.metrics(), **extra}, step=result.num_steps)
    log.tags({STATE_TAG: "COMPLETE"})
    log.finish()
    figures = result.figures()
    speeds = [
        f"{v:.0f} {k.split('/')[1].removesuffix('_per_sec')}/s"
        for k, v in figures.items()
        if k.startswith("throughput/")
    ]
    console.print(
        " | ".join(
            [
                *(f"{k} {v:.4f}" for k, v in result.val.items()),
                *speeds,
                f"{result.step_ms:.0f} ms/step",
                f"waiting for data {figures.get('time/data_wait_share', 0):.0%}",
                f"peak {format_bytes(result.peak_bytes)}",
            ]
        ),
        soft_wrap=True,
    )


def _recommended(cfg: DictConfig) -> DictConfig:
    """The config of +best=PATH: the file's overrides (config search path included), then
    the command line's other overrides, which win."""
    task = [o for o in HydraConfig.get().overrides.task if override_key(o) != BEST_KEY]
    overrides = merge_overrides(load_overrides(cfg[BEST_KEY]), task)
    try:
        return hydra.compose(config_name="config", overrides=overrides)
    except HydraException as error:
        raise ConfigError(
            [f"{BEST_KEY}={cfg[BEST_KEY]}: its overrides do not compose: {error}"]
        ) from None


if __name__ == "__main__":
    main()
