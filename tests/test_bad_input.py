"""Bad input on the command line of `python -m search`, `python -m search.fit` and
`python -m train`, as a user types it: one message naming the key and the fix, exit status 2,
no traceback, before anything trains or is recorded."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from batchfit.common.checks import ConfigError
from batchfit.train.language.hf import architecture
from batchfit.train.language.text import text_corpus
from batchfit.train.plan import plan
from batchfit.train.run import check_builds
from tests.sweeps import run_module

FAST = ["model=small_cnn", "model.width=4", "data=digits", "trainer.max_epochs=1"]
ENTRY_POINTS = ["search", "search.fit", "train"]


def refused(module: str, args: list[str], cwd: Path) -> str:
    """The one message of a refused command (rich wraps it at the terminal's width: joined
    here); nothing was trained or recorded."""
    done: subprocess.CompletedProcess = run_module(module, args, cwd, returncode=2)
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "Error executing job" not in output, output
    assert not (cwd / "mlruns" / "mlflow.db").exists()
    return " ".join(done.stderr.split())


# ---- 7. a top-level key added with `+` that nothing reads


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_mistyped_top_level_key_is_refused(tmp_path: Path, module: str) -> None:
    """`+sed=5` (for seed) used to be accepted: the run trained with seed 0 and the rerun
    command carried the typo."""
    message = refused(module, [*FAST, "search.n_trials=1", "+sed=5"], tmp_path)
    assert "sed is not a top-level key of the config" in message
    assert "did you mean seed? (seed=5)" in message


def test_unknown_top_level_key_lists_the_known_ones(tmp_path: Path) -> None:
    message = refused("train", [*FAST, "+bogus_top=1"], tmp_path)
    assert "bogus_top is not a top-level key of the config; known: " in message
    assert "mlflow, model, optimizer" in message and "best, " in message  # train's +best
    assert "remove +bogus_top=1" in message


def test_a_top_level_key_a_value_reads_is_not_refused(tmp_path: Path) -> None:
    """`+base_lr=0.01 optimizer.lr=${base_lr}`: a key of one's own that an interpolation
    reads is Hydra's idiom, not a typo."""
    done = run_module("search.fit", [*FAST, "+base_lr=0.01", "optimizer.lr=${base_lr}"], tmp_path)
    assert "not a top-level key" not in done.stdout + done.stderr
    assert "Fit report for" in done.stdout


# ---- 8. a mistyped key without `+`: Hydra's advice is to append it


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_mistyped_key_without_plus_gets_the_close_match(tmp_path: Path, module: str) -> None:
    """Hydra said "To append to your config use +search.memory_budgt=100MiB", and only the
    second try, with the `+`, got batchfit's suggestion."""
    message = refused(module, [*FAST, "search.memory_budgt=100MiB"], tmp_path)
    assert "search.memory_budgt is not a key of the config" in message
    assert "did you mean search.memory_budget? (search.memory_budget=100MiB)" in message
    assert "To append to your config" not in message


# ---- 9. tracebacks instead of one line

LLM = ["+experiment=llm_lora", "data.max_bytes=20000", "data.seq_len=32", "trainer.device=cpu"]


def test_yaml_error_in_an_architecture_file_names_the_file_and_line(tmp_path: Path) -> None:
    """A model.config YAML that does not parse used to end in 100+ lines of traceback and
    'InstantiationException while preparing it'."""
    architecture = tmp_path / "arch.yaml"
    architecture.write_text("model_type: llama\nhidden_size: [64\nnum_hidden_layers: 2\n")
    message = refused("train", [*LLM, f"model.config={architecture}"], tmp_path)
    assert f"model.config='{architecture}': {architecture}:3:" in message
    assert "is not valid YAML" in message and "fix the file" in message


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        (
            "nul.yaml",
            b"model_type: llama\n\0hidden_size: 64\n",
            r"nul.yaml:2:1 is not valid YAML \(character U\+0000: special characters",
        ),
        (
            "cut.json",
            b'{"model_type": "llama",\n "hidden_size": 6',
            r"cut.json:2:18 is not valid JSON \(Expecting",
        ),
        ("binary.yaml", b"\xff\xfe\x00model", r"binary.yaml is not a text file"),
        ("list.yaml", b"- llama\n", r"list.yaml holds no mapping of settings"),
    ],
)
def test_an_unreadable_architecture_file_is_named_with_its_line(
    tmp_path: Path, name: str, content: bytes, match: str
) -> None:
    """A NUL byte or a truncated JSON used to escape as yaml's ReaderError or a JSON error
    naming no file; each is now a ValueError naming model.config, the file and the line,
    which the pre-study build check reports as a ConfigError (the test above)."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"model.config='{path}': {tmp_path}/{match}"):
        architecture(str(path), vocab_size=256)


def test_yaml_error_in_best_yaml_names_the_file_and_line(tmp_path: Path) -> None:
    best = tmp_path / "best.yaml"
    best.write_text("study: s\ntrial: 1\noverrides: [model=mlp,\n  data=digits\n")
    message = refused("train", [f"+best={best}"], tmp_path)
    assert f"best='{best}': {best}:5:" in message and "is not valid YAML" in message


@pytest.mark.slow
def test_a_grid_too_large_to_enumerate_is_refused_with_its_size(tmp_path: Path) -> None:
    """10^8 points: Optuna's GridSampler listed them all and ran out of memory."""
    space = (
        "+search.params={trainer.batch_size:'range(1,100)',trainer.max_steps:'range(1,100)',"
        "trainer.log_every_steps:'range(1,100)',trainer.warmup_steps:'range(0,99)'}"
    )
    args = [*FAST, "search/sampler=grid", space]
    message = refused("search", args, tmp_path)
    assert "search/sampler=grid: search.params make a grid of 100,000,000 points" in message
    assert "trainer.batch_size 100 x trainer.log_every_steps 100" in message
    assert "search/sampler=tpe" in message


# ---- 10. errors that say where


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        # A raw U+2028 is valid inside a JSON string; str.splitlines() cut the line there,
        # and every line after it was counted one too far.
        (
            ['{"text": "a\u2028b"}', '{"text": "ok"}', '{"text": "cut'],
            r"x.jsonl:3:10 is not valid JSON \(Unterminated string",
        ),
        (['{"text": "ok"}', '["text"]'], r"x.jsonl:2 holds a JSON list, not an object"),
    ],
)
def test_malformed_jsonl_names_the_file_and_its_line(
    tmp_path: Path, lines: list[str], match: str
) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"data.paths: {tmp_path}/{match}"):
        text_corpus(str(path), seq_len=4)


def test_a_mistyped_lora_target_module_is_refused_naming_the_modules(hydra_conf) -> None:
    """[q_proj, nosuch_proj] used to train with q_proj's adapters alone, silently: peft
    refuses only a list that matches nothing."""
    cfg = hydra_conf([*LLM, "model.lora.target_modules=[q_proj,nosuch_proj]"])
    expected = (
        r"model.lora.target_modules: nosuch_proj is not a module of the model \(did you mean "
        r"o_proj\?\); its modules: down_proj, embed_tokens, gate_proj, input_layernorm, k_proj, "
        r"lm_head, norm, o_proj"
    )
    with pytest.raises(ConfigError, match=expected):
        check_builds(cfg, plan(cfg, None))


def test_lora_targets_match_any_module_and_the_bundled_list_is_not_checked() -> None:
    """GPT-2's attention is transformers' Conv1D, which peft adapts: its names are modules.
    The bundled default list names Llama's layers: a model with only some of them (or
    none: peft says so) is not refused for the others; a list the user wrote is."""
    import yaml
    from transformers import AutoModelForCausalLM, GPT2Config

    from batchfit.common.overrides import CONF
    from batchfit.train.language.hf import DEFAULT_TARGETS, _check_targets

    bundled = yaml.safe_load((CONF / "model" / "hf_causal_lm.yaml").read_text())
    assert bundled["lora"]["target_modules"] == DEFAULT_TARGETS
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2))
    _check_targets(gpt2, ["c_attn", "c_proj"])
    _check_targets(gpt2, DEFAULT_TARGETS)
    with pytest.raises(ValueError, match=r"c_atn is not a module of the model \(did you mean "):
        _check_targets(gpt2, ["c_attn", "c_atn"])


def test_an_unknown_model_type_suggests_the_closest_few(tmp_path: Path) -> None:
    """The list of transformers' ~800 model types, on one line, was the whole help."""
    with pytest.raises(ValueError) as raised:
        architecture({"model_type": "lama", "hidden_size": 64}, vocab_size=256)
    message = str(raised.value)
    assert "model_type 'lama' is not a model type of transformers; did you mean llama" in message
    assert len(message) < 400, message


@pytest.mark.parametrize("users", [None, "0", "1"])
def test_hydra_full_error_is_given_back_as_the_user_had_it(monkeypatch, users) -> None:
    """run_checked sets HYDRA_FULL_ERROR=1 while Hydra composes (its errors then reach
    batchfit's message); the task, or a multirun before it launches any job, finds the
    user's own value again (none, 0, or 1), so that no job or launcher inherits ours."""
    from batchfit.common.overrides import Composed, run_checked

    if users is None:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    else:
        monkeypatch.setenv("HYDRA_FULL_ERROR", users)
    seen = []

    def main() -> None:
        seen.append(os.environ.get("HYDRA_FULL_ERROR"))
        Composed().on_multirun_start(None)  # the sweep's parent, before its jobs
        seen.append(os.environ.get("HYDRA_FULL_ERROR"))

    run_checked(main)
    assert seen == ["1", users]
    assert os.environ.get("HYDRA_FULL_ERROR") == users
    assert "BATCHFIT_HYDRA_FULL_ERROR" not in os.environ


# ---- issue 41, point 10: errors that did not name the key


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_a_mistyped_group_option_is_named_with_the_closest_one(tmp_path: Path, module: str) -> None:
    """`+experiment=resnt` got Hydra's "Could not find 'experiment/resnt'" and its search
    path, with exit status 1."""
    message = refused(module, ["+experiment=resnt"], tmp_path)
    assert message.startswith("Configuration error - +experiment=resnt: the experiment group has")
    assert "did you mean resnet? (+experiment=resnet); its options: gpt, llm_full" in message
    assert "Config search path" not in message


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_an_override_hydra_cannot_read_is_named_with_the_quoting(tmp_path: Path, module: str):
    """A non-ASCII value, unquoted: Hydra's LexerNoViableAltException, exit status 1. Then,
    quoted, the study name's own rule (ASCII only), with a plain name to use."""
    message = refused(module, [*FAST, "search.study_name=étude"], tmp_path)
    assert "search.study_name=étude: Hydra's override grammar cannot read it" in message
    assert "quote the value: search.study_name='étude'" in message
    if module != "train":
        message = refused(module, [*FAST, "search.study_name='étude'"], tmp_path)
        assert "search.study_name='étude' is not a plain name" in message
        assert message.endswith("e.g. search.study_name=etude")


def test_a_missing_image_folder_is_named_by_its_key(hydra_conf, tmp_path: Path) -> None:
    """torchvision's ImageFolder said only "[Errno 2] No such file or directory: '...'"."""
    missing = tmp_path / "pets" / "train"
    cfg = hydra_conf(
        ["model=small_cnn", "data=imagefolder", f"data.train.root={missing}",
         f"data.val.root={tmp_path}"]
    )  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        check_builds(cfg, plan(cfg, None))
    assert raised.value.problems == [
        f"data.train.root={str(missing)!r}: no such file or directory here; give the path of "
        "the data on this machine, e.g. data.train.root=/path/to/it"
    ]


def test_nothing_fitting_a_model_that_cannot_train_batch_1_is_advised_at_its_smallest(
    hydra_conf,
) -> None:
    """ResNet-18 on digits (BatchNorm over its pooled 1x1 map needs 2 samples) under 1 KiB:
    the advice was "No advice: batch 1 cannot be predicted (ValueError: Expected more than
    1 value per channel...)"; it is now given for batch 2, saying why."""
    from batchfit.search.fit.advice import advise

    overrides = ["+experiment=resnet", "data=digits", "search.memory_budget=1KiB"]
    cfg = hydra_conf(overrides)
    advice = advise(cfg, overrides, lambda full: hydra_conf(full))
    assert advice.given.batch_size == 2 and advice.given.peak_bytes is not None
    first = advice.lines("python -m search")[0]
    assert first.startswith("What would fit batch 2 (accum_steps 1, fp32; batch 1 cannot train:")
    assert "Expected more than 1 value per channel" in first
    assert not [line for line in advice.lines("x") if line.startswith("No advice")]


# ---- a batch the training set cannot fill


def test_a_run_batch_larger_than_the_training_set_is_refused(tmp_path: Path) -> None:
    """It trained one step an epoch of digits' 1,438 samples at a rate scaled for 4,096
    (lr 1.6) and reported val/loss 5197.5, exit 0."""
    message = refused("train", [*FAST, "trainer.batch_size=4096"], tmp_path)
    assert (
        "trainer.batch_size=4096 is larger than the 1438 training samples of data=digits: every "
        "epoch would be one step of 1438 samples, at a learning rate scaled for 4096; use at "
        "most 1438 (e.g. trainer.batch_size=1024)"
    ) in message
    message = refused("train", [*FAST, "trainer.batch_size=512", "trainer.accum_steps=4"], tmp_path)
    assert "trainer.batch_size=512 x trainer.accum_steps=4 = 2048 samples a step is larger" in (
        message
    )


# ---- a project's own _target_ modules, run from another directory


def test_a_best_yaml_of_ones_own_modules_run_elsewhere_names_where_it_ran(tmp_path: Path) -> None:
    """A study of one's own modules wrote best.yaml; `python -m train +best=...` from another
    folder ended in a 94-line traceback (`Error locating target 'myproject...'`)."""
    project = tmp_path / "project"
    (project / "myproject").mkdir(parents=True)
    (project / "myproject" / "__init__.py").write_text("")
    (project / "myproject" / "sets.py").write_text(
        "from batchfit.train.data import digits\n\n\n"
        "def small_digits(val_fraction, seed):\n"
        "    return digits(val_fraction=val_fraction, seed=seed)\n"
    )
    best = project / "best.yaml"
    best.write_text(
        "study: mine\ntrial: 0\noverrides:\n"
        + "".join(f"- {o}\n" for o in [*FAST, "data._target_=myproject.sets.small_digits"])
        + f"working_dir: {project}\n"
    )
    run_module("train", [f"+best={best}"], project)  # trains where the study ran
    (tmp_path / "elsewhere").mkdir()
    message = refused("train", [f"+best={best}"], tmp_path / "elsewhere")
    assert (
        "data._target_=myproject.sets.small_digits: no module named 'myproject' can be imported "
        f"from here ({tmp_path / 'elsewhere'})"
    ) in message
    assert f"the study that wrote it ran in {project}: run there (cd {project} &&" in message
    for module in ("search", "search.fit"):
        message = refused(module, [*FAST, "data._target_=myproject.sets.small_digits"], tmp_path)
        assert "no module named 'myproject' can be imported from here" in message


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"model_type": "llama", "hidden_size": "big"', "is not valid JSON (Expecting ','"),
        ('{"model_type": "llama", "hidden_size": 30}', "The hidden size (30) is not a multiple"),
    ],
)
def test_a_malformed_model_config_is_said_once_under_its_own_key(
    tmp_path: Path, text: str, said: str
) -> None:
    """It was blamed on search.params.data.seq_len and search.params.model.lora.r, twice
    (and a config transformers' validators refuse crashed python -m train)."""
    (tmp_path / "bad_arch.json").write_text(text)
    for module in ("search.fit", "train"):
        done = run_module(
            module, ["+experiment=llm_lora", "model.config=bad_arch.json"], tmp_path, 2
        )
        output = done.stdout + done.stderr
        assert "Traceback" not in output
        problems = [line for line in done.stderr.splitlines() if line.startswith("- ")]
        assert len(problems) == 1, done.stderr
        assert problems[0].startswith(
            "- model (batchfit.train.language.hf.causal_lm) cannot be built: "
            "model.config='bad_arch.json': "
        ), done.stderr
        assert said in problems[0] and problems[0].endswith("; fix the file")


def test_a_mistyped_key_beside_a_value_still_to_give_gets_the_close_match(tmp_path: Path) -> None:
    """`data=imagefolder data.root=DIR` (its keys are data.train.root and data.val.root, both
    ???) ended in a 48-line MissingMandatoryValue traceback while looking for a close key."""
    message = refused("train", ["model=small_cnn", "data=imagefolder", "data.root=/x"], tmp_path)
    assert "data.root is not a key of the config; did you mean data.val.root?" in message
