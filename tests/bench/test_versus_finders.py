"""bench/versus_finders.py end to end (--quick): the real BatchSizeFinder and
auto_find_batch_size hit the budget it enforces on the CPU, batchfit's integrations do not,
and the verdict sets the exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_quick_bench_passes_and_the_tools_of_the_field_meet_its_budget() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "versus_finders.py"), "--quick"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = {
        cells[0]: cells[1:]
        for line in done.stdout.splitlines()
        if line.startswith("│") and len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 7
    }
    # OOMs, passes choosing, trains with, effective (asked), trained in budget, peak
    assert rows["batchfit PredictedBatchSize"][:5] == ["0", "0", "32 x 8", "256 (256)", "yes"]
    assert rows["batchfit fit_arguments"][:5] == ["0", "0", "2 x 8", "16 (16)", "yes"]
    for finder in ("Lightning BatchSizeFinder", "Trainer auto_find_batch_size"):
        ooms, passes = int(rows[finder][0]), int(rows[finder][1])
        assert ooms >= 1 and passes >= 1, rows[finder]  # the budget is enforced for them too
    assert done.stdout.rstrip().endswith("PASS")
