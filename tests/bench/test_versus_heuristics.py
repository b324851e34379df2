"""bench/versus_heuristics.py's two heuristics find the largest batch that fits, as their
originals do: grown from 2 (Lightning) and halved from a start (Hugging Face)."""

from __future__ import annotations

from batchfit.train.plan import plan
from batchfit.train.workload import Workloads
from bench import versus_heuristics as bench


def _peak(hydra_conf, batch: int) -> int:
    """The step's peak at `batch` in fp32: on CPU the prediction is the measurement."""
    cfg = hydra_conf([*bench.WORKLOAD, f"trainer.batch_size={batch}", "trainer.precision=fp32"])
    return Workloads().of(cfg).predict(plan(cfg, None), cfg.optimizer).peak_bytes


def test_both_heuristics_find_the_largest_batch_that_fits(hydra_conf) -> None:
    budget = _peak(hydra_conf, 32) + 1  # 32 fits with a byte to spare; 64 does not
    assert _peak(hydra_conf, 64) > budget
    grown = bench.grow(budget, lr=0.05)
    assert grown.config == {
        "trainer.batch_size": 32,
        "trainer.accum_steps": 1,
        "trainer.precision": "fp32",
        "optimizer.lr": 0.05,
    }
    assert grown.how == "tried 2, 4, 8, 16, 32, 64: 64 ran out of memory"
    halved = bench.halve(budget, lr=0.05, start=256)
    assert halved.config == grown.config
    assert halved.how == "256, 128, 64 ran out of memory; 32 ran"
    assert grown.search_s > 0 and halved.search_s > 0
