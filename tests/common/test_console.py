"""common/console.py: what the entry points print when they stop, passwords masked."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.common.console import config_error, crashed, stopped

URL = "postgresql://bf:secret@db/x"
MASKED = "postgresql://bf:***@db/x"
REPO = Path(__file__).resolve().parents[2]


def _recording() -> Console:
    return Console(record=True, width=200)


def _said(errors: Console, stop: Callable[[], object]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped_with:
        stop()
    return stopped_with.value.code, errors.export_text()


def test_a_configuration_error_is_printed_redacted_and_exits_2() -> None:
    errors = _recording()
    error = ConfigError([f"search.storage={URL} cannot be opened", "trainer.precision [x]"])
    code, text = _said(errors, lambda: config_error(errors, error))
    assert code == 2
    assert text == (
        f"Configuration error\n- search.storage={MASKED} cannot be opened\n"
        "- trainer.precision [x]\n"  # [x] is text, not rich markup
    )


def test_a_stop_is_printed_redacted_with_its_headline() -> None:
    errors = _recording()
    code, text = _said(errors, lambda: stopped(errors, "Storage error", f"{URL}: disk full"))
    assert (code, text) == (1, f"Storage error\n{MASKED}: disk full\n")


def test_a_crash_prints_its_traceback_and_headline_redacted() -> None:
    errors = _recording()

    def fail() -> None:
        try:
            raise RuntimeError(f"cannot reach {URL}")
        except RuntimeError:
            crashed(errors, "The study did not start", f"RuntimeError while preparing {URL}")

    code, text = _said(errors, fail)
    assert code == 1
    assert "secret" not in text
    assert "Traceback (most recent call last):" in text
    assert f"RuntimeError: cannot reach {MASKED}" in text
    assert text.endswith(f"The study did not start: RuntimeError while preparing {MASKED}\n")


@pytest.fixture
def entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str, list[str]], int]]:
    """run(module, overrides): `python -m module overrides` in this process, under tmp_path;
    its exit status. Hydra's logging is left alone, and the torch threads the entry point
    plans are restored after."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()

    def run(module: str, overrides: list[str]) -> int:
        entry = importlib.import_module(module)
        if hasattr(entry, "stop_on_signals"):  # pytest's own SIGINT handler stays
            monkeypatch.setattr(entry, "stop_on_signals", lambda errors: None)
        argv = [
            module,
            f"--config-path={REPO / 'conf'}",  # imported, not run as __main__: no file path
            *overrides,
            f"hydra.run.dir={tmp_path / 'run'}",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ]
        monkeypatch.setattr(sys, "argv", argv)
        try:
            with pytest.raises(SystemExit) as stopped_with:
                entry.main()
        finally:
            GlobalHydra.instance().clear()
        return stopped_with.value.code

    yield run
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "module",
    ["batchfit.search.__main__", "batchfit.search.fit.__main__", "batchfit.train.__main__"],
)
def test_each_entry_point_masks_the_password_its_config_error_quotes(
    entry_point, module: str, capsys: pytest.CaptureFixture
) -> None:
    # A value that is no precision, quoted back by the check: each entry point stops on it
    # before anything is built (1.5-7.5 s each on 2 busy cores).
    overrides = ["model=small_cnn", "data=digits", "trainer.device=cpu"]
    assert entry_point(module, [*overrides, f"trainer.precision={URL}"]) == 2
    said = capsys.readouterr()
    assert "secret" not in said.out + said.err
    assert "Configuration error" in said.err
    assert "trainer.precision must be one of" in said.err and f"got '{MASKED}'" in said.err
