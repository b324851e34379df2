"""Every command of the bash blocks of the README and of the documentation's pages (docs/*.md),
accounted for: run exactly as written in a fresh directory, as a user following the docs
types it, with its output checked, or mapped to the test or CI step that runs it where this
offline CPU machine cannot. `TABLE` says which; a command missing from it, or a table entry
no page has any more, fails here. The "Bring your own training" guide (docs/byo.md) is
tests/test_guide.py's, and is left out.

The language-model studies' commands are run by tests/test_readme_llm.py, with this
module's helpers: a file of its own, so that pytest-xdist (--dist loadfile) runs them on
another worker than the quick starts.

Each quick-start study runs once; what follows it in the docs (`python -m train +best=...`,
`mlflow ui`, optuna-dashboard) reads the stores it left in the same directory.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from tests.sweeps import free_port
from tests.test_guide import GUIDE, RECOMMENDED, REPO, shell

pytestmark = pytest.mark.slow

FENCE = re.compile(r"^( *)```bash\n(.*?)^ *```", re.S | re.M)
# Where the commands are: the README and the site's pages, the guide excepted.
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p != GUIDE)]
CI = REPO / ".ci" / "run"
STUDY_TIMEOUT_S = 1200  # a time-boxed study takes ~3 min on 2 idle cores; CI's are busier
# optuna-dashboard answers in ~7 s on 2 busy cores; mlflow ui (4 uvicorn workers and its job
# consumers) took 81 s there, 10 s on idle ones
SERVER_TIMEOUT_S = 240


@dataclass(frozen=True)
class Check:
    """How the suite answers for one command of the README or a page of docs/.

    by: the test of this module that runs it as written; `tests.module::test` for a test
    elsewhere that runs what it does (in its own shape: a small model, its own stores);
    `.ci/run` when CI runs it as a step (`line`: the step, where it is not the command).
    why: why it is not run as written here."""

    by: str
    why: str = ""
    line: str = ""
    extra: str = ""  # overrides appended to a study command run here (VARIANT), and why


# The variations on the quick start (docs/index.md) show what a command changes; each trains what
# the quick start does. Run as written, the four would take a quarter of CI (3-4 min each on
# 2 cores); with two trials and no speed check (the quick starts run both), they still show
# what they change: the trials' parameters, the objectives, the recommendation.
VARIANT = "search.n_trials=2 search.speed_check=false"
# The GPT variant's trials on a ninth of the text (40 kB: ~1,200 sequences of 32 bytes), so
# that each takes seconds: it shows its objectives, not what the text teaches.
GPT_VARIANT = f"{VARIANT} data.max_bytes=40000"
# The derived-accumulation study's two trials in fp32: its seeded sampler's first two are bf16
# and fp16, which CPUs without their kernels run 30-40x slower, projecting ~10x the trial
# budget, where the slow rule's edge is. It shows the derived split, not those precisions.
DERIVED_VARIANT = (
    f"{VARIANT} '++search.params={{trainer.effective_batch_size:\"choice(16, 32, 64, 128, 256, "
    '512, 1024, 2048, 4096)",trainer.precision:"choice(fp32)",optimizer.lr:"tag(log, '
    "interval(0.01, 0.5))\"}'"
)
# The LoRA study's trials on a third of its text, three of them: what its guide says it
# logs, not how far it gets in 30 trials.
LLM_VARIANT = "search.n_trials=3 search.speed_check=false data.max_bytes=40000"
OWN_MODEL = (
    "python -m search +experiment=llm_lora model.name_or_path=/path/to/checkpoint "
    "data.tokenizer=/path/to/checkpoint 'data.paths=[/data/train.jsonl]' model.dtype=bfloat16"
)
LLM_FIT = (
    "the reports over the experiments' spaces take minutes on 2 cores (6 tables each); the "
    "test plans both for an H100, 2 micro-batches x 2 checkpointing at 1024 tokens"
)

QLORA_FIT = (
    "each report takes 1.5-2.5 minutes on 2 cores (6 tables); the test plans Llama-3-8B in "
    "NF4 and in bf16 for an RTX 4090 at 2048 tokens, batch 1 and 2 with checkpointing, and "
    "checks the 4-bit state to 4 MiB"
)


CLUSTER = "needs SLURM (and PostgreSQL), GPUs and CIFAR-10: run on the cluster of services.sh"
TABLE: dict[str, Check] = {
    # Quick start (README.md, docs/index.md)
    "python3 -m venv .venv && . .venv/bin/activate": Check("test_virtual_environment"),
    "pip install -e .": Check(
        ".ci/run", "needs PyPI; CI installs the package with its extras", 'pip install -e ".[dev]"'
    ),
    "python -m search +experiment=resnet data=digits": Check("test_quick_start_digits"),
    "python -m search +experiment=gpt": Check("test_quick_start_gpt"),
    'pip install "torch>=2.14" "torchvision>=0.29" --index-url '
    "https://download.pytorch.org/whl/cpu": Check(
        ".ci/run",
        "needs download.pytorch.org; CI checks that its CPU index lists a torch within "
        "pyproject's bound, where it can reach the index",
        'if versions=$(timeout 60 pip index versions torch --index-url "$cpu_index" '
        "2>/dev/null); then",
    ),
    "mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db": Check("test_mlflow_ui"),
    "python -m search.fit +experiment=resnet data=digits": Check("test_fit_report"),
    # Planning a GPU you do not have (docs/gpu-planning.md)
    "python -m search.fit +experiment=gpt search.gpu=A100-40GB": Check("test_fit_for_a_gpu"),
    "python -m search.fit +experiment=resnet data=digits search.gpu=V100-16GB "
    "search.memory_budget=90%": Check(
        "tests.search.test_fit::test_a_report_for_a_gpu_this_machine_lacks_is_in_cuda_reserved_bytes",
        "the same report over ResNet-18's grid takes minutes; the test plans a small CNN for "
        "a V100 and an A100",
    ),
    "python -m search.fit +experiment=gpt model.n_layer=32 model.n_embd=4096 model.n_head=32 "
    "search.gpu=H100-80GB": Check(
        "tests.search.test_advice::test_the_cheapest_levers_that_fit_are_given_as_commands",
        "the 6.4B GPT's report takes a minute and 2 GB here; the tests ask the same of small "
        "models, each lever's figure checked against the predictor: the tiny Llama over a "
        "budget below its fp32 state (bf16 weights first), the small GPT on a T4 "
        "(test_more_cards_then_the_smallest_larger_card: FSDP's ranks, then the smallest "
        "larger card), the message for a state over the card (a 1.2B GPT on a T4)",
    ),
    # Fine-tuning language models (docs/language-models.md)
    'pip install -e ".[llm]"': Check(
        ".ci/run",
        'needs PyPI; CI installs ".[dev]", which holds ".[llm]"',
        'pip install -e ".[dev]"',
    ),
    "python -m search +experiment=llm_lora": Check("test_llm_lora_study", extra=LLM_VARIANT),
    OWN_MODEL: Check(
        "tests.train.test_hf::test_a_local_checkpoint_loads_and_predicts_without_its_weights",
        "needs a checkpoint of one's own; the test saves a tiny one, loads it with LoRA and "
        "predicts it without its weights (test_jsonl_and_text_files_are_tokenised_and_packed: "
        "a local tokenizer and JSONL)",
    ),
    "python -m search.fit +experiment=llm_lora model.config=llama3_8b search.gpu=H100-80GB": Check(
        "tests.search.test_fit::test_8b_fit_reports_for_lora_and_full_fine_tuning", LLM_FIT
    ),
    "python -m search.fit +experiment=llm_lora model.config=llama2_13b model.dtype=bfloat16 "
    "search.gpu=A100-40GB "
    '\'++search.params={trainer.batch_size:"choice(1,2,4)",trainer.accum_steps:"choice(1,8)",'
    'trainer.precision:"choice(bf16)",data.seq_len:"choice(1024)",'
    'trainer.activation_checkpointing:"choice(none)",model.lora.r:null}\'': Check(
        "tests.search.test_fit::test_13b_lora_fits_an_a100_at_batch_1_and_not_at_4",
        "a 13B report takes about 20 s and 2 GB here; the test asks the same cells",
    ),
    "python -m search.fit +experiment=llm_full model.config=llama3_8b model.dtype=bfloat16 "
    "search.gpu=H100-80GB": Check(
        "tests.search.test_fit::test_8b_fit_reports_for_lora_and_full_fine_tuning", LLM_FIT
    ),
    "python -m search.fit +experiment=llm_full model.config=llama3_8b model.dtype=bfloat16 "
    "search.gpu=H100-80GB search.memory_budget=null "
    '\'++search.params={data.seq_len:"choice(128)",trainer.activation_checkpointing:'
    '"choice(none)"}\'': Check(
        "tests.search.test_fit::test_marks_and_notes_of_a_real_report",
        "one 8B table takes a minute here; the test marks a GPT 1024 wide on an A100 whose "
        "larger batches need less than smaller ones, every mark checked against the predictor",
    ),
    "python -m search +experiment=llm_qlora": Check("test_llm_qlora_study", extra=LLM_VARIANT),
    "python -m train +experiment=llm_qlora trainer.batch_size=4 data.seq_len=256": Check(
        "test_llm_qlora_study"
    ),
    "python -m search.fit +experiment=llm_lora model.config=llama3_8b model.quantization=nf4 "
    "search.gpu=RTX-4090": Check(
        "tests.search.test_fit::test_8b_qlora_fits_a_24gb_card_at_2048_tokens", QLORA_FIT
    ),
    "python -m search.fit +experiment=llm_qlora model.config=llama3_8b model.dtype=bfloat16 "
    "search.gpu=RTX-4090 "
    '\'++search.params={data.seq_len:"choice(2048)",model.quantization:"choice(nf4)"}\'': Check(
        "tests.search.test_fit::test_8b_qlora_fits_a_24gb_card_at_2048_tokens", QLORA_FIT
    ),
    # One trial on several GPUs (docs/data-parallel.md)
    "python -m search +experiment=llm_lora trainer.strategy=fsdp trainer.devices=2": Check(
        "tests.search.test_distributed_study::"
        "test_a_study_searches_strategy_and_devices_and_logs_global_figures",
        "30 trials of 2 ranks take longer than CI has; the test runs a study of ddp and fsdp "
        "on 1 and 2 gloo ranks with a small model",
    ),
    "python -m search.fit +experiment=llm_full model.config=llama3_8b model.dtype=bfloat16 "
    "trainer.strategy=fsdp trainer.devices=8 search.gpu=H100-80GB": Check(
        "tests.search.test_fit::test_a_fit_report_per_rank_of_a_data_parallel_layout",
        "the 8B report over the space takes under a minute on 2 cores; the test reports one "
        "rank of FSDP on 8 H100s for the tiny Llama and checks it against the predictor",
    ),
    # Other entry points (docs/index.md)
    "python -m search +experiment=resnet_derived data=digits search.n_trials=4": Check(
        "test_derived_accumulation", extra=DERIVED_VARIANT
    ),
    "python -m search +experiment=gpt search.study_name=gpt-perplexity search.n_trials=4 "
    "'search.objectives=[val/perplexity,throughput/tokens_per_sec]'": Check(
        "test_gpt_perplexity_study", extra=GPT_VARIANT
    ),
    "python -m search model=small_cnn data=digits search.n_trials=4": Check("test_four_levers"),
    "python -m search +experiment=resnet": Check("test_cifar10_offline"),
    "python -m search +experiment=resnet search.memory_budget=90%": Check(
        "test_cifar10_offline", "on a GPU: offline, CIFAR-10 is missing before the budget matters"
    ),
    "python -m train +experiment=resnet data=digits trainer.batch_size=64 trainer.accum_steps=1 "
    "trainer.precision=fp32 optimizer.lr=0.05": Check("test_one_training_run"),
    # Results and metrics (docs/metrics.md)
    "optuna-dashboard mlruns/optuna.journal": Check("test_optuna_dashboard"),
    "optuna-dashboard postgresql://batchfit@db-host:5432/batchfit": Check(
        "test_optuna_dashboard_without_its_database"
    ),
    # Several workers and clusters (docs/workers.md)
    "python -m search --multirun +experiment=resnet search.workers=4 "
    "hydra/launcher=submitit_slurm hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=1 "
    "search.storage=journal:/shared/batchfit/optuna.journal "
    "mlflow.tracking_uri=http://mlflow-host:5000": Check(
        "tests.cluster.test_slurm::test_two_slurm_workers_log_to_a_tracking_server_on_postgresql",
        CLUSTER,
    ),
    "python -m search --multirun +experiment=resnet search.workers=4 "
    "hydra/launcher=submitit_slurm hydra.launcher.gpus_per_node=1 "
    "search.storage=postgresql://batchfit@db-host:5432/batchfit": Check(
        "tests.cluster.test_slurm::test_three_slurm_workers_on_postgresql", CLUSTER
    ),
    "python -m search --multirun +experiment=resnet search.workers=4 hydra/launcher=joblib": Check(
        "tests.test_workers::test_joblib_workers_share_one_study", "needs 4 GPUs and CIFAR-10"
    ),
    "python -m search --multirun +experiment=resnet search.workers=4 "
    "hydra/launcher=submitit_local": Check(
        "tests.test_workers::test_submitit_local_worker_killed_mid_trial",
        "4 ResNet-18 workers on CIFAR-10: hours on a CPU, and no download here",
    ),
    # Experiments and search spaces (docs/experiments.md)
    "python -m search +experiment=resnet data=digits search.study_name=resnet-digits-fp32 "
    "search.n_trials=4 "
    '\'++search.params={trainer.precision:"choice(fp32)",trainer.accum_steps:'
    '"choice(1,2,4,8)",trainer.grad_clip_norm:"choice(0.5,1.0)",optimizer.lr:null}\'': Check(
        "test_space_from_the_command_line", extra=VARIANT
    ),
    "python -m search +experiment=resnet data=digits search.study_name=resnet-digits-to-target "
    "search.n_trials=4 \"search.target='val/acc>=0.9'\" 'search.objectives=[time/to_target_s]' "
    "search.recommend.metric=time/to_target_s trainer.max_epochs=3": Check(
        "test_time_to_target", extra=VARIANT
    ),
    # Testing and contributing (docs/testing.md)
    'pip install -e ".[dev]"': Check(".ci/run", "needs PyPI; CI installs exactly this"),
    "pytest": Check(".ci/run", "the whole suite, this module included"),
    'pytest -m "not slow"': Check("test_pytest_markers", "a second pytest run of the suite"),
    'pytest -m "not study and not slow"': Check(
        "test_pytest_markers", "a second pytest run of the suite"
    ),
    "pytest -m gpu": Check("test_pytest_markers", "a second pytest run of the suite"),
    "tests/cluster/services.sh install": Check(".ci/run", "as root: installs Debian packages"),
    'eval "$(tests/cluster/services.sh up)"': Check(".ci/run", "as root: starts system services"),
    "pytest tests/cluster": Check(
        "tests.cluster.test_slurm::test_three_slurm_workers_on_a_journal_file",
        "needs the services of services.sh up; CI's `pytest` runs tests/cluster",
    ),
    "tests/cluster/services.sh down": Check(
        ".ci/run", "as root: stops system services", "trap 'tests/cluster/services.sh down' EXIT"
    ),
    "mkdocs build --strict": Check(
        "tests.test_docs::test_the_site_builds_strictly",
        "the test builds into a temporary --site-dir, so that it leaves no site/ in the checkout",
    ),
}


def _command(line: str) -> str:
    """A shell line without its comment, runs of blanks outside quotes made one."""
    out, quote, blank = [], None, False
    for i, char in enumerate(line):
        if quote is None and char == "#" and (i == 0 or line[i - 1].isspace()):
            break
        if quote is None and char.isspace():
            blank = True
            continue
        if blank and out:
            out.append(" ")
        blank = False
        out.append(char)
        if quote is None and char in "'\"":
            quote = char
        elif char == quote:
            quote = None
    return "".join(out)


def readme_commands() -> list[str]:
    """Every command of the bash blocks of the README and the pages but the guide, in order:
    `\\` continuations joined, comments (and `# then:` lines) dropped."""
    commands = []
    for page in PAGES:
        for _, body in FENCE.findall(page.read_text()):
            lines = textwrap.dedent(body).replace("\\\n", " ").splitlines()
            commands += [c for c in map(_command, lines) if c]
    return commands


def commands_of(test: str) -> list[str]:
    """The commands `test` runs, in the order of PAGES."""
    found = [c for c in dict.fromkeys(readme_commands()) if TABLE.get(c, Check("")).by == test]
    assert found, f"neither the README nor docs/ has a command for {test} any more"
    return found


def test_every_readme_command_is_in_the_table() -> None:
    commands = readme_commands()
    assert len(commands) >= 20, commands  # the blocks were found
    unknown = [c for c in commands if c not in TABLE]
    assert not unknown, f"commands of the docs no test answers for (add them to TABLE): {unknown}"
    gone = [c for c in TABLE if c not in commands]
    assert not gone, f"TABLE entries neither the README nor docs/ has any more: {gone}"


def _llm_half() -> object:
    return importlib.import_module("tests.test_readme_llm")


def test_every_check_names_a_test_or_a_ci_step() -> None:
    ci = [line.strip() for line in CI.read_text().splitlines()]  # a step may be indented
    for command, check in TABLE.items():
        if check.by == ".ci/run":
            assert (check.line or command) in ci, f"{CI} does not run {command!r}"
        elif "::" in check.by:
            module, name = check.by.split("::")
            assert callable(getattr(importlib.import_module(module), name, None)), check.by
            assert check.why, f"say why {command!r} is not run here"
        elif check.by:
            # A test of this module, or of its language-model half (run on another worker)
            here = globals().get(check.by) or getattr(_llm_half(), check.by, None)
            assert callable(here), f"{check.by} (for {command!r}) is missing"
        else:
            assert check.why, f"{command!r}: nothing runs it; say why"


# ---- running them --------------------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    """A study command's output and what it left in the directory."""

    command: str
    out: str
    study: optuna.Study


def _env() -> dict[str, str]:
    """The environment test_guide.shell gives a command: this interpreter's `python` first,
    the repository not on the import path, no MLflow store from outside."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _fails(command: str, cwd: Path, timeout: int = 300) -> tuple[int, str, float]:
    """(exit status, stdout + stderr, seconds) of a command expected to fail."""
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def _study(cwd: Path, out: str) -> optuna.Study:
    name = re.search(r"^Study (\S+):", out, re.M).group(1)
    storage = JournalStorage(JournalFileBackend(str(cwd / "mlruns" / "optuna.journal")))
    return optuna.load_study(study_name=name, storage=storage)


def _run_study(command: str, cwd: Path) -> Ran:
    """The study command, with its table entry's `extra` overrides appended (a later
    override of a key wins in Hydra)."""
    extra = TABLE[command].extra
    out = shell(f"{command} {extra}".strip(), cwd, timeout=STUDY_TIMEOUT_S).stdout
    return Ran(command, out, _study(cwd, out))


def _check_study(ran: Ran, name: str) -> optuna.trial.FrozenTrial:
    """A study that ended as the README says: its name, a recommendation among its completed
    trials, the memory boundary and the way to the MLflow UI; the recommended trial."""
    out = ran.out
    assert ran.study.study_name == name, out
    assert re.search(rf"^Study {re.escape(name)}: \d+ finished trials", out, re.M), out
    assert "Memory boundary (batch size per cell;" in out, out
    recommended = RECOMMENDED.search(out)
    assert recommended, out
    trial = ran.study.trials[int(recommended.group(1))]
    assert trial.state == TrialState.COMPLETE
    assert re.search(r"^In MLflow: mlflow ui --backend-store-uri \S+, then open http", out, re.M)
    assert "Traceback" not in out
    return trial


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's working directory: fresh, outside the repository."""
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def quick_starts(workdir: Path) -> dict[str, Ran]:
    """The quick start's two studies, once each, in README order."""
    return {
        test: _run_study(command, workdir)
        for test in ("test_quick_start_digits", "test_quick_start_gpt")
        for command in commands_of(test)
    }


def test_virtual_environment(workdir: Path) -> None:
    (command,) = commands_of("test_virtual_environment")
    shell(command, workdir)
    assert (workdir / ".venv" / "bin" / "python").exists()
    assert (workdir / ".venv" / "bin" / "activate").is_file()


def test_quick_start_digits(
    quick_starts: dict[str, Ran], workdir: Path, hydra_conf: Callable[..., DictConfig]
) -> None:
    ran = quick_starts["test_quick_start_digits"]
    trial = _check_study(ran, "resnet-digits")
    # README: "no new trial starts after 2 minutes".
    assert hydra_conf(shlex.split(ran.command)[3:]).search.timeout_s == 120
    # The link of the README and of the site's home is the one the first study prints (the
    # first experiment: id 1).
    for page in (REPO / "README.md", REPO / "docs" / "index.md"):
        link = re.search(r"^# then: (\S+)$", page.read_text(), re.M).group(1)
        assert f"then open {link}\n" in ran.out, page
    # `python -m train +best=PATH`, the path as the study printed it, trains the trial again,
    # seeded and by the trial's code path: the same accuracy (observed: to the last digit).
    best = re.search(r"^or: (python -m train \+best=(\S+))$", ran.out, re.M)
    assert best and (workdir / best.group(2)).is_file(), ran.out
    # On as many intra-op threads as the study took: each entry point picks them by how busy
    # the cores are when it starts (train/parallel/threads.py), and another thread count sums floats
    # in another order (under the full suite: 0.9666 against 0.9721).
    threads = re.search(r"^torch: (\d+) intra-op threads? per worker", ran.out, re.M)
    assert threads, ran.out
    again = shell(f"{best.group(1)} search.threads={threads.group(1)}", workdir).stdout
    assert "in experiment 'resnet-digits'" in again  # logged beside the study's runs
    acc = re.search(r"val/acc ([0-9.]+)", again.splitlines()[-1])
    assert acc, again
    document = yaml.safe_load((workdir / best.group(2)).read_text())
    if document.get("trained_by_a_trial", True):
        assert float(acc.group(1)) == pytest.approx(
            trial.user_attrs["metrics"]["val/acc"], abs=1e-4
        )
    else:
        # A fit report cell no trial trained (recommended by its predicted time to target):
        # no trial measured this configuration, so there is no accuracy to equal; the rerun
        # trains the cell's geometry, at the rate taken from `trial`.
        batch, accum = document["configuration"].split()[0].split("x")
        assert f"trainer.batch_size={batch}" in document["overrides"], document
        assert f"trainer.accum_steps={accum}" in document["overrides"], document
        assert 0 < float(acc.group(1)) <= 1, again


def test_quick_start_gpt(
    quick_starts: dict[str, Ran], workdir: Path, hydra_conf: Callable[..., DictConfig]
) -> None:
    """The GPT quick start, as the README runs it: its figures in tokens, the prediction
    exact on CPU, what MLflow holds, and the printed rerun."""
    ran = quick_starts["test_quick_start_gpt"]
    trial = _check_study(ran, "gpt-python_stdlib")
    assert ran.study.metric_names == ["val/loss", "throughput/tokens_per_sec"]
    assert "data.seq_len" in trial.params  # the sequence length is searched too
    assert trial.user_attrs["metrics"]["throughput/tokens_per_sec"] > 0
    # README: "about 3 minutes, time-boxed the same way".
    cfg = hydra_conf(shlex.split(ran.command)[3:])
    assert cfg.search.timeout_s is not None, "search.timeout_s is not set: it runs all its trials"
    done = [t for t in ran.study.trials if t.state == TrialState.COMPLETE]
    for t in done:
        figures = t.user_attrs["metrics"]
        # Tokens are samples x seq_len here (no padding): the two throughputs agree.
        assert figures["throughput/tokens_per_sec"] == pytest.approx(
            figures["throughput/samples_per_sec"] * t.params["data.seq_len"], rel=1e-6
        )
        assert t.values == [figures["val/loss"], figures["throughput/tokens_per_sec"]]
        assert figures["val/perplexity"] == pytest.approx(math.exp(figures["val/loss"]))
        # Bytes of Python source: well below the 5.55 nats of a uniform guess over 256.
        assert figures["val/loss"] < math.log(256)
        # On CPU the prediction is the same accounting as the measurement: exact.
        assert t.user_attrs["prediction_error"] == 0.0
        assert t.user_attrs["unit"] == "tokens"
    # A micro-batch of 128 x 256 tokens needs ~680 MiB in fp32, over the experiment's 160 MiB:
    # the fit report says so in both precisions and accumulations (its 4 cells), and a trial
    # the sampler drew there (if one) is pruned before it trains.
    big = [
        cell
        for cell in ran.study.user_attrs["fit_report"]
        if cell["trainer.batch_size"] * cell["data.seq_len"] >= 128 * 256
    ]
    assert len(big) == 4 and not any(cell["fits"] for cell in big)
    for t in ran.study.trials:
        if t.params["trainer.batch_size"] * t.params["data.seq_len"] >= 128 * 256:
            assert t.state == TrialState.PRUNED and t.user_attrs["reason"] == "oom_predicted"
    assert "tokens/s" in ran.out
    # The pick by tokens/s: from the trials' figures, or, when several candidates finished
    # within the time box (how many depends on the machine), by the speed check's timing.
    recommended = re.search(r"^Recommended: (trial .*)$", ran.out, re.M).group(1)
    if "speed check:" in recommended:
        assert re.search(r"speed check: .* \d+ tokens/s \(", recommended), recommended
    else:
        assert "the best throughput/tokens_per_sec" in recommended, recommended

    client = MlflowClient(f"sqlite:///{workdir}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name(ran.study.study_name)
    runs = client.search_runs([experiment.experiment_id], "tags.`batchfit.role` = 'trial'")
    completed = [r for r in runs if r.data.tags["batchfit.state"] == "COMPLETE"]
    assert len(completed) == len(done)
    for run in completed:
        for name in ("throughput/tokens_per_sec", "val/perplexity", "memory/prediction_error",
                     "time/data_wait_share", "perf/mfu"):  # fmt: skip
            assert name in run.data.metrics, name
        # Which text the run saw: the corpus's hash and what the model was built for.
        assert len(run.data.params["data_info.corpus_sha256"]) == 64
        assert run.data.params["data_info.vocab_size"] == "256"

    # The printed rerun trains the recommended configuration again, to the same val loss.
    rerun = re.search(r"^Train it again: (python -m train .*)$", ran.out, re.M)
    assert rerun, ran.out
    again = shell(rerun.group(1), workdir).stdout
    val_loss = float(again.split("val/loss ")[-1].split()[0])
    assert val_loss == pytest.approx(trial.user_attrs["metrics"]["val/loss"], abs=1e-4)
    assert "tokens/s" in again


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.load(answer)


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def server(workdir: Path) -> Iterator[Callable[[str, int, str], str]]:
    """serve(command, port, probe) -> its URL: a server command started in the directory, in
    a process group of its own, polled until the path `probe` answers; stopped afterwards."""
    started: list[tuple[subprocess.Popen, object]] = []

    def serve(command: str, port: int, probe: str) -> str:
        log = (workdir / f"server-{port}.log").open("w")
        process = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=workdir, env=_env(), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        started.append((process, log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(
                    f"$ {command} exited ({process.returncode}):\n{Path(log.name).read_text()}"
                )
            try:
                urllib.request.urlopen(url + probe, timeout=5).close()
                return url
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        pytest.fail(f"$ {command} did not answer in {SERVER_TIMEOUT_S} s")

    yield serve
    for process, log in started:  # the server and the workers it started: its process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # workers that outlived it
        process.wait()
        log.close()


def test_mlflow_ui(quick_starts: dict[str, Ran], server: Callable[[str, int, str], str]) -> None:
    (command,) = commands_of("test_mlflow_ui")
    # As written where its port (MLflow's 5000) is free; elsewhere on a free one.
    port = 5000 if _free(5000) else free_port()
    url = server(command if port == 5000 else f"{command} --port {port}", port, "/health")
    for ran in quick_starts.values():
        link = re.search(r"then open (\S+)$", ran.out, re.M).group(1)
        experiment_id = re.search(r"/#/experiments/(\d+)/runs\?", link).group(1)
        experiment = _get(f"{url}/api/2.0/mlflow/experiments/get?experiment_id={experiment_id}")
        experiment = experiment["experiment"]
        assert experiment["name"] == ran.study.study_name
        tags = {t["key"]: t["value"] for t in experiment["tags"]}
        assert "batchfit" in link and "mlflow.sharedViewState.batchfit" in tags  # the view
        request = urllib.request.Request(
            f"{url}/api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [experiment_id], "max_results": 1000}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            runs = json.load(answer)["runs"]
        roles = sorted(
            tag["value"] for r in runs for tag in r["data"]["tags"] if tag["key"] == "batchfit.role"
        )
        trained = [t for t in ran.study.trials if "mlflow_run_id" in t.user_attrs]
        assert roles.count("study") == 1 and roles.count("trial") == len(trained), roles


def _fit_report(out: str) -> str:
    """The first fit report printed, without the line that says how long it took."""
    start = out.index("Fit report for ")
    return out[start : out.index("predicted in", start)]


def test_fit_report(quick_starts: dict[str, Ran], workdir: Path) -> None:
    (command,) = commands_of("test_fit_report")
    out = shell(command, workdir, timeout=300).stdout
    assert "largest that fits" in out and "nothing trained" in out, out
    # The same prediction as the tables the study kept (it prints their boundary in a few
    # lines, then where they are).
    study_out = quick_starts["test_quick_start_digits"].out
    kept = re.search(r"^The full tables: (\S+fit_report\.txt) ", study_out, re.M).group(1)
    assert _fit_report(out) == _fit_report((workdir / kept).read_text())


def test_fit_for_a_gpu(workdir: Path) -> None:
    """The fit report for an A100 on this CPU-only machine: CUDA's reserved bytes for the
    card, in both precisions of the space."""
    (command,) = commands_of("test_fit_for_a_gpu")
    out = " ".join(shell(command, workdir).stdout.split())
    assert "Fit report for A100-40GB (39.4 GiB, CUDA reserve, planned: not on this machine)" in out
    assert "Traceback" not in out and "largest that fits" in out and "bf16" in out


def test_derived_accumulation(quick_starts: dict[str, Ran], workdir: Path) -> None:
    (command,) = commands_of("test_derived_accumulation")
    ran = _run_study(command, workdir)
    _check_study(ran, "resnet_derived-digits")
    trained = [t for t in ran.study.trials if t.state == TrialState.COMPLETE]
    for t in trained:  # the effective batch sampled; batch x accumulation derived from it
        assert "trainer.accum_steps" not in t.params, t.params
        attrs = t.user_attrs
        effective = t.params["trainer.effective_batch_size"]
        assert attrs["trainer.batch_size"] * attrs["trainer.accum_steps"] == effective


def test_gpt_perplexity_study(quick_starts: dict[str, Ran], workdir: Path) -> None:
    (command,) = commands_of("test_gpt_perplexity_study")
    ran = _run_study(command, workdir)
    _check_study(ran, "gpt-perplexity")
    assert ran.study.metric_names == ["val/perplexity", "throughput/tokens_per_sec"]
    # A study of its own: the quick start's GPT study is untouched.
    assert quick_starts["test_quick_start_gpt"].study.metric_names[0] == "val/loss"


def test_four_levers(quick_starts: dict[str, Ran], workdir: Path) -> None:
    (command,) = commands_of("test_four_levers")
    ran = _run_study(command, workdir)
    trial = _check_study(ran, "batchfit-small_cnn-digits")
    levers = {"trainer.batch_size", "trainer.accum_steps", "trainer.precision", "optimizer.lr"}
    assert set(trial.params) == levers


def test_cifar10_offline(workdir: Path) -> None:
    # No internet here: the download fails within data.download_timeout_s (10 s), before any
    # trial, and the message says where the data belongs and what runs offline. With
    # search.memory_budget=90% (on a GPU: its memory) it is the same; the budget is valid.
    for command in commands_of("test_cifar10_offline"):
        rc, out, seconds = _fails(command, workdir)
        assert rc == 2, out  # a configuration error
        assert (
            "Configuration error\n- CIFAR-10 is not in data.root='data/cifar10' and could not be "
            "downloaded (URLError: " in out
        ), out
        assert (
            "copy the 'cifar-10-batches-py' folder into data.root, or use the offline "
            "alternatives: data=digits (scikit-learn's bundled digits) or data=synthetic" in out
        ), out
        assert "memory_budget" not in out and "Traceback" not in out, out
        assert seconds < 120, out  # 18-23 s on 2 busy cores


def test_one_training_run(quick_starts: dict[str, Ran], workdir: Path) -> None:
    (command,) = commands_of("test_one_training_run")
    out = shell(command, workdir, timeout=600).stdout
    # "lr 0.025 (optimizer.lr=0.05 scaled linear to effective batch 64 from ...=128)"
    assert "Training on cpu: batch 64 x 1 = 64, fp32, lr 0.025 " in out, out
    acc = re.search(r"^val/acc (0\.\d+) \| val/loss ", out.splitlines()[-1])
    assert acc, out
    # Logged as a run of its own, in the MLflow experiment of runs that retrain no trial.
    run_id = re.search(r"MLflow run (\w+)", out).group(1)
    client = MlflowClient(f"sqlite:///{workdir}/mlruns/mlflow.db")
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "train"
    assert run.data.metrics["val/acc"] == pytest.approx(float(acc.group(1)), abs=1e-4)


def test_optuna_dashboard(
    quick_starts: dict[str, Ran], server: Callable[[str, int, str], str]
) -> None:
    (command,) = commands_of("test_optuna_dashboard")
    port = free_port()  # its own default, 8080, is often taken
    url = server(f"{command} --port {port}", port, "/api/meta")
    names = {s["study_name"] for s in _get(f"{url}/api/studies")["study_summaries"]}
    assert {ran.study.study_name for ran in quick_starts.values()} <= names


def test_optuna_dashboard_without_its_database(workdir: Path) -> None:
    # db-host stands for the reader's server: here it does not resolve, and the dashboard
    # (its PostgreSQL driver installed) says so.
    (command,) = commands_of("test_optuna_dashboard_without_its_database")
    rc, out, _ = _fails(f"{command} --port {free_port()}", workdir, timeout=120)
    assert rc == 1 and "failed to resolve host 'db-host'" in out, out


def test_space_from_the_command_line(quick_starts: dict[str, Ran], workdir: Path) -> None:
    (command,) = commands_of("test_space_from_the_command_line")
    ran = _run_study(command, workdir)
    _check_study(ran, ran.study.study_name)
    proposed = [t for t in ran.study.trials if t.params]
    assert proposed
    for t in proposed:  # narrowed, widened, added and dropped as docs/experiments.md says
        assert t.params["trainer.precision"] == "fp32"
        assert t.params["trainer.accum_steps"] in (1, 2, 4, 8)
        assert t.params["trainer.grad_clip_norm"] in (0.5, 1.0)
        assert "optimizer.lr" not in t.params


def test_time_to_target(quick_starts: dict[str, Ran], workdir: Path) -> None:
    (command,) = commands_of("test_time_to_target")
    target = float(re.search(r"val/acc>=([0-9.]+)", command).group(1))
    ran = _run_study(command, workdir)
    _check_study(ran, ran.study.study_name)
    assert ran.study.metric_names == ["time/to_target_s"]
    for t in ran.study.trials:
        figures = t.user_attrs.get("metrics", {})
        if t.state == TrialState.COMPLETE:  # stopped at the first validation at the target
            assert figures["val/acc"] >= target and figures["time/to_target_s"] > 0
        elif t.state == TrialState.PRUNED:
            assert t.user_attrs["reason"] in ("missed_target", "slow", "oom_predicted", "oom")
    # The time to target is the user's: val/acc's, never a loss the trials happened to share.
    assert "the loss every batch size reached" not in ran.out
    if "Time to target, predicted:" in ran.out:
        assert f"val/acc >= {target:g} (search.target)" in ran.out


def test_pytest_markers() -> None:
    # `pytest -m "not slow"`, `-m "not study and not slow"` and `-m gpu` select by markers
    # that --strict-markers requires to be registered; each marks tests.
    config = (REPO / "pyproject.toml").read_text()
    for command in commands_of("test_pytest_markers"):
        expression = command.split(" -m ", 1)[1].strip('"')
        for marker in set(expression.split()) - {"not", "and", "or"}:
            assert re.search(rf'^\s*"{marker}: ', config, re.M), marker
            marked = [
                p for p in (REPO / "tests").rglob("test_*.py") if f"mark.{marker}" in p.read_text()
            ]
            assert marked, f"no test is marked {marker}"
