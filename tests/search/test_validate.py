"""Bad input stops the study before any trial, with one message per problem naming the key
and the fix, and nothing already recorded is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.search.core.record import Attr
from batchfit.search.study.driver import StudyDriver
from tests.sweeps import run_module

REPO = Path(__file__).resolve().parents[2]
FAST = ["model=small_cnn", "model.width=4", "data=digits", "trainer.max_epochs=1"]


def _prepare(hydra_conf, overrides: list[str]) -> StudyDriver:
    overrides = [*FAST, "search.study_name=v", *overrides]
    return StudyDriver.prepare(
        hydra_conf(overrides), overrides, {}, Console(record=True, width=200)
    )


CASES = {
    "unknown precision": (
        ["trainer.precision=fp8"],
        r"trainer.precision must be one of fp32, tf32, bf16, fp16, got 'fp8'; "
        r"override with trainer.precision=bf16",
    ),
    "unknown precision in the space": (
        ["+search.params={trainer.precision:'choice(fp32,fp8)'}"],
        r"search.params.trainer.precision: value fp8 is invalid: trainer.precision must be one of",
    ),
    "low > high": (
        ["+search.params={optimizer.lr:'interval(0.5,0.1)'}"],
        r"search.params.optimizer.lr: interval\(0.5,0.1\) has low 0.5 > high 0.1; swap the bounds",
    ),
    "non-positive log bound": (
        ["+search.params={optimizer.lr:'tag(log, interval(0, 0.1))'}"],
        r"search.params.optimizer.lr: .* log scale but its low bound 0.0 is not positive",
    ),
    "batch size 0": (
        ["trainer.batch_size=0"],
        r"trainer.batch_size must be an integer >= 1, got 0; override with trainer.batch_size=1",
    ),
    "batch size 0 in the space": (
        ["+search.params={trainer.batch_size:'choice(0,16)'}"],
        r"search.params.trainer.batch_size: value 0 is invalid: trainer.batch_size must be an "
        r"integer >= 1",
    ),
    "accumulation 0": (
        ["+search.params={trainer.accum_steps:'range(0,4)'}"],
        r"search.params.trainer.accum_steps: value 0 is invalid: trainer.accum_steps must be",
    ),
    "unparsable budget": (
        ["search.memory_budget='8GB?'"],
        r"search.memory_budget: '8GB\?' is not a memory size; use bytes .*8GiB, 512MiB.*90%",
    ),
    "budget below the parameters": (
        # small_cnn(width=4): 1.8 KiB of parameters, x3 with gradients and momentum, plus the
        # BatchNorm buffers
        ["search.memory_budget=1KiB"],
        r"search.memory_budget=1.0 KiB is below the 5.4 KiB that the parameters, gradients and "
        r"optimizer state alone \(predicted\) need; the smallest step \(batch size 1 in fp32\) "
        r"needs \d+\.\d KiB\. Raise it",
    ),
    "unknown search key": (
        ["+search.params={trainer.batchsize:'choice(1,2)'}"],
        r"search.params.trainer.batchsize: 'trainer.batchsize' is not a key of the composed "
        r"config; did you mean trainer.batch_size\?",
    ),
    "storage that cannot be opened": (
        ["search.storage=sqlite:////proc/batchfit/optuna.db"],
        r"search.storage='sqlite:////proc/batchfit/optuna.db' cannot be opened",
    ),
    "unknown objective": (
        ["search.objectives=[val/accuracy]"],
        r"search.objectives: unknown metric 'val/accuracy'; this task reports val/acc, val/loss",
    ),
    "mistyped pruner": (
        ["search.pruner._target_=optuna.pruners.MedianPrunner"],
        r"search.pruner._target_='optuna.pruners.MedianPrunner' cannot be imported \(module "
        r"'optuna.pruners' has no attribute 'MedianPrunner'\); did you mean "
        r"optuna.pruners.MedianPruner\? Optuna's pruners: optuna.pruners.HyperbandPruner, ",
    ),
    "not a pruner": (
        [
            "search.pruner._target_=optuna.samplers.TPESampler",
            "~search.pruner.n_startup_trials",
            "~search.pruner.n_warmup_steps",
        ],
        r"search.pruner._target_='optuna.samplers.TPESampler' is not an Optuna pruner",
    ),  # fmt: skip
    "unknown pruner setting": (
        ["+search.pruner.n_startup_trails=3"],
        r"search.pruner.n_startup_trails is not a search.pruner setting; known: interval_steps, "
        r"n_min_trials, n_startup_trials, n_warmup_steps; did you mean "
        r"search.pruner.n_startup_trials\?",
    ),
    "bad pruner value": (
        ["search.pruner.n_startup_trials=-1"],
        r"search.pruner \(MedianPruner\) cannot be built: ValueError: Number of startup trials "
        r"cannot be negative",
    ),
    "bad sampler value": (
        ["search.sampler.seed=x"],
        r"search.sampler \(TPESampler\) cannot be built: TypeError: ",
    ),
    "study name as a relative path": (
        ["search.study_name=../../x"],
        r"search.study_name='../../x' is not a plain name: it names the study's MLflow artifact "
        r"directory, so it may hold only ASCII letters, digits, '.', '_' and '-' \(first a "
        r"letter or digit, 128 at most\); e.g. search.study_name=x$",
    ),
    "study name with accents": (
        ["search.study_name='étude'"],
        r"search.study_name='étude' is not a plain name: .*; e.g. search.study_name=etude$",
    ),
    "study name as an absolute path": (
        ["search.study_name=/tmp/abs"],
        r"search.study_name='/tmp/abs' is not a plain name: .*; e.g. search.study_name=tmp-abs$",
    ),
    "unknown search key added with +": (
        ["+search.memory_budgt=1KiB"],
        r"search.memory_budgt is not a search setting; known: accumulation, .*memory_budget.*; "
        r"did you mean search.memory_budget\?",
    ),
    "unknown recommend key": (
        ["+search.recommend.tolerence=0.02"],
        r"search.recommend.tolerence is not a search.recommend setting; known: metric, prefer, "
        r"tolerance; did you mean search.recommend.tolerance\?",
    ),
    "unknown mlflow key": (
        ["+mlflow.tracking_url=sqlite:///x.db"],
        r"mlflow.tracking_url is not an mlflow setting; known: artifact_root, outage_wait_s, "
        r"system_metrics, system_metrics_interval_s, tracking_uri; did you mean "
        r"mlflow.tracking_uri\?",
    ),
    "unknown loader key": (
        ["+loader.num_worker=2"],
        r"loader.num_worker is not a loader setting; known: .*; did you mean loader.num_workers\?",
    ),
    "unknown optimizer setting": (
        ["+optimizer.moment=0.5"],
        r"optimizer.moment is not a setting of torch.optim.SGD; known: .*momentum.*; did you "
        r"mean optimizer.momentum\?",
    ),
    "optimizer value the builder refuses": (
        ["optimizer.momentum=-1"],
        r"optimizer \(torch.optim.SGD\) cannot be built: Invalid momentum value: -1",
    ),
    "unknown scheduler setting": (
        ["+scheduler.warmup_steps=3"],
        r"scheduler.warmup_steps is not a setting of batchfit.train.lr.warmup_cosine; known: "
        r"optimizer, total_steps, warmup_fraction",
    ),
    "unknown task setting": (
        ["+task.label_smoothin=0.1"],
        r"task.label_smoothin is not a setting of batchfit.train.tasks.Classification; known: "
        r".*; did you mean task.label_smoothing\?",
    ),
    "tracking URI of no MLflow store": (
        ["mlflow.tracking_uri=foo://x"],
        r"mlflow.tracking_uri='foo://x': MLflow has no tracking store for foo://; it takes "
        r"sqlite, postgresql, mysql, mssql, http, https, file, databricks.*; e.g. "
        r"mlflow.tracking_uri=sqlite:///mlruns/mlflow.db \(a local file\) or "
        r"mlflow.tracking_uri=http://HOST:5000 \(a tracking server\)$",
    ),
    "a searched combination that cannot train": (
        [
            "trainer.devices=2",
            "+search.params={trainer.strategy:'choice(ddp,fsdp)',trainer.precision:'choice(fp32,fp16)'}",
        ],
        r"with trainer.strategy=fsdp, trainer.precision=fp16 from search.params: "
        r"trainer.precision=fp16 with trainer.strategy=fsdp needs a sharded gradient scaler",
    ),
    "an objective twice": (
        ["search.objectives=[val/acc,val/acc]"],
        r"search.objectives lists val/acc more than once; each objective is one column of the "
        r"Pareto front: search.objectives=\[val/acc\]",
    ),
    "absurd budget": (
        ["search.memory_budget=1e30"],
        r"search.memory_budget=1e\+30 \(\d+\.\d PiB\) is more than the \d+\.\d [GT]iB that "
        r"(cpu|cuda) has; give at most the device's memory, e.g. search.memory_budget=90%",
    ),
    "budget above the device": (  # no machine that runs these tests has 4 TiB
        ["search.memory_budget=4TiB"],
        r"search.memory_budget='4TiB' \(4.0 TiB\) is more than the \d+\.\d [GT]iB that "
        r"(cpu|cuda) has",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_message(hydra_conf, stores, case: str) -> None:
    overrides, message = CASES[case]
    with pytest.raises(ConfigError, match=message):
        _prepare(hydra_conf, [*stores["overrides"], *overrides])


def test_a_fixed_key_is_checked_with_the_searched_ones(hydra_conf, stores) -> None:
    """trainer.devices=2 fixed needs a data-parallel strategy, which the space searches:
    every trial has one, so the study starts (it was refused: the command line alone has
    trainer.strategy=none); a space that offers none with it is refused, naming the value."""
    space = "+search.params={trainer.strategy:'choice(ddp,fsdp)'}"
    driver = _prepare(hydra_conf, [*stores["overrides"], "trainer.devices=2", space])
    assert driver.checked.spec.trainer.strategy == "ddp"  # the first trial's plan
    assert driver.checked.spec.trainer.devices == 2
    with pytest.raises(ConfigError, match=r"value none is invalid: trainer.devices=2 needs"):
        _prepare(
            hydra_conf,
            [*stores["overrides"], "trainer.devices=2",
             "+search.params={trainer.strategy:'choice(none,ddp)'}", "search.study_name=v2"],
        )  # fmt: skip


# A user's merge into the default space (++), the command: batch size and lr are
# searched beside the strategy, and were blamed for the fixed trainer.devices=2.
MERGED = (
    "++search.params={trainer.strategy:'choice(ddp,fsdp)',trainer.batch_size:'choice(16,32)',"
    "optimizer.lr:'tag(log, interval(0.01, 0.3))'}"
)


def test_a_fixed_device_count_with_a_searched_strategy_merged_into_the_space(
    hydra_conf, stores
) -> None:
    driver = _prepare(hydra_conf, [*stores["overrides"], "trainer.devices=2", MERGED])
    assert driver.checked.spec.trainer.strategy == "ddp"
    assert set(driver.checked.space.distributions) >= {
        "trainer.strategy", "trainer.batch_size", "optimizer.lr"
    }  # fmt: skip


def test_a_fixed_keys_own_problem_is_said_once_under_its_name(hydra_conf, stores) -> None:
    """trainer.precision=fp8 given while the space searches the precision: one problem, the
    precision's, never each searched value blamed for it."""
    space = (
        "+search.params={trainer.precision:'choice(fp32,bf16)',"
        "trainer.batch_size:'choice(16,32,64)',optimizer.lr:'interval(0.01,0.2)'}"
    )
    with pytest.raises(ConfigError) as raised:
        _prepare(hydra_conf, [*stores["overrides"], "trainer.precision=fp8", space])
    (problem,) = raised.value.problems
    assert problem.startswith("trainer.precision must be one of fp32, tf32, bf16, fp16, got 'fp8'")
    assert "search.params.trainer.precision searches it, choice(fp32, bf16)" in problem
    # A valid given value is unused, and said: the trials take the searched ones.
    driver = _prepare(hydra_conf, [*stores["overrides"], "trainer.precision=bf16", space])
    assert any(
        n.startswith("trainer.precision=bf16 is not used: search.params.trainer.precision")
        for n in driver.checked.notes
    )
    # A fixed key's problem no searched value causes is said once, as it is.
    with pytest.raises(ConfigError) as raised:
        _prepare(hydra_conf, [*stores["overrides"], "trainer.accum_steps=0", space])
    problems = raised.value.problems
    assert problems[0] == (
        "trainer.accum_steps must be an integer >= 1, got 0; override with trainer.accum_steps=1"
    )
    assert not [p for p in problems if p.startswith("search.params")], problems


def test_a_searched_value_the_model_cannot_take_is_refused_with_the_models_line(
    hydra_conf, stores
) -> None:
    """data.seq_len=4096 on a model of 2048 positions: refused before any trial, the value
    named, and the model's own line (it ran every trial to FAIL)."""
    overrides = [
        *stores["overrides"], "+experiment=llm_lora", "data.max_bytes=200000",
        "search.study_name=lm", "++search.params={data.seq_len:'choice(128,4096)'}",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        StudyDriver.prepare(hydra_conf(overrides), overrides, {}, Console(record=True))
    assert raised.value.problems == [
        "search.params.data.seq_len: value 4096 is invalid: model "
        "(batchfit.train.language.hf.causal_lm) cannot be built: data.seq_len=4096 is longer "
        "than the model's max_position_embeddings=2048; lower data.seq_len"
    ]


def test_every_problem_is_reported_at_once(hydra_conf, stores) -> None:
    with pytest.raises(ConfigError) as error:
        _prepare(
            hydra_conf,
            [
                *stores["overrides"],
                "trainer.precision=fp8",
                "search.memory_budget='8GB?'",
                "+search.params={optimizer.lr:'interval(0.5,0.1)'}",
            ],
        )
    text = str(error.value)
    assert "trainer.precision" in text and "search.memory_budget" in text
    assert "search.params.optimizer.lr" in text
    assert len(error.value.problems) == 3


@pytest.mark.study
def test_bad_input_loses_nothing_already_recorded(hydra_conf, stores) -> None:
    _prepare(hydra_conf, [*stores["overrides"], "search.n_trials=1"]).run()
    db = Path(stores["optuna"].removeprefix("sqlite:///"))
    before = db.read_bytes()
    with pytest.raises(ConfigError):
        _prepare(hydra_conf, [*stores["overrides"], "search.n_trials=3", "trainer.batch_size=0"])
    assert db.read_bytes() == before
    study = optuna.load_study(study_name="v", storage=stores["optuna"])
    # The trial it trained, and nothing waiting: a study of n_trials enqueues at most
    # n_trials of the fit report's first trials.
    # (complete, or pruned as diverged where its one epoch left it at chance level)
    assert [t.state.name for t in study.trials] in (["COMPLETE"], ["PRUNED"])
    assert all(t.user_attrs.get(Attr.REASON) in (None, "diverged") for t in study.trials)


def _run_search(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    return subprocess.run(
        [sys.executable, "-m", "search", *args, f"search.storage=sqlite:///{tmp_path}/o.db"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_cli_reports_problems_without_traceback(tmp_path: Path) -> None:
    done = _run_search([*FAST, "trainer.precision=fp8", "search.memory_budget=8GB?"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Configuration error" in done.stderr
    assert "trainer.precision must be one of" in done.stderr
    assert "'8GB?' is not a memory size" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.slow
def test_cli_unknown_group_option_names_the_group_and_its_options(tmp_path: Path) -> None:
    """Hydra's "Could not find 'model/resnet999'" and its search path, exit status 1, were
    printed as they came: batchfit's configuration error names the override instead."""
    done = _run_search(["model=resnet999"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "model=resnet999: the model group has no option 'resnet999'" in done.stderr
    assert "did you mean resnet50? (model=resnet50)" in done.stderr
    done = _run_search(["+experiment=nope"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert "+experiment=nope: the experiment group has no option 'nope'" in done.stderr
    assert "Config search path" not in done.stderr


SECRET = "S3cretPW"
PG = f"search.storage=postgresql://u:{SECRET}@127.0.0.1:1/db"  # nothing listens on port 1
HTTP = f"mlflow.tracking_uri=http://u:{SECRET}@127.0.0.1:1"
BAD_PRUNER = "search.pruner._target_=optuna.pruners.NoSuchPruner"


@pytest.mark.slow
@pytest.mark.parametrize(
    "secret_in", [HTTP, PG, f"search.storage='postgresql://u@127.0.0.1:1/db?password={SECRET}'"]
)
def test_cli_mistyped_pruner_is_named_and_no_password_is_printed(
    tmp_path: Path, secret_in: str
) -> None:
    """The pruner used to be built after the checks: its error escaped to Hydra, which printed
    `Error executing job with overrides: [...]`, the passwords in them."""
    done = run_module("search", [*FAST, BAD_PRUNER, secret_in], tmp_path, returncode=2)
    output = done.stdout + done.stderr
    assert SECRET not in output
    assert "search.pruner._target_='optuna.pruners.NoSuchPruner' cannot be imported" in output
    assert "Error executing job" not in output and "Traceback" not in output
    saved = [p for p in (tmp_path / "mlruns" / "hydra").rglob("*.yaml")]
    assert saved and not [p for p in saved if SECRET in p.read_text()]


@pytest.mark.slow
def test_cli_unexpected_error_while_preparing_is_redacted(tmp_path: Path) -> None:
    """Any other error before the first trial (here a user's model builder that raises): a
    redacted traceback and one line saying the study did not start, never Hydra's report."""
    (tmp_path / "boom.py").write_text(
        "def build(**kwargs):\n    raise RuntimeError('the model cannot be built')\n"
    )
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "boom.yaml").write_text("_target_: boom.build\n")
    args = [f"hydra.searchpath=[file://{tmp_path}/conf]", "model=boom", "data=digits", PG, HTTP]
    done = run_module("search", args, tmp_path, returncode=1)
    output = done.stdout + done.stderr
    assert SECRET not in output and "Error executing job" not in output
    assert "RuntimeError: the model cannot be built" in done.stderr
    assert "The study did not start: InstantiationException while preparing it" in done.stderr


def test_energy_figures_need_a_counter_and_its_absence_is_said_once(
    hydra_conf, stores, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No counter readable (an empty powercap tree): a study asked to optimise or prefer an
    energy figure is refused before trial 0, naming each key; one that is not says so once.
    With a readable RAPL zone, the same study starts and says nothing of energy."""
    monkeypatch.setenv("BATCHFIT_POWERCAP", str(tmp_path / "empty"))
    asked = ["search.objectives=[val/acc,energy/joules_per_sample]",
             "search.recommend.prefer=device/utilization"]  # fmt: skip
    with pytest.raises(ConfigError) as error:
        _prepare(hydra_conf, [*stores["overrides"], *asked])
    assert error.value.problems == [
        "search.objectives=energy/joules_per_sample: not measured here: no RAPL or NVML "
        "counter readable, so no trial would report energy/joules_per_sample; choose another "
        "metric, or run where NVML (an NVIDIA GPU, the energy extra) or RAPL "
        "(/sys/class/powercap readable) counts energy",
        "search.recommend.prefer=device/utilization: not measured here: no RAPL or NVML "
        "counter readable, so no trial would report device/utilization; choose another "
        "metric, or run where NVML (an NVIDIA GPU, the energy extra) or RAPL "
        "(/sys/class/powercap readable) counts energy",
    ]
    driver = _prepare(hydra_conf, [*stores["overrides"], "search.study_name=e1"])
    said = driver.console.export_text()
    assert said.count("energy: not measured here: no RAPL or NVML counter readable") == 1
    zone = tmp_path / "tree" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text("0\n")
    (zone / "max_energy_range_uj").write_text("1000000\n")
    monkeypatch.setenv("BATCHFIT_POWERCAP", str(tmp_path / "tree"))
    driver = _prepare(hydra_conf, [*stores["overrides"], *asked, "search.study_name=e2"])
    assert driver.checked.settings.objectives == ("val/acc", "energy/joules_per_sample")
    assert "not measured" not in driver.console.export_text()
