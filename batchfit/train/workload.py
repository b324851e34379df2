"""What the runs of one model on one data set share, built once: the workload.

A `Workload` is a config's model, data, task and loader: the data (built on first use), the
task, the loader settings, the number of training samples, what the data says of itself
(`data_params`), a pipeline for a device, and the memory predictors (train/memory/predict.py), one
per optimizer (its rate aside), device and activation checkpointing. A model that cannot
run on fake tensors is remembered as such: asking again raises the same
PredictionUnsupported without building anything.

`Workloads` hands them out and bounds what they hold. A study creates one and passes it to
whoever builds (validation, the fit report, the trials), so they share the data and the
predictors:

    workloads = Workloads()
    workload = workloads.of(cfg)  # the same object for every cfg of this model/data/task/loader
    prediction = workload.predict(spec, cfg.optimizer)
    result = run(cfg, spec, hooks, workload)

Keys are the resolved sections as sorted JSON: exact (any value that changes what is built
changes the key) and cheap next to building. Precision, batch geometry and gradient clipping
are not in them: one predictor predicts them all (it keys its own cache by them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf

from batchfit.train.batches import Pipeline
from batchfit.train.build import (
    build_data,
    build_loader,
    build_model,
    build_optimizer,
    build_task,
    check_data_set,
)
from batchfit.train.config import LoaderConfig
from batchfit.train.data import Datasets, Splits
from batchfit.train.memory.predict import MemoryPredictor, Prediction, PredictionUnsupported
from batchfit.train.tasks import Task

if TYPE_CHECKING:
    from batchfit.train.config import RunSpec

SECTIONS = ("model", "data", "task", "loader")  # what a Workload is of
MAX_DATA = 2  # data sets held (CIFAR-10: 180 MB of tensors each)
MAX_PREDICTORS = 4  # memory predictors held (a fake model and its optimizer state each)
MAX_WORKLOADS = 8  # Workload objects held: their task and loader settings, no tensors

K = TypeVar("K")
V = TypeVar("V")


class _Bounded(Generic[K, V]):
    """At most `size` values, the least recently used dropped first. Not functools.lru_cache:
    a value is built by a closure over what its key leaves out (the spec, the predictor's
    shared lines), which lru_cache would take into the key; and each Workloads has its own."""

    def __init__(self, size: int):
        assert size >= 1
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, build: Callable[[], V]) -> V:
        """The value of `key`, built by `build()` when not held (an error is not kept)."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = build()
        self._items[key] = value
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)


def config_key(value: Any) -> str:
    """An exact key of a config node (or of plain values holding nodes): its resolved
    values as JSON with sorted keys."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return json.dumps(value, sort_keys=True, default=str)


def _sections(cfg: DictConfig) -> dict[str, Any]:
    """The resolved model, data, task and loader sections of `cfg` (those it has)."""
    check_data_set(cfg)  # a ??? of data.* is named before resolving trips over it
    return {
        name: OmegaConf.to_container(cfg[name], resolve=True)
        for name in SECTIONS
        if cfg.get(name) is not None
    }


def workload_key(cfg: DictConfig) -> str:
    """The key of cfg's Workload: equal for configs of the same model, data, task and loader."""
    return config_key(_sections(cfg))


class Workload:
    """One model/data/task/loader of a `Workloads`; see the module's docstring."""

    def __init__(self, sections: dict[str, Any], key: str, owner: Workloads):
        # The sections as a config of their own: what is built is what the key says,
        # whichever trial's config asked first.
        self.cfg = OmegaConf.create(sections)
        self.key = key
        self._data_key = config_key(sections["data"])
        # What a model's step structure follows, the data's sizes aside (train/memory/stack.py)
        self._model_key = config_key([sections.get("model"), sections.get("task")])
        self._owner = owner

    @property
    def data(self) -> Splits | Datasets:
        """The data, built once for every Workload of the same data (MAX_DATA held)."""
        return self._owner._data.get(self._data_key, lambda: build_data(self.cfg))

    @functools.cached_property
    def task(self) -> Task:
        return build_task(self.cfg)

    @functools.cached_property
    def loader(self) -> LoaderConfig:
        return build_loader(self.cfg)

    @functools.cached_property
    def num_train(self) -> int:
        """Training samples of the data."""
        data = self.data
        return len(data.train_y) if isinstance(data, Splits) else len(data.train)

    @property
    def data_named(self) -> str:
        """The data as the command line chose it (`data=digits`); its `_target_` where no
        Hydra app composed the config (a study's trials, the Python API)."""
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            choice = HydraConfig.get().runtime.choices.get("data")
            if choice:
                return f"data={choice}"
        return f"data._target_={self.cfg.data.get('_target_')}"

    def data_params(self) -> dict[str, Any]:
        """What the data says of itself (`info`: num_classes, vocab_size, corpus_sha256,
        ...) as run params, `data_info.<name>`: which data a run saw, beside the config that
        built it."""
        return {f"data_info.{key}": value for key, value in self.data.info.items()}

    def pipeline(self, device: torch.device) -> Pipeline:
        """A new pipeline over the shared data, for one run on `device`."""
        return Pipeline(self.data, self.loader, device)

    def predictor(
        self, spec: RunSpec, optimizer: DictConfig, whole: bool = False
    ) -> MemoryPredictor:
        """The memory predictor of this workload with `optimizer` (the config's optimizer
        section; its lr changes no memory) on spec's device and activation checkpointing,
        built on first use (MAX_PREDICTORS held); PredictionUnsupported when the model
        cannot run on fake tensors. `whole`: every step computed whole, never built from
        the model's shallow copies (train/memory/stack.py; what the fast one is checked with)."""
        settings = OmegaConf.to_container(optimizer, resolve=True)
        settings.pop("lr", None)
        mode = spec.trainer.activation_checkpointing
        # the device predicted for and its allocator; of its cuDNN workspaces what they are
        # counted at (what the card measured is shared, not part of the key)
        cudnn = spec.target.cudnn
        target = dataclasses.asdict(dataclasses.replace(spec.target, cudnn=None))
        target["cudnn"] = None if cudnn is None else (cudnn.source, cudnn.cap_bytes)
        layout = [settings, target, mode, _parallel_key(spec.trainer)]
        key = config_key([self.key, *layout, whole])
        # Predictors of one model over other data (another data.seq_len) share the lines
        # through their shallow copies' events: each line checks that a step frees the
        # allocations it was learned from before it builds one.
        lines = self._owner._lines.get(config_key([self._model_key, *layout]), dict)
        found = self._owner._predictors.get(
            key, lambda: self._build_predictor(spec, settings, whole, lines)
        )
        if isinstance(found, PredictionUnsupported):
            raise found
        return found

    def _build_predictor(
        self, spec: RunSpec, optimizer: dict[str, Any], whole: bool, lines: dict
    ) -> MemoryPredictor | PredictionUnsupported:
        pipeline = self.pipeline(spec.device)
        torch.manual_seed(spec.trainer.seed)
        mode = spec.trainer.activation_checkpointing
        built = OmegaConf.create({"optimizer": optimizer})  # what the key says, lr aside
        try:
            return MemoryPredictor(
                lambda: build_model(self.cfg, pipeline, self.task, mode),  # built fake
                lambda params: build_optimizer(built, params, spec.lr),
                pipeline.shape_example(),
                spec.target,
                self.task,
                spec.trainer if spec.trainer.distributed else None,
                whole,
                lines,
            )
        except PredictionUnsupported as error:
            return error

    def predict(self, spec: RunSpec, optimizer: DictConfig) -> Prediction:
        """Predicted peak memory of spec's training step (PredictionUnsupported: measure)."""
        predictor = self.predictor(spec, optimizer)
        return predictor.predict(spec.trainer, self.num_train, spec.limit_bytes)


def _parallel_key(trainer: Any) -> list:
    """What of the data-parallel layout changes one rank's memory (not the batch)."""
    if not trainer.distributed:
        return []
    return [trainer.strategy, trainer.devices, dataclasses.asdict(trainer.fsdp)]


class Workloads:
    """The workloads of a study (or of one `python -m train`), each built once and shared;
    at most `max_data` data sets, `max_predictors` predictors and `max_workloads` Workload
    objects are held, the least recently used dropped first (a dropped one is built again
    when asked for)."""

    def __init__(
        self,
        max_data: int = MAX_DATA,
        max_predictors: int = MAX_PREDICTORS,
        max_workloads: int = MAX_WORKLOADS,
    ):
        self._data: _Bounded[str, Splits | Datasets] = _Bounded(max_data)
        self._predictors: _Bounded[str, MemoryPredictor | PredictionUnsupported] = _Bounded(
            max_predictors
        )
        self._lines: _Bounded[str, dict] = _Bounded(max_predictors)
        self._workloads: _Bounded[str, Workload] = _Bounded(max_workloads)

    def of(self, cfg: DictConfig) -> Workload:
        """The Workload of cfg's model, data, task and loader (nothing is built yet); a
        ConfigError when a data.* key is not set (???)."""
        sections = _sections(cfg)
        key = config_key(sections)
        return self._workloads.get(key, lambda: Workload(sections, key, self))

    def held(self) -> dict[str, int]:
        """How many data sets, predictors and Workload objects are held."""
        return {
            "data": len(self._data),
            "predictors": len(self._predictors),
            "workloads": len(self._workloads),
        }
