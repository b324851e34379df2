"""The GPU sections that settle cuDNN's workspace cap (bench/gpu/conv_cap.py) and run a whole
study on the card (bench/gpu/study_on_card.py): each end to end in its CPU quick mode (the
script itself: no GPU figure), and their verdicts on constructed measurements, as a card would
give them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.conv_cap import MODES, report
from bench.gpu.study_on_card import verdict

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


@pytest.mark.slow
def test_the_cap_section_runs_each_way_of_giving_it_in_a_process_of_its_own() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "conv_cap.py"), "--device", "cpu",
         "--models", "small_cnn", "--batch", "2"],
        capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", **_env()},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = " ".join(done.stdout.split())
    for mode in MODES:
        assert f" {mode} " in out
    # small_cnn's two convolutions: the first needs no input gradient (the images)
    for call in ("fwd 2x3x32x32 w 32x3x3x3", "bwd-filter 2x3x32x32 w 32x3x3x3",
                 "bwd-data 2x32x32x32 w 64x32x3x3"):  # fmt: skip
        assert call in out
    assert "bwd-data 2x3x32x32" not in out
    assert "10 calls" in out and "dry run on the CPU" in out
    assert "cuDNN batch norm buffers" in out  # its two, contiguous and channels-last
    assert out.count(" SPATIAL_PERSISTENT ") == 2 and out.count(" SPATIAL ") == 2


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "CUDNN_CONV_WSCAP_DBG"}


def _by_mode(workspaces: dict[str, list[int | None]]) -> dict:
    return {
        mode: {"mode": mode, "results": [{"workspace": w, "engine": "eng0"} for w in ws]}
        for mode, ws in workspaces.items()
    }


SIGNATURE = ("forward", (256, 64, 32, 32), (65536, 1024, 32, 1), (64, 64, 3, 3),
             (576, 9, 3, 1), "fp32", (1, 1), (1, 1), (1, 1), False, (0, 0), 1)  # fmt: skip


def test_the_cap_verdict_on_a_card(capsys) -> None:
    """Honoured: every call within 64 MiB and 8 MiB under those caps, and a late export
    changing nothing reads as "read once"; one call over 8 MiB under the 8 MiB cap: not."""
    items = [("resnet18", "fp32", SIGNATURE)] * 2
    honoured = _by_mode({"unset": [200 * MiB, 0], "64": [60 * MiB, 0], "8": [8 * MiB, 0],
                         "after": [200 * MiB, 0]})  # fmt: skip
    assert report(items, honoured, "cuda")
    out = " ".join(capsys.readouterr().out.split())
    assert "HONOURED" in out and "read once" in out
    ignored = _by_mode({"unset": [200 * MiB, 0], "64": [200 * MiB, 0], "8": [200 * MiB, 0],
                        "after": [200 * MiB, 0]})  # fmt: skip
    assert not report(items, ignored, "cuda")
    out = " ".join(capsys.readouterr().out.split())
    assert "NOT HONOURED" in out and "calls over the cap: 1 at 64 MiB, 1 at 8 MiB" in out
    assert "8 had no effect" in out


def _row(**given) -> dict:
    row = {"trial": 0, "params": "", "state": "COMPLETE", "reason": "", "predicted": 100,
           "measured": 100, "error": 0.0, "budget": 1000, "step_ms": 5.0,
           "joules": 3.0}  # fmt: skip
    return {**row, **given}


def test_the_study_verdict_names_what_a_card_got_wrong() -> None:
    assert verdict([_row()], cuda=True, energy=True, recommended=True) == []
    assert verdict([_row(error=-0.05)], True, False, True) == [
        "trial 0: prediction -5.00% off (target -2% to +15%)"
    ]
    oom = _row(state="PRUNED", reason="oom", step_ms=None, error=None)
    assert "trial 0 ran out of memory after a prediction that fits" in verdict(
        [_row(trial=1), oom], True, False, True
    )
    assert verdict([_row(joules=None)], True, True, True) == [
        "trial 0: no joules counted though NVML is readable"
    ]
    assert verdict([_row(error=0.5)], False, False, True) == []  # a CPU: no reserve targets
    assert verdict([], True, False, False) == ["no trial trained", "no recommendation"]


@pytest.mark.slow
def test_a_whole_study_runs_through_the_section_and_writes_its_table(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "study_on_card.py"), "--device", "cpu",
         "--experiment", "resnet", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "2", **_env()},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    written = (tmp_path / "study-resnet.md").read_text()
    assert "predicted vs measured peak per trial" in written and "verdict: PASS" in written
    trials = [line for line in written.splitlines() if "COMPLETE" in line]
    assert len(trials) >= 2 and all("+0.00%" in line for line in trials)  # the CPU's accounting
    assert "recommended: python -m train +experiment=resnet" in written
