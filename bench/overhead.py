"""Overhead of batchfit's trial path against a plain hand-written PyTorch loop.

The same training (model, data, batch size, precision, optimizer, lr schedule, batch order,
number of optimizer steps) runs alternately, in one process:

- plain:    a hand-written loop over the same host tensors: index, copy to the device,
            forward, cross-entropy, backward, optimizer step, zero_grad(set_to_none=True);
- batchfit: one trial of a real study through `search.study.driver.StudyDriver` (the code behind
            `python -m search`): Optuna study in SQLite, MLflow parent and trial runs in
            SQLite, progress bar, every hook on (`train.loop.fit` with its probe, on_step,
            on_log, on_eval, CPU memory tracking).

Both time the same steps: batchfit leaves the first `trainer.warmup_steps` optimizer steps
out of its throughput, and on CPU also steps 0 and 1, which run under the memory tracker
(see `train.loop._fit`), and where a step has one micro-batch the gradient noise scale's
window of split steps (`train.loop.split_window`); the plain loop leaves out the same
steps. With accumulation the noise scale measures every timed step: its cost is in the
ratio (`-- trainer.accum_steps=2` shows it). Validation is not timed
in either. Throughput = timed samples / timed seconds; batchfit's is the trial's
`throughput` user attribute (`RunResult.throughput_samples_per_sec`).

    python bench/overhead.py                     # small_cnn, synthetic 3x32x32, 120 steps, 5 rounds
    python bench/overhead.py --repeats 9 --steps 200
    python bench/overhead.py --model resnet18 --batch-size 128 --steps 300   # on a GPU
    python bench/overhead.py -- trainer.log_every_steps=1 optimizer=adamw   # extra overrides

Prints each round's two throughputs and their ratio, then the median ratio batchfit/plain
against the target (default 0.97: batchfit within 3% of the plain loop). `--check` makes
the exit status 1 when the median is below the target.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import hydra
import optuna
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/overhead.py` from anywhere, installed or not
    sys.path.insert(0, str(REPO))

from batchfit.search.core.record import TrialRecord  # noqa: E402
from batchfit.search.study.driver import StudyDriver  # noqa: E402
from batchfit.tracking.metrics import TRAIN_FINAL_LOSS, TRAIN_LOSS  # noqa: E402
from batchfit.train.batches import steps_plan  # noqa: E402
from batchfit.train.build import build_model, build_optimizer, build_scheduler  # noqa: E402
from batchfit.train.loop import split_window  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.workload import Workload, Workloads  # noqa: E402

CONF_DIR = REPO / "conf"


@dataclass
class Measured:
    throughput: float  # timed samples / timed seconds
    num_steps: int  # optimizer steps in the whole run
    timed_steps: int
    timed_samples: int
    val_acc: float
    final_loss: float  # mean train loss over the last logging interval
    wall_s: float  # the whole run: build, train, validate (and, for batchfit, record)


def first_timed_step(num_steps: int, warmup_steps: int, device: torch.device) -> int:
    """The first optimizer step batchfit times: after `warmup_steps`, and on CPU after steps 0
    and 1, which it runs under the memory tracker (train/loop.py, `_fit`)."""
    measured = min(2, num_steps) if device.type != "cuda" else 0
    return min(max(warmup_steps, measured), num_steps - 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_run(cfg: DictConfig, workload: Workload) -> Measured:
    """The same training as a hand-written loop. Only the config is read through batchfit
    (`plan`: device, trainer settings, lr) and the same model/data builders are used, on the
    data `workload` built once (as a study's trials share theirs)."""
    wall = time.perf_counter()
    spec = plan(cfg, None)
    t, device = spec.trainer, spec.device
    torch.manual_seed(t.seed)  # as train.run.run: same model initialisation
    data = workload.data
    model = build_model(cfg, workload.pipeline(device), workload.task, t.activation_checkpointing)
    model = model.to(device)
    opt_cfg = cfg.optimizer
    if opt_cfg._target_ == "torch.optim.SGD":
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=spec.lr,
            momentum=opt_cfg.momentum,
            nesterov=opt_cfg.nesterov,
            weight_decay=opt_cfg.weight_decay,
        )
    else:  # another optimizer from conf/optimizer/: build it as batchfit does
        optimizer = build_optimizer(cfg, model.parameters(), spec.lr)
    num_train = len(data.train_y)
    steps_per_epoch, num_steps = steps_plan(num_train, t)
    # The same lr schedule (a LambdaLR: microseconds a step), so both train identically.
    scheduler = build_scheduler(cfg, optimizer, total_steps=num_steps)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)

    def autocast() -> contextlib.AbstractContextManager:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype)

    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = t.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = t.precision == "tf32"
    ebs = t.batch_size * t.accum_steps
    first_timed = first_timed_step(num_steps, t.warmup_steps, device)
    # batchfit runs its noise-scale window of split steps (train/measure/noise.py) off the clock too
    first_timed = split_window(t, num_steps, first_timed).stop or first_timed

    def evaluate() -> float:
        """Validation accuracy (never timed): where batchfit validates, so both runs see the
        same work between timed steps, and to check that both trained the same."""
        model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, len(data.val_y), t.batch_size):
                x = data.val_x[start : start + t.batch_size].to(device)
                y = data.val_y[start : start + t.batch_size].to(device)
                with autocast():
                    correct += int((model(x).argmax(dim=1) == y).sum())
        model.train()
        return correct / len(data.val_y)

    gen = torch.Generator().manual_seed(t.seed)
    seconds, val_acc = 0.0, math.nan
    loss_sum = torch.zeros((), device=device)
    interval, final_loss, timed_samples = 0, math.nan, 0
    gc.collect()  # batchfit's MemoryMeter.start() does the same before its loop
    model.train()
    started = None
    for step in range(num_steps):
        index_in_epoch = step % steps_per_epoch
        if index_in_epoch == 0:
            order = torch.randperm(num_train, generator=gen)
        if step == first_timed and started is None:
            _sync(device)
            started = time.perf_counter()
        idx = order[index_in_epoch * ebs : (index_in_epoch + 1) * ebs]
        for chunk in idx.split(t.batch_size):
            x = data.train_x[chunk].to(device, non_blocking=True)
            y = data.train_y[chunk].to(device, non_blocking=True)
            with autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, reduction="sum") / len(idx)
            scaler.scale(loss).backward()
            loss_sum += loss.detach()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        interval += 1
        if step >= first_timed:
            timed_samples += len(idx)
        if (step + 1) % t.log_every_steps == 0 or step + 1 == num_steps:
            final_loss = loss_sum.item() / interval  # a plain loop reads its loss now and then
            loss_sum.zero_()
            interval = 0
        last_step = step + 1 == num_steps
        end_of_epoch = index_in_epoch + 1 == steps_per_epoch
        due = t.val_every_steps and (step + 1) % t.val_every_steps == 0
        if (due if t.val_every_steps else end_of_epoch) or last_step:
            if started is not None:  # pause the clock
                _sync(device)
                seconds += time.perf_counter() - started
                started = None
            val_acc = evaluate()
            if step >= first_timed and not last_step:
                started = time.perf_counter()

    return Measured(
        throughput=timed_samples / seconds,
        num_steps=num_steps,
        timed_steps=num_steps - first_timed,
        timed_samples=timed_samples,
        val_acc=val_acc,
        final_loss=final_loss,
        wall_s=time.perf_counter() - wall,
    )


def batchfit_run(
    overrides: list[str], batch_size: int, study_name: str, tmp: Path, verbose: bool
) -> Measured:
    """One trial of a one-trial study, run by the same driver as `python -m search`."""
    wall = time.perf_counter()
    overrides = [
        *overrides,
        # A single-valued choice of the batch size already in use: the config stays the
        # same, and the trial samples and re-composes it as in a real study.
        f"++search.params={{trainer.batch_size:'choice({batch_size})'}}",
        f"search.study_name={study_name}",
        f"search.storage=sqlite:///{tmp}/optuna.db",
        f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db",
        f"mlflow.artifact_root={tmp}/artifacts",
    ]
    cfg = hydra.compose(config_name="config", overrides=overrides)
    searched = set(cfg.search.params)
    if searched != {"trainer.batch_size"}:
        raise SystemExit(
            f"search.params would search {sorted(searched - {'trainer.batch_size'})}: the bench "
            "compares one fixed configuration; drop them (e.g. do not use +experiment=resnet)"
        )
    # A terminal-like console, as a user's: the progress bar refreshes as it would on screen.
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    driver = StudyDriver.prepare(cfg, overrides, {}, console)
    driver.run()
    if verbose:
        print(out.getvalue())
    trial = driver.study.trials[-1]
    record = TrialRecord.of(trial)
    attrs = record.outcome
    assert trial.params == {"trainer.batch_size": batch_size}, trial.params
    if trial.state != optuna.trial.TrialState.COMPLETE or attrs.throughput is None:
        raise RuntimeError(f"the batchfit trial ended {trial.state.name}: {attrs.message}")
    # Read the numbers back from the MLflow run: tracking worked, and the run's step count.
    client = driver.tracker.client
    run_id = record.run_id
    metrics = client.get_run(run_id).data.metrics
    # The run's last step: where its curves (train/loss, logged per interval) end.
    num_steps = max(m.step for m in client.get_metric_history(run_id, TRAIN_LOSS))
    return Measured(
        throughput=attrs.throughput,
        num_steps=num_steps,
        timed_steps=attrs.timed_steps,
        timed_samples=attrs.timed_samples,
        val_acc=attrs.val_acc,
        final_loss=metrics[TRAIN_FINAL_LOSS],
        wall_s=time.perf_counter() - wall,
    )


def _cv(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Median throughput ratio of a batchfit trial to a plain PyTorch loop.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="small_cnn", help="conf/model/ option")
    p.add_argument("--data", default="synthetic", help="conf/data/ option")
    p.add_argument("--image-size", type=int, default=32, help="data.image_size (synthetic)")
    p.add_argument("--num-samples", type=int, default=4096, help="data.num_samples (synthetic)")
    p.add_argument("--batch-size", type=int, default=64, help="trainer.batch_size")
    p.add_argument("--precision", default="fp32", help="trainer.precision")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (trainer.max_steps)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of plain + batchfit")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    p.add_argument(
        "--warmup-runs", type=int, default=1, help="plain runs before the rounds, not counted"
    )
    p.add_argument("--target", type=float, default=0.97, help="minimum median ratio")
    p.add_argument("--check", action="store_true", help="exit 1 when below the target")
    p.add_argument("--verbose", action="store_true", help="show the study driver's output")
    p.add_argument("--keep", action="store_true", help="keep the temporary MLflow/Optuna stores")
    p.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides, applied last (trainer.accum_steps=2)"
    )
    return p.parse_args(argv)


def bench_overrides(args: argparse.Namespace) -> list[str]:
    overrides = [
        f"model={args.model}",
        f"data={args.data}",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.precision={args.precision}",
        f"trainer.max_steps={args.steps}",
        "trainer.max_epochs=1000",  # the step budget ends the run
        # One trial, nothing that could stop it early or differ between rounds.
        "search.n_trials=1",
        "search.memory_budget=null",
        "search.trial_time_budget_s=null",
        "search.heartbeat_interval_s=null",
    ]
    if args.data == "synthetic":
        overrides += [f"data.image_size={args.image_size}", f"data.num_samples={args.num_samples}"]
    return overrides + list(args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = bench_overrides(args)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="batchfit-bench-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[tuple[Measured, Measured]] = []
    try:
        with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra.compose(config_name="config", overrides=overrides)
            spec = plan(cfg, None)
            workload = Workloads().of(cfg)
            data = workload.data
            print(
                f"bench: model={args.model} data={args.data} "
                f"{tuple(data.train_x.shape[1:])} train={len(data.train_y)} "
                f"batch={spec.trainer.batch_size}x{spec.trainer.accum_steps} "
                f"precision={spec.trainer.precision} steps={args.steps} device={spec.device} "
                f"threads={torch.get_num_threads()} torch={torch.__version__}"
            )
            print(f"overrides: {' '.join(overrides)}")
            print(f"stores: {tmp}")
            # One-time costs inside a timed region (kernel selection for a shape first seen
            # there, e.g. a ragged last batch) would fall on whichever run comes first.
            for _ in range(args.warmup_runs):
                warm = plain_run(cfg, workload)
                print(f"warm-up (not counted): plain {warm.throughput:8.1f} samples/s")
            for r in range(args.repeats):
                # Alternate which runs first, so a drift in machine speed hits both alike.
                order = ("plain", "batchfit") if r % 2 == 0 else ("batchfit", "plain")
                got: dict[str, Measured] = {}
                for kind in order:
                    if kind == "plain":
                        got[kind] = plain_run(cfg, workload)
                    else:
                        name = f"bench-{stamp}-r{r}"
                        got[kind] = batchfit_run(
                            overrides, spec.trainer.batch_size, name, tmp, args.verbose
                        )
                plain, fit = got["plain"], got["batchfit"]
                rows.append((plain, fit))
                print(
                    f"round {r + 1}/{args.repeats} ({order[0]} first): "
                    f"plain {plain.throughput:8.1f} samples/s | "
                    f"batchfit {fit.throughput:8.1f} samples/s | "
                    f"ratio {fit.throughput / plain.throughput:.3f} | "
                    f"wall plain {plain.wall_s:.1f} s, batchfit trial {fit.wall_s:.1f} s"
                )
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    plain, fit = rows[0]
    print(
        f"timed per run: plain {plain.timed_steps} steps / {plain.timed_samples} samples of "
        f"{plain.num_steps}; batchfit {fit.timed_steps} steps / {fit.timed_samples} samples "
        f"of {fit.num_steps}"
    )
    mismatched = [
        i + 1
        for i, (p, f) in enumerate(rows)
        if (p.num_steps, p.timed_steps, p.timed_samples)
        != (f.num_steps, f.timed_steps, f.timed_samples)
    ]
    if mismatched:
        print(f"WARNING: timed steps/samples differ in rounds {mismatched}")
    first = (plain.val_acc, plain.final_loss)
    same = all((m.val_acc, m.final_loss) == first for row in rows for m in row)
    print(
        f"same training: {'yes, identical' if same else 'NOT identical'} results: val acc plain "
        + ", ".join(f"{p.val_acc:.4f}" for p, _ in rows)
        + " | batchfit "
        + ", ".join(f"{f.val_acc:.4f}" for _, f in rows)
        + f"; final train loss plain {plain.final_loss:.5f} batchfit {fit.final_loss:.5f}"
        + ("" if same else " (nondeterministic kernels, or the runs differ)")
    )
    ratios = [f.throughput / p.throughput for p, f in rows]
    median = statistics.median(ratios)
    plain_median = statistics.median(p.throughput for p, _ in rows)
    fit_median = statistics.median(f.throughput for _, f in rows)
    print(
        f"median throughput: plain {plain_median:.1f} samples/s, batchfit {fit_median:.1f} "
        f"samples/s; ratios min {min(ratios):.3f} max {max(ratios):.3f}"
    )
    spread = max(_cv([p.throughput for p, _ in rows]), _cv([f.throughput for _, f in rows]))
    if spread > 1 - args.target:
        print(
            f"note: run-to-run spread (coefficient of variation) is {100 * spread:.1f}%, more "
            f"than the {100 * (1 - args.target):.0f}% being tested: the machine is noisy; more "
            "--steps and --repeats narrow the median"
        )
    ok = median >= args.target
    print(
        f"verdict: {'PASS' if ok else 'FAIL'}: batchfit is "
        f"{'within' if ok else 'not within'} {100 * (1 - args.target):.0f}% of the plain loop"
    )
    print(f"median throughput ratio batchfit/plain: {median:.3f} (target >= {args.target:.2f})")
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
