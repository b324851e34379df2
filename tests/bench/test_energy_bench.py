"""bench/energy.py as a user runs it: with no counter it says so and exits 0 with no
figures; with a RAPL counter (a powercap tree whose package counter a test thread advances)
it tabulates joules per sample per configuration and names the fewest joules to the target
beside the fastest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.train.measure.energy import UNMEASURED
from tests.search.test_energy_study import PackageCounter
from tests.sweeps import clean_env

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--batch-sizes", "16", "64", "256", "--precisions", "fp32", "--steps", "48", "--",
        "model=small_cnn"]  # fmt: skip


def _bench(cwd: Path, powercap: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "energy.py"), *ARGS], cwd=cwd,
        capture_output=True, text=True, timeout=600,
        env=clean_env(BATCHFIT_POWERCAP=str(powercap)),
    )  # fmt: skip


def test_without_a_counter_it_says_so_and_exits_0(tmp_path: Path) -> None:
    done = _bench(tmp_path, tmp_path / "none")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"{UNMEASURED}: no figures (device cpu)"


@pytest.mark.slow
def test_with_a_counter_it_tabulates_joules_and_the_fewest_to_the_target(tmp_path: Path) -> None:
    with PackageCounter(tmp_path / "powercap"):
        done = _bench(tmp_path, tmp_path / "powercap")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+fp32\s+\d+\s+([\d.e-]+)\s+([\d.]+)\s+\d+%$", done.stdout, re.M)
    assert sorted(int(batch) for batch, _, _ in rows) == [16, 64, 256]
    assert all(float(per_sample) > 0 for _, per_sample, _ in rows)
    assert re.search(r"fastest: \d+x1 fp32 +[\d.]+ s, [\d.]+ m?J", done.stdout)
    assert re.search(r"fewest joules: \d+x1 fp32 +[\d.]+ s, [\d.]+ m?J", done.stdout)
    assert "verdict: PASS" in done.stdout
