"""Messages of `python -m search`, `python -m search.fit` and `python -m train` that named no
key or gave the wrong fix: a choice in the wrong case, a LoRA rank of 0, a corrupt MLflow
store, a comma list without --multirun, and a tracking server that does not answer. Each is
read as a user reads it: on a real process's output, or with pytest.raises(match=...)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

from batchfit.common.checks import ConfigError, choice_problems
from batchfit.tracking import store as tracking_store
from batchfit.tracking.store import open_client, retry_at_start
from batchfit.train.build import unknown_settings
from batchfit.train.config import TrainerConfig
from batchfit.train.language.hf import lora_problems
from batchfit.train.plan import plan
from batchfit.train.run import check_builds
from tests.sweeps import free_port, run_module

FAST = ["model=small_cnn", "model.width=4", "data=digits", "trainer.max_epochs=1"]
ENTRY_POINTS = ["search", "search.fit", "train"]
LLM = ["+experiment=llm_lora", "data.max_bytes=20000", "data.seq_len=32", "trainer.device=cpu"]


def stopped(module: str, args: list[str], cwd: Path, returncode: int = 2) -> str:
    """What a command that stopped on a message printed on stderr, its lines joined (rich
    wraps them at the terminal's width); no traceback anywhere."""
    done: subprocess.CompletedProcess = run_module(module, args, cwd, returncode=returncode)
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "Error executing job" not in output, output
    return " ".join(done.stderr.split())


# ---- 1. a choice in the wrong case: the fix offered was the default, not the choice meant


def test_a_choice_in_the_wrong_case_is_offered_in_its_case(tmp_path: Path) -> None:
    """`trainer.precision=FP32` was told `override with trainer.precision=bf16`."""
    message = stopped(
        "train", ["model=small_cnn", "data=digits", "trainer.precision=FP32"], tmp_path
    )
    assert (
        "trainer.precision must be one of fp32, tf32, bf16, fp16, got 'FP32'; override with "
        "trainer.precision=fp32" in message
    )


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"precision": "FP16"}, r"got 'FP16'; override with trainer\.precision=fp16$"),
        ({"device": "CPU"}, r"got 'CPU'; override with trainer\.device=cpu$"),
        ({"lr_scaling": "Sqrt"}, r"got 'Sqrt'; override with trainer\.lr_scaling=sqrt$"),
        ({"strategy": "FSDP", "devices": 2}, r"got 'FSDP'; override with trainer\.strategy=fsdp$"),
        ({"lr_scaling": "sqrtt"}, r"got 'sqrtt'; override with trainer\.lr_scaling=sqrt$"),
        ({"precision": "FP61"}, r"got 'FP61'; override with trainer\.precision=fp16$"),
        ({"precision": "fp8"}, r"got 'fp8'; override with trainer\.precision=bf16$"),  # none near
        # another short word is not a typo of it: the key's own fix, not cpu
        ({"device": "gpu"}, r"got 'gpu'; override with trainer\.device=auto$"),
    ],
)
def test_every_choice_key_offers_the_choice_meant(settings: dict, match: str) -> None:
    """The case-folded match first, else difflib's closest, else the key's own default fix
    (each fix here differs from the key's default, which the old message offered)."""
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(**settings)


def test_a_choice_that_is_no_string_gets_the_default_fix() -> None:
    assert choice_problems("k", 3, ("a", "b"), "a") == [
        "k must be one of a, b, got 3; override with k=a"
    ]


# ---- 2. a LoRA setting peft refuses (or trains nothing with): peft's sentence, no key


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_a_lora_rank_of_zero_is_refused_naming_the_key(tmp_path: Path, module: str) -> None:
    """peft said "`r` should be a positive integer value but the value passed is 0", under
    "model (...causal_lm) cannot be built"."""
    message = stopped(module, [*LLM, "search.n_trials=1", "model.lora.r=0"], tmp_path)
    assert (
        "model.lora.r=0: the rank of the LoRA adapters (their inner width); it must be a "
        "positive integer, e.g. model.lora.r=8" in message
    )
    assert "should be a positive integer value" not in message and "cannot be built" not in message


POSITIVE = "it must be a positive integer"
ABOVE_ZERO = "it must be a number > 0"
FRACTION = "it must be a number in [0, 1)"


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("model.lora.r=0", f"{POSITIVE}, e.g. model.lora.r=8"),
        ("model.lora.r=2.5", POSITIVE),
        ("model.lora.r=null", POSITIVE),
        ("model.lora.alpha=0", f"{ABOVE_ZERO}, e.g. model.lora.alpha=16 (2 x r)"),
        ("model.lora.alpha=-8", ABOVE_ZERO),
        ("model.lora.dropout=1.0", f"{FRACTION}, e.g. model.lora.dropout=0.05 (0.0: none)"),
        ("model.lora.dropout=-0.1", FRACTION),
    ],
)
def test_lora_values_are_checked_before_the_model_is_built(
    hydra_conf, override: str, fix: str
) -> None:
    """Found by the settings check that runs before any build (train/build.py
    unknown_settings), and so by check_builds, which the entry points run."""
    cfg = hydra_conf([*LLM, override])
    (problem,) = unknown_settings("model", cfg.model)
    assert problem.startswith(f"{override}: ") and fix in problem, problem
    with pytest.raises(ConfigError, match=rf"{re.escape(override)}: .*; {re.escape(fix)}"):
        check_builds(cfg, plan(cfg, None))


def test_good_lora_values_and_peft_own_names() -> None:
    assert lora_problems({"r": 4, "alpha": 8.5, "dropout": 0.1, "target_modules": ["q"]}) == []
    (problem,) = lora_problems({"lora_alpha": 0})
    assert problem.startswith("model.lora.lora_alpha=0: ")
    assert problem.endswith("it must be a number > 0, e.g. model.lora.lora_alpha=16 (2 x r)")


# ---- 3. a corrupt MLflow store: the advice was to start a tracking server


@pytest.mark.slow
def test_a_corrupt_store_is_said_so_and_moving_it_aside_works(tmp_path: Path) -> None:
    store = tmp_path / "mlruns" / "mlflow.db"
    store.parent.mkdir()
    store.write_bytes(bytes(range(256)) * 16)  # garbage: what an overwrite leaves
    message = stopped("train", FAST, tmp_path)
    assert (
        "mlflow.tracking_uri='sqlite:///mlruns/mlflow.db': the store mlruns/mlflow.db is "
        "corrupt, not a SQLite database that can be read (file is not a database)" in message
    )
    assert "mv mlruns/mlflow.db mlruns/mlflow.db.corrupt; or restore it from a backup" in message
    assert "start the tracking server" not in message
    store.rename(store.with_name("mlflow.db.corrupt"))  # the advice, followed
    run_module("train", FAST, tmp_path)
    assert store.is_file()


def test_a_truncated_store_is_said_to_be_corrupt(tmp_path: Path) -> None:
    whole = tmp_path / "whole.db"
    open_client(f"sqlite:///{whole}")
    truncated = tmp_path / "truncated.db"
    shutil.copyfile(whole, truncated)
    os.truncate(truncated, 4096)  # one page of many: what a full disk or a cut copy leaves
    with pytest.raises(ConfigError, match=r"is corrupt, .*\(database disk image is malformed\)"):
        open_client(f"sqlite:///{truncated}")


# ---- 4. a comma list without --multirun: Hydra's advice was a list, or --multirun


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_a_comma_list_without_multirun_says_search_or_multirun(tmp_path: Path, module: str) -> None:
    message = stopped(module, [*FAST, "trainer.batch_size=32,64"], tmp_path)
    search = "search.fit" if module == "search.fit" else "search"
    fast = " ".join(FAST)
    assert (
        f"trainer.batch_size=32,64 gives a key several values, which python -m {module} takes "
        "only in search.params or with --multirun" in message
    )
    assert (
        f"python -m {search} {fast} '++search.params={{trainer.batch_size:\"choice(32,64)\"}}'"
        in message
    )
    assert f"python -m train --multirun {fast} trainer.batch_size=32,64" in message
    assert "Ambiguous value" not in message and "value1" not in message


def test_a_comma_list_for_a_key_that_holds_a_list_takes_brackets(tmp_path: Path) -> None:
    message = stopped("search.fit", [*FAST, "search.objectives=val/loss,val/acc"], tmp_path)
    assert (
        "search.objectives=val/loss,val/acc: search.objectives holds a list, which Hydra reads "
        "in brackets" in message
    )
    assert "write search.objectives=[val/loss,val/acc]" in message
    assert "search.params" not in message


# ---- 5. a tracking server that does not answer: 30 s of silence before the message


def test_waiting_for_a_server_is_said_at_the_first_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tracking_store, "START_RETRY_S", 0.5)
    said_before: list[str] = []

    def refused() -> None:
        said_before.append(capsys.readouterr().err)
        raise MlflowException(
            "Failed to establish a new connection: [Errno 111] Connection refused"
        )

    with pytest.raises(ConfigError, match="start the tracking server"):
        retry_at_start(refused, "http://user:secret@127.0.0.1:9")
    line = (
        "MLflow at http://user:***@127.0.0.1:9 does not answer (connection refused); "
        "retrying for up to 0.5 s\n"
    )
    assert said_before[:2] == ["", line]  # at once: before the second attempt
    assert "".join(said_before[2:]) + capsys.readouterr().err == ""  # once


def test_a_sqlite_peer_creating_the_schema_is_waited_for_silently(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls = []

    def locked_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise MlflowException("database is locked")
        return "answered"

    assert retry_at_start(locked_once, "sqlite:///mlflow.db") == "answered"
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_an_unreachable_server_is_said_to_be_waited_for_then_refused(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    message = stopped("train", [*FAST, f"mlflow.tracking_uri={url}"], tmp_path)
    # 30 s of retries (START_RETRY_S) and the imports; 10 minutes is a hang
    assert time.monotonic() - started < 600
    waiting = f"MLflow at {url} does not answer (connection refused); retrying for up to 30 s"
    refused = f"mlflow.tracking_uri={url!r} cannot be used (MlflowException:"
    assert waiting in message and refused in message
    assert message.index(waiting) < message.index(refused)
    assert "start the tracking server, or use a local store" in message
