"""bench/search_efficiency.py's replay on tables whose answers are known: slots, infeasible
slots, hypervolume and the table's round trip."""

from __future__ import annotations

import itertools
from pathlib import Path

import optuna
import pytest

from bench import search_efficiency as bench
from bench.search_efficiency import Row

optuna.logging.set_verbosity(optuna.logging.ERROR)


def _table(fitting_batch: int = 16) -> dict[tuple, Row]:
    """Every configuration of the bench's space: batch sizes above `fitting_batch` do not fit
    (memory grows with the batch); among those that fit, one reaches the target in 1 s, the
    others in 2 s or more."""
    rows = {}
    for i, (batch, accum, precision, lr) in enumerate(itertools.product(*bench.SPACE.values())):
        fits = batch <= fitting_batch
        best = (batch, accum, precision, lr) == (16, 2, "bf16", 0.3)
        rows[batch, accum, precision, lr] = Row(
            batch, accum, precision, lr,
            outcome="COMPLETE" if fits else "oom_predicted",
            val_acc=0.96 if fits else None,
            throughput=1000.0 + i if fits else None,
            time_to_target_s=(1.0 if best else 2.0 + i / 100) if fits else None,
            peak_bytes=batch * 1000 if fits else None,
            predicted_bytes=batch * 1000,
            trial_s=3.0 if fits else 0.25,
        )  # fmt: skip
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_batchfit_spends_no_slot_on_infeasible_or_repeated_configurations(seed: int) -> None:
    table = _table()
    make = bench.samplers(two=False)["batchfit (TPE + feasibility)"]
    result = bench.replay(table, make, seed, two=False, batchfit=True, max_slots=len(table))
    feasible = sum(r.fits for r in table.values())  # 16
    assert result.infeasible_slots == 0
    # Every slot a distinct configuration that fits: the best is found within 16 slots.
    assert result.slots_to_within is not None and 1 <= result.slots_to_within <= feasible
    assert result.seconds_to_within >= 3.0 * result.slots_to_within  # plus predictions


def test_plain_samplers_pay_slots_for_infeasible_configurations() -> None:
    table = _table()
    for name in ("random", "TPE"):
        make = bench.samplers(two=False)[name]
        results = [bench.replay(table, make, s, False, False, 2 * len(table)) for s in range(4)]
        assert all(r.infeasible_slots > 0 for r in results), name
        for r in results:  # a slot is either infeasible or trained; seconds follow the slots
            if r.slots_to_within is not None:
                assert r.infeasible_slots < r.slots_to_within
                trained = r.slots_to_within - r.infeasible_slots
                assert r.seconds_to_within == pytest.approx(
                    3.0 * trained + 0.25 * r.infeasible_slots
                )


def test_grid_reaches_the_best_within_the_grid() -> None:
    table = _table()
    make = bench.samplers(two=False)["grid"]
    for seed in range(3):
        result = bench.replay(table, make, seed, False, False, 2 * len(table))
        assert result.slots_to_within is not None and result.slots_to_within <= len(table)


def test_hypervolume_of_known_fronts() -> None:
    assert bench._hypervolume([]) == 0.0
    assert bench._hypervolume([(1.0, 1.0)]) == pytest.approx(1.0)
    assert bench._hypervolume([(0.5, 1.0), (1.0, 0.5)]) == pytest.approx(0.75)
    assert bench._hypervolume([(0.5, 1.0), (1.0, 0.5), (0.4, 0.4)]) == pytest.approx(0.75)


def test_two_objective_replay_reports_the_hypervolume_after_20_slots() -> None:
    table = _table()
    make = bench.samplers(two=True)["random"]
    result = bench.replay(table, make, 0, True, False, bench.HV_AFTER)
    assert 0 < result.hypervolume <= 0.96 + 1e-9  # val acc 0.96 x throughput at most 1


def test_the_table_round_trips(tmp_path: Path) -> None:
    table = _table()
    path = tmp_path / "t.csv"
    bench.write(path, list(table.values()), 123)
    assert bench.read(path) == table
    assert "search.memory_budget=123" in path.read_text()


def test_the_committed_table_covers_the_space() -> None:
    table = bench.read(bench.TABLE)
    assert set(table) == set(itertools.product(*bench.SPACE.values()))
    assert any(not r.fits for r in table.values()) and any(
        r.time_to_target_s for r in table.values()
    )
