"""Peak-memory prediction: a training step computed on fake tensors, before anything is allocated.

The model is built once under a FakeTensorMode (shape, dtype and device, no storage: a model
of any size costs its module objects); one step on fake gradients gives the optimizer its
state. A prediction then runs `optimizer_step` (train/step.py, the step `fit` runs) on fake
micro-batches of the run's sizes, under the `TensorMemoryTracker` that measures CPU runs. On
CPU, prediction and measurement are therefore the same accounting. For CUDA (a DeviceSpec of
train/device/spec.py: this machine's GPU, or one named by search.gpu that it may not have) the
step runs on fake CPU tensors as CUDA runs it (train/memory/cuda_emulation.py: autocast policy,
attention kernels; here: the optimizer's foreach implementation), and its allocations are
replayed through the caching allocator's model (train/memory/reserve.py, allocator.py).

Only the steady-state step is computed: a full-size step with optimizer state in place (step 0
holds the same tensors less that state; `fit` measures this step too, see `memory_steps`). Of
its micro-batches only the first two run: from the second on, each starts from the same state
(gradients allocated, the previous logits alive), and a short last micro-batch peaks lower.
Steps already computed answer others where they can (train/memory/step_events.py); the largest
micro-batch that fits a budget is searched by train/memory/fitting.py.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from batchfit.train.config import TrainerConfig
from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.device.cudnn_workspaces import Calls, CudnnWorkspaces
from batchfit.train.device.spec import DeviceSpec, device_spec
from batchfit.train.language.hf import eager_on_fakes
from batchfit.train.language.quantize import cuda_card
from batchfit.train.measure.flops import count_flops
from batchfit.train.measure.memory import MemoryStats, TensorMemoryTracker
from batchfit.train.memory.cuda_emulation import CudaEmulation
from batchfit.train.memory.cudnn import (
    BENCHMARK_ON,
    conv_composites,
    norm_composites,
    step_workspace_bytes,
)
from batchfit.train.memory.fakes import (
    FakeGradScaler,
    fake_first,
    fake_module,
    resolve_implementation,
    storage_bytes,
)
from batchfit.train.memory.reserve import (
    CudaReserve,
    cublas_workspaces,
    live_peak_bytes,
    predict_reserved,
)
from batchfit.train.memory.stack import (
    DEPTHS,
    FSDP_DEPTHS,
    DepthLine,
    Step,
    find_stack,
    shallow_copy,
)
from batchfit.train.memory.step_events import (
    BatchSizeLine,
    Events,
    FakeStepTracker,
    first_micro_batch,
)
from batchfit.train.parallel.sharding import ddp_bucket_sizes, fake_world, shard
from batchfit.train.precision import Precision
from batchfit.train.step import RunResult, optimizer_step, state_tensors, step_micro_batch_sizes
from batchfit.train.tasks import Classification, Task, batch_size_of

MAX_SINGLES = 16  # first-micro-batch steps held until asked for (a fit report asks soon)


class PredictionUnsupported(Exception):
    """The model or optimizer cannot run on fake tensors; its memory must be measured."""

    def because(self) -> str:
        """Why, as a clause: "memory is not predicted: ..."."""
        return f"it does not run on fake tensors ({self})"


class CudnnBenchmarkOn(PredictionUnsupported):
    """torch.backends.cudnn.benchmark is on for a CUDA step with convolutions
    (train/memory/cudnn.py BENCHMARK_ON): its memory must be measured."""

    def because(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Prediction:
    # What the budget is compared with: the peak of live tensors (CPU); on CUDA the smallest
    # per-process limit the caching allocator runs the step in (train/memory/allocator.py).
    peak_bytes: int
    tensor_bytes: int  # peak of live tensor bytes during the step
    seconds: float  # time the prediction took
    # CUDA: the allocator's peak reserve under the run's limit, what max_memory_reserved
    # reads after the step (None: no limit asked for, or out of memory under it).
    reserved_bytes: int | None = None
    # CUDA, a step with cuDNN convolutions: the largest workspace counted for one of its
    # calls (the cap, or measured on the card: train/memory/cudnn.py); None: no convolutions
    workspace_max_bytes: int | None = None

    def error(self, measured: MemoryStats | RunResult) -> float:
        """(predicted - measured) / measured, like against like: on CUDA the reserve under
        the run's limit (which the limit caps when it binds) against max_memory_reserved;
        on CPU the peak of live tensors."""
        if measured.reserved_bytes is not None and self.reserved_bytes is not None:
            predicted, actual = self.reserved_bytes, measured.reserved_bytes
        else:
            predicted, actual = self.peak_bytes, measured.reserved_bytes or measured.peak_bytes
        return (predicted - actual) / actual


def _spec_of(device: torch.device) -> DeviceSpec:
    """A torch device as the DeviceSpec predicted for: this machine's CPU or GPU."""
    if device.type == "cuda":
        return device_spec(device, None)
    return DeviceSpec(device.type, 0)  # the predictor needs no total


class MemoryPredictor:
    """Peak memory of a run's optimizer step for any batch geometry and precision of one
    (model, optimizer, data) triple. Build once per study; each prediction takes a fraction
    of a second for the bundled models, and repeated geometries are answered from a cache."""

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        example: Any,
        device: torch.device | DeviceSpec,
        task: Task | None = None,
        parallel: TrainerConfig | None = None,
        whole: bool = False,
        depth_lines: dict[tuple, list[DepthLine | None]] | None = None,
    ):
        """`model` is a builder, called under the predictor's fake mode (nothing is
        allocated), or a built model, consumed (its tensors become fake). `example` is one
        real batch of any structure (a tuple, a dict of tensors, nested): the fake
        micro-batches copy its structure, and its tensors' shapes past the batch dimension
        and dtypes (a tensor whose first dimension is not the batch's is copied whole).
        Variable dimensions should be at their largest in it
        (train.batches.Pipeline.shape_example). `parallel`: a data-parallel run's trainer
        settings (strategy, devices, FSDP's): the prediction is then one rank's
        (train/parallel/sharding.py). A model with a stack of identical layers (a decoder's) is
        computed at DEPTHS of them (FSDP_DEPTHS) and built for its depth
        (train/memory/stack.py), unless `whole`; `depth_lines` holds their lines (by step
        pattern; None: not periodic), shared by the predictors of one model over other
        data."""
        # The device predicted for (`device`: a torch device here, or a DeviceSpec, maybe
        # of a GPU this machine does not have); the step itself runs on fake CPU tensors,
        # with CUDA's autocast policy and kernel choices for a CUDA target.
        self.target = device if isinstance(device, DeviceSpec) else _spec_of(device)
        self.device = torch.device("cpu")
        # A CUDA target's cuDNN convolutions run with their workspaces (train/memory/cudnn.py):
        # every call met, and per micro-batch size and precision the largest of a step's
        self.workspaces = self.target.cudnn or CudnnWorkspaces(cap_bytes=None)
        self._conv_calls: Calls = {}
        # the cuDNN batch norms met: their sizes (None: not known off the card)
        self._norm_calls: dict = {}
        self._step_workspace: dict[tuple[int, str], int] = {}
        # Real inputs (a builder's example batch) become fake where they meet fake weights.
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.task = task or Classification()
        self._example = example
        self._example_n = batch_size_of(example)
        self._cache: dict[tuple, Prediction | _Pending] = {}
        self._answered: set[tuple] = set()  # keys predict returned once: cached since
        self._lines: dict[tuple, BatchSizeLine] = {}  # per micro-batch pattern and precision
        # (micro-batch, precision, clip) -> (events, first step?): a step of that
        # micro-batch alone, derived from one of several (first_micro_batch)
        self._singles: dict[tuple, tuple[Events, bool]] = {}
        self._step_bytes: int | None = None  # optimizer.step's own peak above its start
        self._flops: dict[int, float] = {}  # micro-batch size -> FLOPs per sample
        self.parallel = parallel
        self.strategy = parallel.strategy if parallel else "none"
        # DDP's gradient buckets: held beside the one-device step's tensors all along
        self.bucket_sizes: list[int] = []
        # The same model cut to DEPTHS layers of its stack, and per step pattern the line
        # through their events (None: not periodic, computed whole)
        self.depth: int | None = None
        self._shallow: dict[int, MemoryPredictor] = {}
        self._depth_lines = {} if depth_lines is None else depth_lines
        try:
            if isinstance(model, nn.Module):
                fake_module(model, self.mode, self.device)
            else:
                model = fake_first(model, self.mode)
                fake_module(model, self.mode, self.device)  # a real build's, if it was
            self._depths = FSDP_DEPTHS if self.strategy == "fsdp" else DEPTHS
            stack = None if whole else find_stack(model, self._depths[-1] + 1)
            if stack is not None:  # cut before sharding: each copy is sharded as a whole
                self.depth = len(stack)
                self._shallow = {
                    depth: MemoryPredictor(
                        shallow_copy(model, stack, depth, self.mode),
                        make_optimizer,
                        example,
                        self.target,
                        task,
                        parallel,
                        whole=True,
                    )
                    for depth in self._depths
                }
            # On CPU optimizer.step runs once, then counts as its peak (_step_once); a
            # step built from shallow ones holds their optimizer events, so these run whole.
            self._collapse_step = self.target.type != "cuda" and not whole and stack is None
            self.model, self._make_optimizer = model, make_optimizer
            self.optimizer: torch.optim.Optimizer | None = None
            if self.strategy == "ddp":
                self.bucket_sizes = ddp_bucket_sizes(model)
            self.state_bytes = self._stacked_state_bytes() if stack is not None else None
            if self.state_bytes is None:
                self._prepare()
        except Exception as error:  # noqa: BLE001 - whatever a user's model does on fake tensors
            raise PredictionUnsupported(_reason(error)) from error

    def _prepare(self) -> None:
        """The whole model sharded (FSDP) and its optimizer, with its state from one step
        on fake gradients; state_bytes. A decoder built from its shallow copies needs
        none of it unless its events are not periodic (_computed)."""
        model = self.model
        if self.parallel is not None and self.strategy == "fsdp":
            with fake_world(self.parallel.devices) as mesh, self.mode:
                shard(model, self.parallel.fsdp, mesh)
        with self.mode:
            self.optimizer = self._make_optimizer(list(model.parameters()))
            resolve_implementation(self.optimizer, self.target.type)
            # One step on fake gradients creates the optimizer state (momentum, moments).
            for param in model.parameters():
                if param.requires_grad:
                    param.grad = torch.empty_like(param)
            self.optimizer.step()
            state = state_tensors(model, self.optimizer)
            self.state_bytes = storage_bytes(state) + sum(self.bucket_sizes)
            self.optimizer.zero_grad(set_to_none=True)

    def _stacked_state_bytes(self) -> int | None:
        """Parameters, gradients and optimizer state of the whole model from its shallow
        copies': linear in the depth (each layer holds the same), checked on all three;
        None when they are not."""
        assert self.depth is not None
        depths = self._depths
        first, second, third = (self._shallow[d].state_bytes for d in depths)
        per_layer = second - first
        if third - second != per_layer:
            return None
        shallow = first - sum(self._shallow[depths[0]].bucket_sizes)
        return shallow + per_layer * (self.depth - depths[0]) + sum(self.bucket_sizes)

    def flops_per_sample(self, batch_size: int) -> float:
        """Model FLOPs of one forward and backward pass, per sample, for a micro-batch of
        `batch_size` (train/measure/flops.py: counted on fake tensors by FlopCounterMode)."""
        if batch_size not in self._flops:
            try:
                with self.mode, self._as_target():
                    batch = next(self._micro_batches([batch_size]))
                    flops = count_flops(
                        lambda: self.task.loss(
                            self.task.forward(self.model, batch), batch
                        ).backward()
                    )
                    self.model.zero_grad(set_to_none=True)
            except Exception as error:  # noqa: BLE001 - as in predict
                raise PredictionUnsupported(_reason(error)) from error
            self._flops[batch_size] = flops / batch_size
        return self._flops[batch_size]

    def predict(
        self, trainer: TrainerConfig, num_train: int, limit_bytes: int | None = None
    ) -> Prediction:
        """Peak memory of a full-size step of a run with `trainer`'s geometry and precision;
        on CUDA also the allocator's reserve under `limit_bytes` (the run's limit)."""
        key = self.prefetch(trainer, num_train, limit_bytes)
        found = self._cache[key]
        if isinstance(found, _Pending):
            try:
                found = self._cache[key] = found.result()
            except Exception as error:  # noqa: BLE001 - as above
                raise PredictionUnsupported(_reason(error)) from error
        if key in self._answered:
            return replace(found, seconds=0.0)
        self._answered.add(key)
        return found

    def prefetch(self, trainer: TrainerConfig, num_train: int, limit_bytes: int | None) -> tuple:
        """Starts predict's work; inside `replays_beside`, the allocator's replays go on in
        a second process while the caller asks for the next. Returns the cache key."""
        sizes = step_micro_batch_sizes(num_train, trainer, 0)[:2]
        limit = limit_bytes if self.target.type == "cuda" else None
        key = (tuple(sizes), trainer.precision, trainer.grad_clip_norm, limit)
        if key not in self._cache:
            try:
                self._cache[key] = self._predict(sizes, trainer, limit)
            except PredictionUnsupported:
                raise
            except Exception as error:  # noqa: BLE001 - as above
                raise PredictionUnsupported(_reason(error)) from error
        return key

    def ready(self, key: tuple) -> bool:
        """Whether predict(...) for the cache key prefetch returned would answer without
        waiting for replays_beside's second process."""
        found = self._cache[key]
        return not isinstance(found, _Pending) or found.reserve.done()

    def _predict(
        self, sizes: list[int], trainer: TrainerConfig, limit_bytes: int | None
    ) -> Prediction:
        started = time.perf_counter()
        pattern = (len(sizes), trainer.precision, trainer.grad_clip_norm)
        line = self._lines.setdefault(pattern, BatchSizeLine())
        uniform = all(n == sizes[0] for n in sizes)
        events = line.at(sizes[0]) if uniform else None
        single = (sizes[0], trainer.precision, trainer.grad_clip_norm)
        if events is None and len(sizes) == 1 and single in self._singles:
            events, first_step = self._singles.pop(single)
            if not first_step:
                line.add(sizes[0], events)
        if events is None:
            first_step = self._collapse_step and self._step_bytes is None
            events, marks = self._run(sizes, trainer)
            if uniform and not first_step:  # the first has the optimizer's own events
                line.add(sizes[0], events)
            if len(sizes) > 1:  # the step of its first micro-batch alone, for free
                self._singles[single] = (first_micro_batch(events, marks), first_step)
                while len(self._singles) > MAX_SINGLES:
                    self._singles.pop(next(iter(self._singles)))
        if self.bucket_sizes:  # allocated when DDP wraps the model, alive all along
            events = [(-10 - i, size) for i, size in enumerate(self.bucket_sizes)] + events
        tensor_bytes = live_peak_bytes(events)
        if self.target.type != "cuda":
            return Prediction(tensor_bytes, tensor_bytes, time.perf_counter() - started)
        if self.has_convolutions and torch.backends.cudnn.benchmark:  # a model file set it?
            raise CudnnBenchmarkOn(BENCHMARK_ON)
        largest = self._step_workspace_bytes((sizes[0], trainer.precision))
        reserve = self._reserve(events, limit_bytes)
        pending = _Pending(reserve, tensor_bytes, started, limit_bytes, largest)
        return pending if _BESIDE else pending.result()

    @property
    def norms_unknown(self) -> bool:
        """Whether a step has cuDNN batch norms whose buffers are not known here (persistent
        ones, over channels-last input, on a card this machine does not have)."""
        found = (self, *self._shallow.values())
        return any(size is None for p in found for size in p._norm_calls.values())

    @property
    def has_convolutions(self) -> bool:
        """Whether the model's steps have cuDNN convolutions (CUDA), those of its shallow
        copies included; known once a step was computed."""
        return bool(self._conv_calls) or any(p.has_convolutions for p in self._shallow.values())

    @property
    def workspace_source(self) -> str:
        """What the cuDNN workspaces of its steps are counted at: "cap", "measured" (on the
        card), "none" (no cap); "" without convolutions."""
        return self.workspaces.source if self.has_convolutions else ""

    def _step_workspace_bytes(self, step: tuple[int, str]) -> int | None:
        """train/memory/cudnn.py step_workspace_bytes over this predictor and its copies."""
        if not self.has_convolutions:
            return None
        found = [(p._conv_calls, p._step_workspace) for p in (self, *self._shallow.values())]
        return step_workspace_bytes(self.workspaces, step, found)

    def _reserve(self, events: Events, limit_bytes: int | None) -> Future[CudaReserve]:
        """The step's events through the caching-allocator model, with the cuBLAS
        workspaces a training step holds (two: the autograd thread has a handle of its own);
        in the second process of replays_beside, else here and now."""
        assert self.target.capability is not None
        settings = self.target.allocator or AllocatorSettings.from_env()
        workspaces = cublas_workspaces(self.target.capability, training=True)
        arguments = (events, settings, workspaces, limit_bytes)
        if _BESIDE:
            return _BESIDE[0].submit(predict_reserved, *arguments)
        done: Future[CudaReserve] = Future()
        done.set_result(predict_reserved(*arguments))
        return done

    def _run(self, sizes: list[int], trainer: TrainerConfig) -> tuple[Events, list[int]]:
        """The step's allocations and frees, and where in them each micro-batch after the
        first begins and where the last one ended (the optimizer's part begins): built
        from the shallow copies' steps where the model's stack allows, else computed."""
        if self._shallow:
            built = self._built(sizes, trainer)
            if built is not None:
                return built.events, built.marks
        return self._computed(sizes, trainer)

    def _built(self, sizes: list[int], trainer: TrainerConfig) -> Step | None:
        """The step at the stack's full depth from the shallow copies' (train/memory/stack.py):
        the line of this step pattern is learned once from DEPTHS, then each micro-batch
        size needs the shallowest step only. None when the events are not periodic."""
        assert self.depth is not None
        pattern = (len(sizes), trainer.precision, trainer.grad_clip_norm)

        def step(depth: int) -> Step:
            return Step(*self._shallow[depth]._computed(sizes, trainer))

        lines = self._depth_lines.setdefault(pattern, [])
        if None in lines:
            return None  # not periodic: computed whole
        one = step(self._depths[0])
        for line in lines:
            built = line.at(self.depth, one)
            if built is not None:
                return built
        # Not learned yet, or this step frees other allocations: learn from it.
        steps = {self._depths[0]: one, **{depth: step(depth) for depth in self._depths[1:]}}
        line = DepthLine.learn(steps)
        lines.append(line)
        return line and line.at(self.depth, one)

    def _computed(self, sizes: list[int], trainer: TrainerConfig) -> tuple[Events, list[int]]:
        """The step's events computed on fake tensors, with its marks (_run)."""
        if self.optimizer is None:
            self._prepare()
        precision = Precision(trainer.precision, self.device.type)
        calls: Calls = {}  # this step's cuDNN convolutions and their workspaces
        cuda = self.target.type == "cuda"
        composites = None
        if cuda:  # each workspace gives way under a limit (ElasticKey); cuDNN's batch norms
            composites = conv_composites(self.workspaces, calls, lambda t: tracker.elastic(t))
            composites |= norm_composites(self.workspaces, self._norm_calls)
        tracker = FakeStepTracker(self.device, record=True, composites=composites)
        marks: list[int] = []
        with self.mode, precision.matmul_mode(), self._as_target():
            scaler = FakeGradScaler(self.device.type, enabled=precision.name == "fp16")
            tracker.register(state_tensors(self.model, self.optimizer))
            with tracker, self._step_once(tracker):
                optimizer_step(
                    self.model,
                    self.optimizer,
                    scaler,
                    precision,
                    self._micro_batches(sizes, marks, tracker.events),
                    trainer.grad_clip_norm,
                    trainer.effective_batch_size,
                    self.task,
                )
        assert tracker.events is not None
        assert live_peak_bytes(tracker.events) == tracker.peak_bytes
        if calls:
            self._conv_calls.update(calls)
            self._step_workspace[sizes[0], trainer.precision] = max(calls.values())
        return tracker.events, marks

    @contextmanager
    def _as_target(self) -> Iterator[None]:
        """The eager code path of libraries that take fakes for a traced graph (transformers:
        train/language/hf.py), and for a CUDA target CUDA's autocast policy and attention kernels on
        the fake CPU tensors (train/memory/cuda_emulation.py)."""
        emulation: AbstractContextManager = nullcontext()
        card: AbstractContextManager = nullcontext()
        if self.target.type == "cuda":
            assert self.target.capability is not None and self.target.gpu is not None
            emulation = CudaEmulation(self.target.capability)
            card = cuda_card(self.target.gpu.sms, self.target.capability)
        with eager_on_fakes(), emulation, card:
            yield

    @contextmanager
    def _step_once(self, tracker: TensorMemoryTracker) -> Iterator[None]:
        """optimizer.step allocates the same temporaries whatever the batch and precision: its
        gradients and state have the parameters' shapes and dtypes. On CPU it is the larger
        part of a prediction, so it runs once; after that its peak above the live bytes it
        starts from is recorded as one allocation and free. Skipping it changes nothing: fake
        state holds no values. On CUDA it always runs: the allocator model needs every
        allocation in order."""
        assert tracker.events is not None
        events = tracker.events
        step = self.optimizer.step

        def measured_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start, peak = tracker.live_bytes, tracker.peak_bytes
            tracker.peak_bytes = start
            result = step(*args, **kwargs)
            self._step_bytes = tracker.peak_bytes - start
            tracker.peak_bytes = max(peak, tracker.peak_bytes)
            return result

        def cached_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            events.extend([(-2, self._step_bytes), (-2, -1)])
            tracker.peak_bytes = max(tracker.peak_bytes, tracker.live_bytes + self._step_bytes)

        if self._collapse_step:
            self.optimizer.step = measured_step if self._step_bytes is None else cached_step
        try:
            yield
        finally:
            self.optimizer.__dict__.pop("step", None)

    def _micro_batches(
        self, sizes: list[int], marks: list[int] | None = None, events: Events | None = None
    ) -> Iterator[Any]:
        """Fake micro-batches of `sizes`; with `marks`, the number of `events` when each one
        after the first is asked for and when the loop asks for one more (its end)."""
        for i, n in enumerate(sizes):
            if i and marks is not None and events is not None:
                marks.append(len(events))

            def fake(t: Any, n: int = n) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                batched = t.dim() > 0 and t.shape[0] == self._example_n
                shape = (n, *t.shape[1:]) if batched else t.shape
                return torch.empty(shape, dtype=t.dtype, device=self.device)

            yield tree_map(fake, self._example)
        if marks is not None and events is not None:
            marks.append(len(events))


_BESIDE: list[ProcessPoolExecutor] = []  # replays_beside's second process, while active


@contextmanager
def replays_beside() -> Iterator[None]:
    """While active, the allocator replays of every CUDA prediction (the smallest limit's
    bisection: most of a large model's prediction) run in one second process, beside the
    fake steps of the predictions asked for next (`prefetch`), those of other predictors
    (a fit report's next table) included. The process is forked at the first replay (it
    needs only train/memory/reserve.py and the allocator model, already imported, and no
    torch): a CPU prediction forks nothing. Not for a process whose signal handlers and
    threads a child must not inherit (a study's): `python -m search.fit` only."""
    if _BESIDE:
        yield
        return
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        _BESIDE.append(pool)
        try:
            yield
        finally:
            _BESIDE.clear()


@dataclass(frozen=True)
class _Pending:
    """A CUDA prediction whose allocator replays may still run (replays_beside)."""

    reserve: Future[CudaReserve]
    tensor_bytes: int
    started: float
    limit_bytes: int | None
    workspace_max_bytes: int | None = None

    def result(self) -> Prediction:
        reserve = self.reserve.result()
        return Prediction(
            reserve.smallest_limit_bytes,
            self.tensor_bytes,
            time.perf_counter() - self.started,
            reserve.peak_reserved_under_limit_bytes if self.limit_bytes is not None else None,
            self.workspace_max_bytes,
        )


def _reason(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}"
