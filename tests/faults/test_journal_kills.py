"""The rest of the SIGKILL at every kind of journal append (tests/faults/study.py
kill_at_every_kind; the first third is in tests/faults/test_journal.py): a file of its own,
so that a second pytest worker runs it beside the first."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.study import kill_at_every_kind


@pytest.mark.slow
def test_a_sigkill_at_every_kind_of_journal_append_then_resume_the_rest(tmp_path: Path) -> None:
    kill_at_every_kind(tmp_path, 1)
