"""One run on several devices of one node (`trainer.strategy=ddp|fsdp`,
`trainer.devices=N`), launched by PyTorch's elastic launcher, one process per rank.

The process that calls `launch` (a study's worker, `python -m train`) stays where it is:
its hooks (the trial's time budget, pruner, MLflow logging) run there, fed by rank 0
through a queue, and what they answer reaches every rank through rank 0's collectives
(train/parallel/ranks.py). Only training is spread. Backends: nccl on CUDA (rank r on GPU r), gloo
on CPU (each rank with its share of the intra-op threads).

How a run ends:
- its result, global: throughput summed over the ranks (samples of all ranks over the
  slowest rank's seconds), peak memory the largest of any rank's (each rank's is kept);
- OutOfMemory naming the rank: the ranks' agreed memory check (CPU), or one rank's device
  OOM (it says so before it exits, and the launcher stops the others);
- Diverged, on every rank at once (the logged loss is the ranks' sum);
- what a hook raised (Prune, KeyboardInterrupt): the ranks stop at their next step;
- a rank that died (SIGKILL, a crash): the launcher sees it within its monitor interval,
  stops the others and this raises RankFailed with the rank, its exit code or error.
Every rank dies with the launching process, within milliseconds, whatever it is doing: it
asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG) before it imports
anything slow, and exits at once if its parent died before that (train/parallel/lifeline.py).
None is left behind, nor is multiprocessing's resource tracker, which ends when the last
process holding its pipe does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from batchfit.train.loop import Run, fit
from batchfit.train.measure.energy import Energy
from batchfit.train.measure.memory import MemoryStats, OutOfMemory
from batchfit.train.parallel.lifeline import die_with_parent, tied
from batchfit.train.step import Diverged, Hooks, RunResult

STOP_GRACE_S = 30.0  # after a stop is asked, how long the ranks have before they are killed


class _LauncherNoise(logging.Filter):
    """Drops two of the launcher's log records, which this module says better itself:
    - the warning that the launcher, on a child thread, cannot register signal handlers and
      "could lead to orphaned worker processes": it runs on one on purpose (this process
      keeps its own handlers), and the ranks die with this process on their own
      (train/parallel/lifeline.py);
    - a failed rank's traceback of the launcher's own wait ("failed (exitcode: -9) ...
      process 0 terminated with signal SIGKILL"): the run raises RankFailed naming the rank
      and how it ended, or, where this process stopped the ranks (a pruned trial), what
      stopped them; a rank's own traceback reaches the console from its stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return "running on a child thread" not in message and not message.startswith(
            "failed (exitcode"
        )


_ELASTIC_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_LAUNCHER_NOISE = _LauncherNoise()


class RankFailed(RuntimeError):
    """A rank of the run died or raised; the others were stopped."""


@dataclass
class _Job:
    """What each rank is given (pickled into its process)."""

    cfg: dict
    spec: Any  # train.run.RunSpec
    threads: int
    hooks: tuple[str, ...]  # which of the caller's hooks exist: every rank calls the same
    requests: Any  # rank -> caller
    replies: Any  # caller -> rank 0
    launcher: int  # the pid of the process that launches the ranks: their parent


def launch(
    cfg: DictConfig, spec: Any, hooks: Hooks | None = None, workload: Any = None
) -> RunResult:
    """Train `cfg` on spec.trainer.devices ranks; the caller's hooks run in this process
    (on_end gets the trained model built here from rank 0's full state dict, with
    `workload`'s data)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    hooks = hooks or Hooks()
    logging.getLogger(_ELASTIC_LOGGER).addFilter(_LAUNCHER_NOISE)  # once: a set
    world = spec.trainer.devices
    context = mp.get_context("spawn")
    job = _Job(
        OmegaConf.to_container(cfg, resolve=True),
        spec,
        max(1, torch.get_num_threads() // world) if spec.device.type == "cpu" else 1,
        tuple(name for name in vars(hooks) if getattr(hooks, name) is not None),
        context.Queue(),
        context.Queue(),
        os.getpid(),
    )
    logs = tempfile.mkdtemp(prefix="batchfit-ranks-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"batchfit-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port: several runs on one node do not meet
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.ALL, tee=Std.ERR),
    )
    done: dict[str, Any] = {}

    def launched() -> None:
        try:
            with tied():  # the ranks die with this process; spawned by this thread
                done["results"] = elastic_launch(config, _rank_main)(job)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = error

    # Not the main thread: the launcher then leaves this process's signal handlers alone.
    thread = threading.Thread(target=launched, name="batchfit-ranks", daemon=True)
    thread.start()
    served = _Serve(hooks, job.replies)
    try:
        while thread.is_alive():
            served.pump(job.requests, timeout=0.05)
            served.check_grace()
        thread.join()
    except BaseException as error:  # a signal in this process: stop the ranks, then go
        served.stop(error)
        thread.join(STOP_GRACE_S)
        served.kill()
        thread.join()
        raise
    finally:
        shutil.rmtree(logs, ignore_errors=True)  # a failure's message was read from it
    served.pump(job.requests, timeout=0)  # what the ranks said last
    return _ended(served, done, cfg, spec, hooks, workload)


class _Serve:
    """The caller's side of the ranks' hooks: runs them, and remembers what one raised."""

    def __init__(self, hooks: Hooks, replies: Any):
        self.hooks = hooks
        self.replies = replies
        self.raised: BaseException | None = None
        self.oom: OutOfMemory | None = None
        self.pids: dict[int, int] = {}
        self._stop_at: float | None = None

    def pump(self, requests: Any, timeout: float) -> None:
        while True:
            try:
                message = requests.get(timeout=timeout) if timeout else requests.get_nowait()
            except queue.Empty:
                return
            self._handle(*message)
            timeout = 0

    def _handle(self, kind: str, *args: Any) -> None:
        from batchfit.train.parallel.ranks import CONTINUE, END, STOP

        if kind == "pid":
            self.pids[args[0]] = args[1]
            return
        if kind == "oom":  # a device OOM on one rank: the launcher stops the others
            self.oom = args[0]
            return
        if kind == "eval":
            if self.raised is not None:
                self.replies.put(STOP)
                return
            try:
                ended = self.hooks.on_eval(*args) if self.hooks.on_eval else None
            except BaseException as error:  # noqa: BLE001 - the ranks stop; raised later
                self.stop(error)
                self.replies.put(STOP)
                return
            self.replies.put(END if ended else CONTINUE)
            return
        if self.raised is not None:
            return
        try:
            getattr(self.hooks, f"on_{kind}")(*args)
        except BaseException as error:  # noqa: BLE001 - as above
            self.stop(error)

    def stop(self, error: BaseException) -> None:
        """Ask the ranks to stop at their next step; `error` is raised when they have."""
        if self.raised is None:
            self.raised = error
            self.replies.put("stop")
            self._stop_at = time.monotonic()

    def check_grace(self) -> None:
        if self._stop_at is not None and time.monotonic() - self._stop_at > STOP_GRACE_S:
            self.kill()

    def kill(self) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _ended(
    served: _Serve, done: dict[str, Any], cfg: DictConfig, spec: Any, hooks: Hooks, workload: Any
) -> RunResult:
    if served.raised is not None:
        raise served.raised
    if served.oom is not None:
        raise served.oom
    error = done.get("error")
    if error is not None:
        raise RankFailed(_failure(error)) from None
    results: dict[int, dict] = done["results"]
    for rank in sorted(results):
        outcome = results[rank]
        if "oom" in outcome:
            raise outcome["oom"]
        if "diverged" in outcome:
            raise Diverged(*outcome["diverged"])
        if "stopped" in outcome:
            raise RankFailed(f"rank {rank} stopped without being asked to")
    result = _global(results)
    if hooks.on_end and "model_state" in results[0]:
        hooks.on_end(_model_of(cfg, spec, workload, results[0]["model_state"]))
    return result


def _failure(error: BaseException) -> str:
    """Which rank failed and how, from the launcher's ChildFailedError."""
    failures = getattr(error, "failures", None)
    if not failures:
        return f"{type(error).__name__}: {error}"
    rank, failure = min(failures.items())
    if failure.exitcode is not None and failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        how = f"died of {name} (exit code {failure.exitcode})"
    else:
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        lines = [line for line in str(message).strip().splitlines() if line.strip()]
        how = f"failed (exit code {failure.exitcode}): {lines[-1] if lines else 'no message'}"
    others = len(failures) - 1
    also = f"; {others} other rank(s) ended with it" if others else ""
    return f"rank {rank} of the data-parallel run {how}{also}"


def _global(results: dict[int, dict]) -> RunResult:
    """The run's figures over all ranks, from rank 0's result and every rank's own."""
    base: RunResult = results[0]["result"]
    ranks = [results[r]["figures"] for r in sorted(results)]
    energy = Energy.combine([f["energy"] for f in ranks])  # each counter once
    seconds = max(f["timed_seconds"] for f in ranks)
    samples = sum(f["timed_samples"] for f in ranks)
    return replace(
        base,
        num_samples=sum(f["num_samples"] for f in ranks),
        throughput_samples_per_sec=samples / seconds if seconds else math.nan,
        timed_samples=samples,
        timed_units=sum(f["timed_units"] for f in ranks),
        timed_seconds=seconds,
        peak_bytes=max(f["peak_bytes"] for f in ranks),
        reserved_bytes=None
        if base.reserved_bytes is None
        else max(f["reserved_bytes"] for f in ranks),
        rank_peak_bytes=[f["peak_bytes"] for f in ranks],
        interval_rates=[
            sum(rates) for rates in zip(*(f["interval_rates"] for f in ranks), strict=False)
        ],
        energy=energy,
        energy_note=energy.source if energy is not None else _unmeasured(ranks),
    )


def _unmeasured(ranks: list[dict]) -> str:
    """Why a data-parallel run has no joules: the first rank's reason that measured none."""
    notes = [f["energy_note"] for f in ranks if f["energy"] is None]
    return notes[0] if notes else "energy: no timed step"


def _model_of(cfg: DictConfig, spec: Any, workload: Any, state: dict) -> torch.nn.Module:
    """The model as one process builds it, with the trained weights."""
    from batchfit.train.build import build_model
    from batchfit.train.workload import Workloads

    workload = workload or Workloads().of(cfg)
    pipeline = workload.pipeline(torch.device("cpu"))
    model = build_model(cfg, pipeline, workload.task, spec.trainer.activation_checkpointing)
    model.load_state_dict(state)
    return model


# ----------------------------------------------------------------------------- each rank


def _rank_main(job: _Job) -> dict:
    """A rank's process: its exception is written for the launcher (`record`), which puts
    it in the ChildFailedError the caller turns into RankFailed."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_rank)(job)


def _rank(job: _Job) -> dict:
    die_with_parent(job.launcher)  # done already as the rank started (lifeline.py): a net
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job.requests.put(("pid", rank, os.getpid()))
    cuda = job.spec.device.type == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(job.threads)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        return _train_rank(job, rank, world, device)
    finally:
        dist.destroy_process_group()


def _train_rank(job: _Job, rank: int, world: int, device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from batchfit.train.batches import steps_plan
    from batchfit.train.build import build_model, build_optimizer, build_scheduler
    from batchfit.train.measure.memory import MemoryMeter
    from batchfit.train.parallel.ranks import Ranks, Stopped
    from batchfit.train.parallel.sharding import settled_collectives, shard
    from batchfit.train.workload import Workloads

    cfg, spec = OmegaConf.create(job.cfg), replace(job.spec, device=device)
    trainer = spec.trainer
    workload = Workloads().of(cfg)
    torch.manual_seed(trainer.seed)
    pipeline = workload.pipeline(device)
    model = build_model(cfg, pipeline, workload.task, trainer.activation_checkpointing, device)
    ranks = Ranks(rank, world, device)
    if trainer.strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        trained = ranks.wrapper = DistributedDataParallel(model, device_ids=ids)
    else:
        trained = shard(model, trainer.fsdp, init_device_mesh(device.type, (world,)))
    optimizer = build_optimizer(cfg, model.parameters(), spec.lr)
    _, num_steps = steps_plan(workload.num_train, trainer)
    scheduler = build_scheduler(cfg, optimizer, total_steps=num_steps)
    meter = MemoryMeter(device, spec.budget_bytes)
    hooks, proxy = _rank_hooks(job, ranks, model)
    settled = settled_collectives() if device.type == "cpu" else nullcontext()
    try:
        with settled:
            result = fit(Run(trained, optimizer, scheduler, pipeline, trainer, device, meter,
                             hooks, workload.task, ranks))  # fmt: skip
    except OutOfMemory as oom:
        if oom.rank is None:  # this rank's own device OOM: the others wait in a collective
            oom = OutOfMemory(
                f"rank {rank} of {world}: {oom}", oom.peak_bytes, oom.budget_bytes, rank
            )
            job.requests.put(("oom", oom))
            raise
        return {"oom": oom}
    except Diverged as diverged:
        return {"diverged": (diverged.step, diverged.loss)}
    except Stopped:
        return {"stopped": True}
    out: dict[str, Any] = {"figures": _rank_figures(result)}
    if rank == 0:
        out["result"] = result
        if proxy.model_state is not None:
            out["model_state"] = proxy.model_state
    return out


def _rank_figures(result: RunResult) -> dict:
    return {
        "num_samples": result.num_samples,
        "timed_samples": result.timed_samples,
        "timed_units": result.timed_units,
        "timed_seconds": result.timed_seconds,
        "peak_bytes": result.peak_bytes,
        "reserved_bytes": result.reserved_bytes,
        "interval_rates": result.interval_rates,
        "energy": result.energy,
        "energy_note": result.energy_note,
    }


class _Proxy:
    """Rank 0's end of the caller's hooks."""

    def __init__(self, job: _Job):
        self.job = job
        self.stopped = False
        self.model_state: Any = None

    def send(self, kind: str, *args: Any) -> None:
        self.job.requests.put((kind, *args))

    def stop_requested(self) -> bool:
        while not self.stopped:
            try:
                message = self.job.replies.get_nowait()
            except queue.Empty:
                break
            self.stopped = message == "stop"
        return self.stopped

    def on_eval(self, step: int, metrics: dict) -> int:
        from batchfit.train.parallel.ranks import STOP

        self.send("eval", step, metrics)
        while True:
            answer = self.job.replies.get()
            if answer == "stop":
                self.stopped = True
                continue
            return STOP if self.stopped else answer


def _rank_hooks(job: _Job, ranks: Any, model: torch.nn.Module) -> tuple[Hooks, _Proxy]:
    """Every rank has the hooks the caller has (probing, say, runs a forward and backward
    on every rank); rank 0's send to the caller, the others' do nothing, but what needs
    every rank (the memory statistics, the trained model's state) is gathered first."""
    proxy = _Proxy(job)
    lead = ranks.rank == 0
    if lead:
        ranks.stop_requested = proxy.stop_requested

    def memory(stats: MemoryStats) -> None:
        gathered = ranks.gather([stats.peak_bytes, stats.reserved_bytes or -1])
        reserved = max(r for _, r in gathered)
        worst = MemoryStats(max(p for p, _ in gathered), reserved if reserved >= 0 else None)
        if lead:
            proxy.send("memory", worst)

    def end(_trained: torch.nn.Module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # a collective for FSDP
        if lead:
            proxy.model_state = state

    def sender(kind: str) -> Any:
        return (lambda *args: proxy.send(kind, *args)) if lead else (lambda *args: None)

    hooks = Hooks()
    for name in job.hooks:
        kind = name.removeprefix("on_")
        if name == "on_eval":
            hooks.on_eval = proxy.on_eval if lead else (lambda step, metrics: None)
        elif name == "on_memory":
            hooks.on_memory = memory
        elif name == "on_end":
            hooks.on_end = end
        else:
            setattr(hooks, name, sender(kind))
    return hooks, proxy
