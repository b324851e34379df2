"""What runs of one model on one data set share (train/workload.py): one predictor answers
every precision as a fresh one would, the same config gets the same Workload and its data is
built once, another data or model gets another, and what is held stays bounded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra.utils import get_object

from batchfit.train.data import Splits, synthetic
from batchfit.train.plan import plan
from batchfit.train.run import run
from batchfit.train.workload import Workloads

CPU = torch.device("cpu")
HERE = "tests.train.test_workload"  # as Hydra imports this module (pytest may import it apart)
# 100 samples of 3x8x8 (80 to train) and a small CNN: a prediction takes milliseconds, and
# the tiny images keep the bf16/fp16 real step (no fast CPU kernels) short.
TINY = [
    "model=small_cnn",
    "model.width=4",
    "data=synthetic",
    "data.num_samples=100",
    "data.image_size=8",
    "trainer.device=cpu",
    "trainer.max_steps=2",
    "trainer.max_epochs=null",
    "search.memory_budget=null",
]
COUNTED = [*TINY, f"data._target_={HERE}.counted_synthetic"]

BUILDS: list[dict] = []  # one entry per data set built through counted_synthetic


def counted_synthetic(**kwargs) -> Splits:  # noqa: ANN003
    """batchfit.train.data.synthetic, counting its calls."""
    BUILDS.append(kwargs)
    return synthetic(**kwargs)


@pytest.fixture
def builds() -> list[dict]:
    """The data builds of counted_synthetic, counted from the test's start."""
    counted = get_object(f"{HERE}.BUILDS")  # Hydra's copy of this module, not pytest's
    counted.clear()
    return counted


def _at(spec, precision: str, batch_size: int, accum_steps: int = 1):
    trainer = dataclasses.replace(
        spec.trainer,
        precision=precision,
        batch_size=batch_size,
        accum_steps=accum_steps,
        effective_batch_size=None,
    )
    return dataclasses.replace(spec, trainer=trainer)


# Several batch sizes per precision: past three, a predictor reads sizes off a line fitted to
# the computed ones (train/memory/step_events.py, BatchSizeLine), which must be one line per
# precision too.
GEOMETRIES = [(b, 1) for b in (2, 4, 8, 16, 32, 40)] + [(8, 2), (16, 3)]
PRECISIONS = ("fp32", "bf16", "fp16")


def test_one_predictor_predicts_each_precision_as_a_fresh_one(hydra_conf) -> None:
    cfg = hydra_conf(TINY)
    spec = plan(cfg, None)
    workload = Workloads().of(cfg)
    shared = workload.predictor(spec, cfg.optimizer)
    # Precision is not in the predictor's key: every precision goes through this one.
    assert workload.predictor(_at(spec, "bf16", 4), cfg.optimizer) is shared
    through_one = {
        (precision, b, a): workload.predict(_at(spec, precision, b, a), cfg.optimizer)
        for precision in (*PRECISIONS, "fp32")  # fp32 again, after the others
        for b, a in GEOMETRIES
    }
    for (precision, b, a), prediction in through_one.items():
        fresh = Workloads().of(cfg).predict(_at(spec, precision, b, a), cfg.optimizer)
        assert prediction.peak_bytes == fresh.peak_bytes, (precision, b, a)
        assert prediction.tensor_bytes == fresh.tensor_bytes, (precision, b, a)
    # The premise: the precisions peak differently at every size, so a prediction of one
    # answered for another cannot pass the comparison above.
    for b, a in GEOMETRIES:
        peaks = {p: through_one[p, b, a].peak_bytes for p in PRECISIONS}
        assert peaks["fp32"] != peaks["bf16"] and peaks["fp32"] != peaks["fp16"], peaks


def test_one_precision_predicted_is_what_a_run_in_it_measures(hydra_conf) -> None:
    # The shared predictor, asked in fp32 first, against a real bf16 run on the same data.
    cfg = hydra_conf([*TINY, "trainer.batch_size=16"])
    spec = plan(cfg, None)
    workload = Workloads().of(cfg)
    workload.predict(spec, cfg.optimizer)  # fp32
    bf16 = hydra_conf([*TINY, "trainer.batch_size=16", "trainer.precision=bf16"])
    bf16_spec = plan(bf16, None)
    assert Workloads().of(bf16).key == workload.key  # precision is not the workload's either
    predicted = workload.predict(bf16_spec, bf16.optimizer)
    measured = run(bf16, bf16_spec, workload=workload).peak_bytes
    # As test_predict's CPU cases: exact up to the fake BatchNorm's low-precision statistics.
    assert abs(predicted.peak_bytes - measured) <= 0.01 * measured, (predicted, measured)


def test_the_same_config_gets_the_same_workload_and_its_data_is_built_once(
    hydra_conf, builds
) -> None:
    workloads = Workloads()
    cfg = hydra_conf(COUNTED)
    workload = workloads.of(cfg)
    assert builds == []  # nothing is built before it is asked for
    # The same model/data/task/loader composed again, with other trainer and optimizer
    # settings (a trial's): the same Workload.
    trial = hydra_conf([*COUNTED, "trainer.batch_size=8", "optimizer.lr=0.2"])
    assert workloads.of(trial) is workload
    spec, trial_spec = plan(cfg, None), plan(trial, None)
    assert workload.num_train == 80
    assert workload.data_params() == {"data_info.num_classes": 10, "data_info.in_channels": 3}
    workload.pipeline(CPU)
    workload.predict(spec, cfg.optimizer)
    run(trial, trial_spec, workload=workloads.of(trial))
    run(cfg, spec, workload=workload)
    assert len(builds) == 1
    # Another data set: another Workload, and its data built.
    other_data = workloads.of(hydra_conf([*COUNTED, "data.num_samples=120"]))
    assert other_data is not workload
    assert other_data.num_train == 96 and len(builds) == 2
    # Another model on the same data: another Workload, the same data.
    other_model = workloads.of(hydra_conf([*COUNTED, "model.width=8"]))
    assert other_model is not workload
    assert other_model.data is workload.data and len(builds) == 2


def test_the_predictor_key_is_the_optimizer_less_its_rate(hydra_conf) -> None:
    workload = Workloads().of(hydra_conf(TINY))
    base = hydra_conf(TINY)
    spec = plan(base, None)
    predictor = workload.predictor(spec, base.optimizer)
    faster = hydra_conf([*TINY, "optimizer.lr=0.5"])
    assert workload.predictor(plan(faster, None), faster.optimizer) is predictor
    plain = hydra_conf([*TINY, "optimizer.momentum=0", "optimizer.nesterov=false"])
    other = workload.predictor(plan(plain, None), plain.optimizer)
    assert other is not predictor
    assert other.state_bytes < predictor.state_bytes  # no momentum buffers


def test_what_is_held_stays_bounded(hydra_conf, builds) -> None:
    workloads = Workloads(max_data=2, max_predictors=4, max_workloads=3)
    sizes = (100, 110, 120, 130, 140)
    for n in sizes:
        cfg = hydra_conf([*COUNTED, f"data.num_samples={n}"])
        workloads.of(cfg).predictor(plan(cfg, None), cfg.optimizer)
        held = workloads.held()
        assert held["data"] <= 2 and held["predictors"] <= 4 and held["workloads"] <= 3, held
    assert workloads.held() == {"data": 2, "predictors": 4, "workloads": 3}
    assert len(builds) == len(sizes)
    # The first data set was dropped: asked again, it is built again (and the bound holds).
    first = hydra_conf([*COUNTED, f"data.num_samples={sizes[0]}"])
    assert len(workloads.of(first).data.train_y) == 80
    assert len(builds) == len(sizes) + 1
    assert workloads.held()["data"] == 2
    # The most recent one is still held: nothing is built.
    last = hydra_conf([*COUNTED, f"data.num_samples={sizes[-1]}"])
    workloads.of(last).predictor(plan(last, None), last.optimizer)
    assert len(builds) == len(sizes) + 1
