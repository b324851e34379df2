"""train/launch/speed_probe.py: configurations timed side by side, in rotating order, round after
round."""

from __future__ import annotations

import pytest

from batchfit.train.launch import speed_probe as speed
from batchfit.train.launch.speed_probe import Speed, measure
from batchfit.train.plan import plan

SMALL = ["model=small_cnn", "model.width=4", "data=digits", "trainer.device=cpu"]


def test_each_configuration_is_timed_once_per_round_in_rotating_order(
    hydra_conf, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = []
    for batch in (2, 512):
        cfg = hydra_conf([*SMALL, f"trainer.batch_size={batch}"])
        runs.append((cfg, plan(cfg, None)))
    visits = []
    seen: set[int] = set()  # the data sets visited
    real_visit = speed._visit

    def visit(cfg, spec, workload):  # noqa: ANN001, ANN202
        visits.append(spec.trainer.batch_size)
        seen.add(id(workload.data))
        return real_visit(cfg, spec, workload)

    monkeypatch.setattr(speed, "_visit", visit)
    small, large = measure(runs, rounds=3)
    assert visits == [2, 2, 512, 512, 2, 2, 512]  # a warm-up, then none always first
    assert len(seen) == 1  # the runs of one data set share it, built once
    assert len(small.samples_per_sec) == len(large.samples_per_sec) == 3
    assert small.unit == "samples" and small.units_per_sec == small.samples_per_sec
    # A step of 512 digits costs far less than 256 steps of 2 (per-step overhead): the
    # larger batch is faster beyond the noise, whatever else the machine does.
    assert large.beats(small) and not small.beats(large)
    assert large.median() > 2 * small.median()


def test_a_language_model_counts_tokens_too(hydra_conf) -> None:
    cfg = hydra_conf(["+experiment=gpt", "data.max_bytes=20000", "data.seq_len=64",
                      "trainer.batch_size=8", "trainer.device=cpu"])  # fmt: skip
    (gpt,) = measure([(cfg, plan(cfg, None))], rounds=2)
    assert gpt.unit == "tokens"
    for samples, tokens in zip(gpt.samples_per_sec, gpt.units_per_sec, strict=True):
        assert tokens == pytest.approx(64 * samples)  # every position of a sequence a target


def test_beats_and_spread() -> None:
    a, b = Speed((100.0, 110.0, 120.0), (1.0,) * 3), Speed((121.0, 125.0, 130.0), (1.0,) * 3)
    assert b.beats(a) and not a.beats(b)
    assert a.spread() == pytest.approx(20 / 110)
    assert not Speed((100.0, 130.0, 131.0), (1.0,) * 3).beats(a)  # its slowest round: 100
