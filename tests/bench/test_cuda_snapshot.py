"""bench/gpu/cuda_snapshot.py's writer: a real snapshot's frames dropped, the rest as the replay
(bench/gpu/cuda_trace.py) reads it, and a snapshot unfit for a fixture said so."""

from __future__ import annotations

import copy
from pathlib import Path

from bench.gpu.cuda_snapshot import compact, problems, write
from bench.gpu.cuda_trace import device_traces, load_snapshot

FIXTURE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "cuda-traces" / "eor_nn_snapshot.json.gz"
)


def _with_frames(snapshot: dict) -> dict:
    """As _snapshot() returns it: stack frames on every event, segment and block."""
    frame = {"filename": "train/loop.py", "line": 1, "name": "optimizer_step"}
    raw = copy.deepcopy(snapshot)
    for events in raw["device_traces"]:
        for event in events:
            event["frames"] = [frame] * 3
    for segment in raw["segments"]:
        segment["frames"] = [frame]
        for block in segment["blocks"]:
            block["frames"] = [frame] * 2
    return raw


def test_compact_drops_frames_and_keeps_what_the_replay_reads(tmp_path: Path) -> None:
    real = load_snapshot(FIXTURE)
    path = tmp_path / "t.json.gz"
    write(compact(_with_frames(real)), path)
    back = load_snapshot(path)
    assert back == real  # the fixture has no frames: compacting restores it exactly
    assert "frames" not in str(back)
    ours, theirs = device_traces(back, "t"), device_traces(real, "t")
    assert [t.events for t in ours] == [t.events for t in theirs]
    assert [t.segments for t in ours] == [t.segments for t in theirs]


def test_problems_name_an_empty_truncated_or_inconsistent_history() -> None:
    real = load_snapshot(FIXTURE)
    reserved = sum(s["total_size"] for s in real["segments"])
    num_events = sum(len(t) for t in real["device_traces"])
    assert problems(real, reserved, num_events + 1) == []
    assert any("dropped" in p for p in problems(real, reserved, num_events))
    assert any("memory_reserved" in p for p in problems(real, reserved + 1, num_events + 1))
    empty = {**real, "device_traces": [[]]}
    assert any("no event" in p for p in problems(empty, reserved, 10))
