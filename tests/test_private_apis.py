"""The private APIs of Optuna and PyTorch that batchfit relies on, each pinned: the name
exists and behaves as our code assumes. pyproject.toml names them next to the pins; when a
test here fails after an upgrade, the code named in its docstring needs a change.

Each of these has no public equivalent in the versions pinned (Optuna 5.0, torch 2.14):
- optuna.storages._heartbeat.BaseHeartbeat and its `_get_stale_trial_ids`
  (search/storage/heartbeat.py)
- optuna.storages.journal._file.BaseJournalFileLock, get_lock_file (search/storage/journal.py)
- JournalStorage._backend (search/study/driver.py, tests/faults/test_journal.py)
- JournalFileBackend._log_number_offset (search/storage/journal.py: the bytes replayed)
- Study._storage, Trial._trial_id, FrozenTrial._trial_id (search/storage/, search/study/worker.py)
- BaseDistribution._contains (search/core/trial_count.py `_within`)
- torch.amp.GradScaler._maybe_opt_step (train/memory/fakes.py `FakeGradScaler`)
- torch.amp.GradScaler._get_scale_async (train/measure/noise.py: fp16's loss scale, no host sync)
- torch._foreach_norm with a dtype (train/measure/noise.py: the gradients' norms, as
clip_grad_norm_)
- torch._subclasses.fake_tensor.FakeTensorMode (train/memory/predict.py)
- torch.utils._python_dispatch.TorchDispatchMode (train/measure/memory.py)
- torch.utils._pytree tree_map, tree_leaves, tree_iter (train/batches.py, train/loop.py,
  train/tasks.py, train/measure/memory.py, train/memory/predict.py)
- nn.Module._parameters, nn.Module._buffers (train/memory/fakes.py `fake_module`)
- torch._subclasses.fake_tensor.unset_fake_temporarily, DataDependentOutputException and
  torch.utils._python_dispatch._get_current_dispatch_mode_stack (train/language/hf.py)
- transformers.utils.import_utils.is_fake_tensor (via is_tracing) and
  transformers.masking_utils.find_packed_sequence_indices (train/language/hf.py `eager_on_fakes`)
- torch.testing._internal.distributed.fake_pg.FakeStore and the `fake` backend
  (train/parallel/sharding.py `fake_world`); DTensor._local_tensor (train/measure/memory.py,
  train/memory/predict.py);
  FSDP2 calling torch.distributed.all_gather_single / reduce_scatter_single (before torch
  2.14: all_gather_into_tensor / reduce_scatter_tensor) and resizing
  storages in alloc_storage / free_storage (train/parallel/sharding.py `settled_collectives`,
  train/measure/memory.py `_resized`); torch._C._storage_Use_Count (train/parallel/sharding.py
  `_uses`);
  DistributedDataParallel._get_ddp_logging_data's bucket sizes (train/parallel/ranks.py)
- torch.utils._python_dispatch._push_mode, _pop_mode (train/measure/memory.py: a composite
  op's parts tracked); bitsandbytes' backends.default.ops._gemm_4bit_default_impl,
  backends.cuda.ops._gemm_4bit_use_custom_cuda and _gpu_dispatch_props, functional.name2qmap
  and create_dynamic_map (train/language/quantize.py)
"""

from __future__ import annotations

import pickle
from pathlib import Path

import optuna
import pytest
import torch
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import InMemoryStorage, JournalStorage, fail_stale_trials
from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import BaseJournalFileLock, get_lock_file
from optuna.trial import TrialState
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter, tree_leaves, tree_map

from batchfit.search.storage.heartbeat import (
    BEAT_ATTR,
    HeartbeatJournalStorage,
    HeartbeatRDBStorage,
)
from batchfit.search.storage.journal import SafeJournalFileBackend
from batchfit.search.storage.owners import OWNER_ATTR
from batchfit.train.memory.fakes import FakeGradScaler

# ---- Optuna: heartbeats (search/storage/heartbeat.py HeartbeatJournalStorage, HeartbeatRDBStorage)


# study.ask() on a heartbeat storage warns that heartbeats come with study.optimize: here a
# running trial is all that is wanted.
ASKED_OUTSIDE_OPTIMIZE = pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")


class _Beating(InMemoryStorage, BaseHeartbeat):
    """The smallest heartbeat storage: what HeartbeatJournalStorage implements, recorded."""

    def __init__(self, stale: list[int] | None = None) -> None:
        super().__init__()
        self.beats: list[int] = []
        self.asked: list[int] = []
        self.stale = stale or []
        self.failed: list[int] = []

    def record_heartbeat(self, trial_id: int) -> None:
        self.beats.append(trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        self.asked.append(study_id)
        return self.stale

    def get_heartbeat_interval(self) -> int | None:
        return 60

    def get_heartbeat_stale_trial_callback(self):  # noqa: ANN201
        return lambda study, trial: self.failed.append(trial.number)


def test_base_heartbeat_asks_for_what_our_storages_implement() -> None:
    # HeartbeatJournalStorage implements exactly these; a new abstract method would make it
    # uninstantiable, a renamed one would never be called.
    assert BaseHeartbeat.__abstractmethods__ == {
        "record_heartbeat",
        "_get_stale_trial_ids",
        "get_heartbeat_interval",
        "get_heartbeat_stale_trial_callback",
    }
    assert issubclass(HeartbeatJournalStorage, BaseHeartbeat)
    assert issubclass(HeartbeatRDBStorage, BaseHeartbeat)


@ASKED_OUTSIDE_OPTIMIZE
def test_optuna_beats_and_fails_stale_trials_through_base_heartbeat() -> None:
    storage = _Beating()
    assert is_heartbeat_enabled(storage)
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    # The heartbeat thread beats once at the trial's start, with the trial's id.
    assert storage.beats == [study.trials[0]._trial_id]
    running = study.ask()
    storage.stale = [running._trial_id]
    fail_stale_trials(study)  # what study.optimize runs before each trial
    assert study._study_id in storage.asked
    assert study.trials[running.number].state == TrialState.FAIL
    assert storage.failed == [running.number]  # our RetryStaleTrial is this callback


def test_the_journal_heartbeat_storage_is_one_optuna_beats(tmp_path: Path) -> None:
    backend = SafeJournalFileBackend(tmp_path / "optuna.journal")
    storage = HeartbeatJournalStorage(backend, heartbeat_interval=60, grace_period=120)
    assert is_heartbeat_enabled(storage)
    study = optuna.create_study(storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    attrs = study.trials[0].system_attrs
    assert BEAT_ATTR in attrs and OWNER_ATTR in attrs  # record_heartbeat was called
    # JournalStorage.__setstate__, which ours extends: a pickled copy (a launcher's worker)
    # reads the same study.
    copy = pickle.loads(pickle.dumps(storage))
    assert copy._owned == set() and len(copy.get_all_trials(study._study_id)) == 1


@ASKED_OUTSIDE_OPTIMIZE
def test_rdb_storage_keeps_its_grace_period_and_stale_trial_query(tmp_path: Path) -> None:
    # HeartbeatRDBStorage reads self.grace_period and extends RDBStorage._get_stale_trial_ids.
    storage = HeartbeatRDBStorage(
        f"sqlite:///{tmp_path}/o.db", heartbeat_interval=60, grace_period=120
    )
    assert storage.grace_period == 120
    assert "_get_stale_trial_ids" in vars(optuna.storages.RDBStorage)
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    storage.record_heartbeat(trial._trial_id)  # just beaten, by this live process
    assert storage._get_stale_trial_ids(study._study_id) == []


# ---- Optuna: the journal file's lock (search/storage/journal.py SafeJournalFileBackend)


class _CountingLock(BaseJournalFileLock):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def acquire(self) -> bool:
        self.calls.append("acquire")
        return True

    def release(self) -> None:
        self.calls.append("release")


def test_journal_file_backend_takes_our_lock_around_each_append(tmp_path: Path) -> None:
    assert BaseJournalFileLock.__abstractmethods__ == {"acquire", "release"}
    lock = _CountingLock()
    backend = JournalFileBackend(str(tmp_path / "j"), lock_obj=lock)
    backend.append_logs([{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}])
    assert lock.calls == ["acquire", "release"]


def test_get_lock_file_releases_on_error() -> None:
    lock = _CountingLock()
    with pytest.raises(RuntimeError), get_lock_file(lock):
        assert lock.calls == ["acquire"]
        raise RuntimeError
    assert lock.calls == ["acquire", "release"]


def test_journal_storage_keeps_its_backend(tmp_path: Path) -> None:
    # search/study/driver.py prints the notes of the storage's SafeJournalFileBackend.
    backend = SafeJournalFileBackend(tmp_path / "optuna.journal")
    assert JournalStorage(backend)._backend is backend


def test_journal_file_backend_maps_log_numbers_to_byte_offsets(tmp_path: Path) -> None:
    # search/storage/journal.py: a journal shorter than the records replayed was truncated.
    journal = tmp_path / "j"
    backend = JournalFileBackend(str(journal))
    backend.append_logs([{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}])
    assert len(list(backend.read_logs(0))) == 1
    assert max(backend._log_number_offset.values()) == journal.stat().st_size


# ---- Optuna: a study's storage and its trials' ids (search/storage/, search/study/worker.py)


def test_study_storage_and_trial_ids_address_the_trial() -> None:
    storage = InMemoryStorage()
    study = optuna.create_study(storage=storage)
    study.ask()
    live = study.ask()
    assert study._storage is storage
    frozen = study.trials[live.number]
    assert live._trial_id == frozen._trial_id
    assert storage.get_trial(frozen._trial_id).number == live.number == 1
    storage.set_trial_system_attr(live._trial_id, OWNER_ATTR, {"pid": 1})
    assert study.trials[1].system_attrs[OWNER_ATTR] == {"pid": 1}
    assert OWNER_ATTR not in study.trials[0].system_attrs


# ---- Optuna: membership in a distribution (search/core/trial_count.py `_within`)


@pytest.mark.parametrize(
    ("dist", "inside", "outside"),
    [
        (IntDistribution(1, 10, step=3), [1, 4, 10], [5, 0, 11, 13]),
        (IntDistribution(16, 512, log=True), [16, 100, 512], [8, 1024]),
        (FloatDistribution(0.1, 1.0, log=True), [0.1, 0.5, 1.0], [0.05, 2.0]),
        (FloatDistribution(0.0, 1.0, step=0.25), [0.0, 0.5, 1.0], [0.6, 1.25]),
        (CategoricalDistribution([16, 32, "fp16"]), [16, 32, "fp16"], []),
    ],
)
def test_distribution_contains_a_value_in_its_internal_repr(dist, inside, outside) -> None:
    for value in inside:
        assert dist._contains(dist.to_internal_repr(value)) is True, value
    for value in outside:
        assert dist._contains(dist.to_internal_repr(value)) is False, value


def test_a_value_not_among_the_choices_has_no_internal_repr() -> None:
    # `_within` answers False for it by catching this ValueError.
    with pytest.raises(ValueError):
        CategoricalDistribution([16, 32]).to_internal_repr(64)


# ---- torch: GradScaler's step (train/memory/fakes.py `FakeGradScaler`)


def _inf_gradients(scaler: torch.amp.GradScaler) -> tuple[nn.Linear, torch.optim.SGD]:
    """A model whose scaled backward left infinite gradients."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    for p in model.parameters():
        p.grad.fill_(float("inf"))
    return model, optimizer


def test_grad_scaler_step_goes_through_maybe_opt_step() -> None:
    seen = []

    class Recording(torch.amp.GradScaler):
        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):  # noqa: ANN001, ANN202
            seen.append((optimizer, sorted(optimizer_state), args, kwargs))
            return "stepped"

    scaler = Recording("cpu")
    _, optimizer = _inf_gradients(scaler)
    assert scaler.step(optimizer, "arg", key="value") == "stepped"
    ((called_with, state_keys, args, kwargs),) = seen
    assert called_with is optimizer and "found_inf_per_device" in state_keys
    assert (args, kwargs) == (("arg",), {"key": "value"})


def test_grad_scaler_gives_its_scale_as_a_tensor_without_a_sync() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert scaler._get_scale_async() is None  # none before the first scale()
    scaled = scaler.scale(torch.ones(()))
    scale = scaler._get_scale_async()
    assert isinstance(scale, torch.Tensor) and float(scale) == 1024.0 == float(scaled)


def test_foreach_norm_gives_each_tensors_norm_in_the_dtype_asked() -> None:
    tensors = [torch.full((3, 4), 0.5, dtype=torch.bfloat16), torch.tensor([3.0, 4.0])]
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    assert [n.dtype for n in norms] == [torch.float32, torch.float32]
    assert [float(n) for n in norms] == [pytest.approx(0.5 * 12**0.5), 5.0]


def test_the_fake_scaler_steps_where_the_real_one_skips() -> None:
    # Infinite gradients: GradScaler reads the found-inf flags (.item(), which a fake tensor
    # cannot answer) and skips the step; FakeGradScaler's override always steps.
    for scaler, steps in ((torch.amp.GradScaler("cpu"), False), (FakeGradScaler("cpu"), True)):
        model, optimizer = _inf_gradients(scaler)
        before = model.weight.detach().clone()
        scaler.step(optimizer)
        assert torch.equal(model.weight, before) is not steps, type(scaler).__name__


# ---- torch: fake tensors and dispatch modes (train/memory/predict.py, train/measure/memory.py)


class _Ops(TorchDispatchMode):
    """What TensorMemoryTracker does: see every op, its inputs and outputs, and run it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.outputs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func.overloadpacket))
        out = func(*args, **(kwargs or {}))
        self.outputs += [v for v in tree_iter(out) if isinstance(v, torch.Tensor)]
        return out


def test_a_dispatch_mode_inside_fake_tensor_mode_sees_fake_ops() -> None:
    mode = FakeTensorMode()
    with mode:
        weight = nn.Parameter(torch.empty_strided((4, 8), (8, 1), dtype=torch.float32))
    ops = _Ops()
    with mode, ops:
        out = weight.sum() * 2
    assert isinstance(weight, FakeTensor) and isinstance(out, FakeTensor)
    assert weight.untyped_storage().nbytes() == 4 * 8 * 4  # sized, though it holds no data
    assert [op for op in ops.ops if op.startswith("aten.")] == ["aten.sum", "aten.mul"]
    assert all(isinstance(t, FakeTensor) for t in ops.outputs)


# ---- torch: pytrees (train/batches.py, train/loop.py, train/tasks.py, train/measure/memory.py)


def test_pytree_walks_tuples_lists_and_dicts_in_order() -> None:
    a, b = torch.zeros(2), torch.ones(3)
    batch = {"x": (a, [b, 3]), "mask": None}
    assert [id(v) for v in tree_leaves(batch) if isinstance(v, torch.Tensor)] == [id(a), id(b)]
    assert list(tree_iter(batch)) == tree_leaves(batch)
    doubled = tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, batch)
    assert doubled["x"][1][1] == 3 and doubled["mask"] is None
    assert torch.equal(doubled["x"][1][0], 2 * b)


# ---- torch: a module's own tensors (train/memory/fakes.py `fake_module`)


def test_a_modules_parameter_and_buffer_dicts_are_what_it_uses() -> None:
    model = nn.BatchNorm1d(3)
    new_weight, new_mean = nn.Parameter(torch.full((3,), 2.0)), torch.full((3,), 5.0)
    model._parameters["weight"] = new_weight
    model._buffers["running_mean"] = new_mean
    assert model.weight is new_weight and model.running_mean is new_mean
    assert any(p is new_weight for p in model.parameters())
    assert any(b is new_mean for b in model.buffers())
    assert "running_mean" in model.state_dict()  # still a (persistent) buffer


# ---------------------------------------------------------------- transformers
# (train/language/hf.py)


def test_transformers_takes_fakes_for_tracing_through_is_fake_tensor() -> None:
    from transformers.utils import import_utils

    from batchfit.train.language.hf import eager_on_fakes

    with FakeTensorMode():
        fake = torch.empty(2)
    assert import_utils.is_tracing(fake)  # what eager_on_fakes switches off
    with eager_on_fakes():
        assert not import_utils.is_tracing(fake)
    assert import_utils.is_tracing(fake)


def test_packed_sequence_detection_reads_the_position_ids_values() -> None:
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from transformers import masking_utils
    from transformers.utils import import_utils

    from batchfit.train.language.hf import eager_on_fakes

    find = masking_utils.find_packed_sequence_indices
    assert find(torch.arange(8).unsqueeze(0)) is None  # eager: one sequence per row
    with FakeTensorMode():
        fake = torch.empty(1, 8, dtype=torch.long)
        assert find(fake) is not None  # "tracing": a mask, the values left unread
        saved = import_utils.is_fake_tensor
        import_utils.is_fake_tensor = lambda tensor: False
        try:
            with pytest.raises(DataDependentOutputException):
                find(fake)  # the eager path reads them, which eager_on_fakes answers
        finally:
            import_utils.is_fake_tensor = saved
        with eager_on_fakes():
            assert masking_utils.find_packed_sequence_indices(fake) is None
    assert masking_utils.find_packed_sequence_indices is find


def test_fake_mode_can_be_left_for_a_block() -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    with FakeTensorMode():
        assert any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        with unset_fake_temporarily():
            assert not isinstance(torch.empty(1), FakeTensor)
        assert isinstance(torch.empty(1), FakeTensor)


def test_fsdp2_on_a_fake_process_group_shards_into_local_tensors() -> None:
    """fake_world's FakeStore and `fake` backend, a CPU mesh built outside the fake mode,
    DTensor._local_tensor holding the rank's shard, and FSDP2's storage resizes seen by
    the tracker (train/parallel/sharding.py, train/measure/memory.py)."""
    import inspect

    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param

    from batchfit.train.config import FSDPConfig
    from batchfit.train.measure.memory import TensorMemoryTracker
    from batchfit.train.parallel.sharding import FSDP_COLLECTIVES, fake_world, shard

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(4) as mesh, mode:
        model = shard(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), FSDPConfig(), mesh)
        weight = model[0].weight
        assert weight._local_tensor.shape == (16, 64)
        tracker = TensorMemoryTracker()
        with tracker:
            model(torch.empty(2, 64)).sum().backward()
        assert tracker.peak_bytes >= 64 * 64 * 4  # the gathered weight, allocated by resize_
    assert not dist.is_initialized()
    source = inspect.getsource(_fsdp_collectives)
    assert all(f"dist.{name}(" in source for name in FSDP_COLLECTIVES)  # those of this torch
    assert "storage.resize_(" in inspect.getsource(_fsdp_param.alloc_storage)
    t = torch.zeros(4)
    assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) >= 1
    # Its bucket sizes are checked by tests/train/test_distributed.py (DDP to the byte).
    assert hasattr(torch.nn.parallel.DistributedDataParallel, "_get_ddp_logging_data")


def test_bitsandbytes_4bit_matmul_internals() -> None:
    """The composition gemm_4bit's kernels run and the CUDA kernel choice, as
    train/language/quantize.py calls them; a mode pushed within its own dispatch."""
    import inspect

    pytest.importorskip("bitsandbytes")
    from bitsandbytes import functional
    from bitsandbytes.backends.cuda import ops as cuda_ops
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    assert list(inspect.signature(_gemm_4bit_default_impl).parameters) == [
        "A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit",
        "absmax_code", "absmax_offset",
    ]  # fmt: skip
    assert list(inspect.signature(cuda_ops._gemm_4bit_use_custom_cuda).parameters) == [
        "device_index", "dtype", "M", "N", "K",
    ]  # fmt: skip
    assert "_gpu_dispatch_props(device_index)" in inspect.getsource(
        cuda_ops._gemm_4bit_use_custom_cuda
    )
    fallback = inspect.getsource(cuda_ops._dequant_linear_fallback)
    assert "absmax_dq = torch.empty_like(absmax_8bit" in fallback  # kept until the matmul
    assert cuda_ops._gemm_4bit_custom_max_m == 1536
    assert isinstance(functional.name2qmap, dict)
    assert functional.create_dynamic_map().shape == (256,)
    assert callable(_push_mode) and callable(_pop_mode)
