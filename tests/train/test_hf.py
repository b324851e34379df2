"""Hugging Face causal LMs (train/language/hf.py), the causal_lm task and the text data:
architectures
against their published sizes, LoRA adapters (gradients under accumulation, frozen weights),
gradient checkpointing, local checkpoints, and the memory prediction against the CPU
measurement, to the byte."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.common.checks import ConfigError
from batchfit.train.build import (
    build_data,
    build_model,
    build_optimizer,
    build_pipeline,
    build_task,
)
from batchfit.train.checkpointing import hugging_face_checkpointed
from batchfit.train.language.hf import architectures, causal_lm
from batchfit.train.language.text import python_stdlib, stdlib_source, text_corpus
from batchfit.train.plan import plan
from batchfit.train.precision import Precision
from batchfit.train.run import check_builds, run
from batchfit.train.step import optimizer_step
from batchfit.train.tasks import CausalLM
from batchfit.train.workload import Workloads

# The published parameter counts (the checkpoints' own model cards and config.json).
PUBLISHED = {
    "llama3_8b": 8_030_261_248,
    "llama3_2_1b": 1_235_814_400,
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "mistral_7b": 7_241_732_096,
    "qwen2_5_7b": 7_615_616_512,
}
TINY = ["llama3_tiny", "llama2_tiny", "mistral_tiny", "qwen2_5_tiny"]
LLM = ["+experiment=llm_lora", "data.max_bytes=20000", "data.seq_len=32", "trainer.device=cpu"]
STEPS = ["trainer.max_steps=3", "trainer.max_epochs=null"]


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def test_the_architectures_are_the_published_ones_and_their_tiny_versions():
    assert set(architectures()) == set(PUBLISHED) | set(TINY)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_an_architecture_composes_and_has_its_published_parameter_count(hydra_conf, name):
    cfg = hydra_conf([*LLM, f"model.config={name}", "model.lora=null"])
    pipeline = build_pipeline(cfg, torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):  # 8B parameters cost nothing
        model = build_model(cfg, pipeline, build_task(cfg), "none")
    assert trainable_parameters(model) == (PUBLISHED[name], PUBLISHED[name])
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False


@pytest.mark.parametrize("name", TINY)
def test_a_tiny_architecture_trains_with_lora(hydra_conf, name):
    cfg = hydra_conf([*LLM, f"model.config={name}"])
    pipeline, task = build_pipeline(cfg, torch.device("cpu")), build_task(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, pipeline, task, "none")
    optimizer = build_optimizer(cfg, model.parameters(), 1e-2)
    batch, precision = pipeline.example(4), Precision("fp32", "cpu")
    scaler = precision.grad_scaler()
    losses = [
        float(optimizer_step(model, optimizer, scaler, precision, [batch], None, None, task))
        for _ in range(4)
    ]
    assert losses[-1] < losses[0] - 0.05, losses  # the adapters learn the batch
    trainable, total = trainable_parameters(model)
    assert 0 < trainable < total / 2  # the base weights are frozen


# ------------------------------------------------------------------ LoRA and accumulation


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of each gradient it steps with."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        self.grads = {id(p): p.grad.clone() for group in self.param_groups for p in group["params"]}
        return super().step(closure)


def _lora_step(hydra_conf, sizes: list[int]) -> tuple[torch.nn.Module, dict, dict]:
    cfg = hydra_conf([*LLM, "model.lora.dropout=0.0"])
    pipeline, task = build_pipeline(cfg, torch.device("cpu")), build_task(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, pipeline, task, "none")
    with torch.no_grad():  # B starts at zero (so A's gradient would be): as after some steps
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    frozen = {name: p.clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizer = _RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = pipeline.example(sum(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    micro = [
        {k: v[s : s + n] for k, v in batch.items()} for s, n in zip(starts, sizes, strict=True)
    ]
    precision = Precision("fp32", "cpu")
    optimizer_step(model, optimizer, precision.grad_scaler(), precision, micro, None, None, task)
    return model, frozen, optimizer.grads


def test_lora_gradients_under_accumulation_equal_one_large_batch(hydra_conf):
    one_model, _, one = _lora_step(hydra_conf, [8])
    # Three micro-batches, the last one short: the loss is summed over target tokens and
    # divided by the step's tokens, so they add up to the large batch's gradient.
    accum_model, frozen, accumulated = _lora_step(hydra_conf, [3, 3, 2])
    names = {id(p): n for n, p in accum_model.named_parameters()}
    adapters = [n for n in names.values() if "lora_" in n]
    assert len(accumulated) == len(adapters) == 2 * 7 * 2  # A and B, 7 modules, 2 layers
    by_name_one = dict(one_model.named_parameters())
    for key, grad in accumulated.items():
        twin = by_name_one[names[key]]
        assert grad.abs().sum() > 0, names[key]
        torch.testing.assert_close(grad, one[id(twin)], rtol=1e-4, atol=1e-6)
    # The frozen base weights got no gradient and did not move.
    for name, param in accum_model.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, name
            assert torch.equal(param, frozen[name]), name


def test_frozen_weights_get_no_optimizer_state(hydra_conf):
    cfg = hydra_conf([*LLM, *STEPS, "trainer.batch_size=2"])
    pipeline, task = build_pipeline(cfg, torch.device("cpu")), build_task(cfg)
    model = build_model(cfg, pipeline, task, "none")
    optimizer = build_optimizer(cfg, model.parameters(), 1e-3)  # AdamW
    precision = Precision("fp32", "cpu")
    optimizer_step(
        model,
        optimizer,
        precision.grad_scaler(),
        precision,
        [pipeline.example(2)],
        None,
        None,
        task,
    )
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == trainable
    assert {id(p) for p in optimizer.state} == trainable
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


# ------------------------------------------------------------- prediction against a real run


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.batch_size=4"],  # LoRA
        ["trainer.batch_size=2", "trainer.accum_steps=3"],
        ["trainer.batch_size=3", "trainer.activation_checkpointing=blocks"],
        ["trainer.batch_size=2", "trainer.accum_steps=2", "model.lora=null"],  # full
        ["trainer.batch_size=2", "model.config=mistral_tiny", "data.seq_len=96"],  # the window
        ["trainer.batch_size=2", "model.config=qwen2_5_tiny", "model.lora.r=4"],
        ["trainer.batch_size=2", "trainer.precision=bf16", "model.lora.target_modules=[q_proj]"],
        # QLoRA: 4-bit weights, their scales and the dequantized weights of each matmul
        ["trainer.batch_size=2", "trainer.accum_steps=2", "model.quantization=nf4"],
        ["trainer.batch_size=3", "model.quantization=fp4", "model.double_quant=false"],
        [
            "trainer.batch_size=2",
            "model.quantization=nf4",
            "trainer.activation_checkpointing=blocks",
        ],
        ["trainer.batch_size=2", "model.quantization=nf4", "model.compute_dtype=bfloat16"],
    ],
    ids=[
        "lora",
        "accumulated",
        "checkpointed",
        "full",
        "mistral",
        "qwen",
        "bf16",
        "nf4",
        "fp4-single-quant",
        "nf4-checkpointed",
        "nf4-bf16-compute",
    ],  # fmt: skip
)
def test_prediction_equals_the_cpu_measurement_to_the_byte(hydra_conf, overrides):
    cfg = hydra_conf([*LLM, *STEPS, *overrides])
    spec = plan(cfg, None)
    workload = Workloads().of(cfg)
    prediction = workload.predict(spec, cfg.optimizer)
    measured = run(cfg, spec, workload=workload).peak_bytes
    assert measured > 0 and prediction.peak_bytes == measured


def test_checkpointing_checkpoints_every_decoder_layer_and_saves_memory(hydra_conf):
    peaks = {}
    for mode in ("none", "blocks"):
        cfg = hydra_conf(
            [
                *LLM,
                "data.seq_len=256",
                "trainer.batch_size=8",
                f"trainer.activation_checkpointing={mode}",
            ]
        )
        spec = plan(cfg, None)
        workload = Workloads().of(cfg)
        peaks[mode] = workload.predict(spec, cfg.optimizer).peak_bytes
        model = workload.predictor(spec, cfg.optimizer).model
        assert len(hugging_face_checkpointed(model)) == (2 if mode == "blocks" else 0)
    assert peaks["blocks"] < 0.7 * peaks["none"], peaks


# ---------------------------------------------------------------------------- the task


def test_the_causal_lm_loss_is_transformers_own_summed_over_target_tokens(hydra_conf):
    cfg = hydra_conf([*LLM, "model.lora=null"])
    pipeline, task = build_pipeline(cfg, torch.device("cpu")), build_task(cfg)
    assert isinstance(task, CausalLM)
    torch.manual_seed(0)
    model = build_model(cfg, pipeline, task, "none")
    batch = pipeline.example(3)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, 5:9] = -100  # padding, as a collator marks it
    output = task.forward(model, batch)
    # transformers' own: the mean over target tokens, labels shifted inside the model
    theirs = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    units = task.units(batch)
    assert units == 3 * (32 - 1) - 4
    torch.testing.assert_close(task.loss(output, batch) / units, theirs)


# ---------------------------------------------------------------------------- the data


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(tmp_path / "tok")
    return fast, tmp_path / "tok"


def test_jsonl_and_text_files_are_tokenised_and_packed(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) for i in range(40))
    )
    (tmp_path / "b.txt").write_text("return x + 1\n" * 20)
    fast, path = _tokenizer(tmp_path)
    data = text_corpus([str(tmp_path / "*.jsonl"), str(tmp_path / "b.txt")], str(path), seq_len=16)
    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)] + ["return x + 1\n" * 20]
    ids = [
        t
        for d in docs
        for t in fast(d, add_special_tokens=False)["input_ids"] + [fast.eos_token_id]
    ]
    assert data.info["vocab_size"] == len(fast) and data.info["num_tokens"] == len(ids)
    sample = data.train[1]
    assert sample["input_ids"].tolist() == ids[16:32] and sample["labels"] is sample["input_ids"]
    assert (
        len(data.train) + len(data.val)
        == (len(ids) - int(len(ids) * 0.1)) // 16 + int(len(ids) * 0.1) // 16
    )


def test_byte_level_text_is_the_utf8_bytes(tmp_path):
    (tmp_path / "a.txt").write_text("héllo wörld\n" * 30)
    data = text_corpus(str(tmp_path / "a.txt"), seq_len=8, val_fraction=0.25)
    assert data.info["vocab_size"] == 256 and data.info["tokenizer"] == "bytes"
    assert bytes(data.train[0]["input_ids"].tolist()) == "héllo wörld\n".encode()[:8]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: text_corpus(str(p / "none*.txt")), FileNotFoundError, "matches no file"),
        (lambda p: text_corpus(str(p / "x.jsonl"), text_key="body"), ValueError, "data.text_key"),
        (lambda p: text_corpus(str(p / "x.jsonl"), seq_len=4096), ValueError, "data.seq_len"),
        (
            lambda p: text_corpus(str(p / "x.jsonl"), tokenizer=str(p)),
            FileNotFoundError,
            "data.tokenizer",
        ),
    ],
)
def test_bad_data_settings_say_which_key(tmp_path, make, error, match):
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "abc " * 200}) + "\n")
    with pytest.raises(error, match=match):
        make(tmp_path)


def test_a_missing_tokenizer_directory_is_named_not_a_hub_repo_id(tmp_path):
    """Hugging Face says "Repo id must be in the form 'repo_name'..." for a path that does
    not exist: batchfit says which key, that the directory is missing, and the fix."""
    with pytest.raises(FileNotFoundError) as raised:
        text_corpus(None, tokenizer=str(tmp_path / "no" / "tokenizer"))
    message = str(raised.value)
    assert message.startswith("data.tokenizer=") and "no such directory" in message
    assert "Repo id" not in message and "data.tokenizer=null" in message


def test_max_bytes_null_reads_the_whole_corpus():
    """data.max_bytes=null is all of the text (conf/data/text.yaml says so), not a hidden
    cap; a corpus still too short then says so instead of advising a larger cap."""
    whole = len(stdlib_source(None))
    assert whole > 400_000  # the old hidden cap
    assert text_corpus(None, max_bytes=None).info["num_tokens"] == len(
        stdlib_source(None).decode("utf-8", errors="replace").encode("utf-8")
    )
    assert len(python_stdlib(seq_len=128, max_bytes=None).train) == (whole - whole // 10 - 1) // 128
    with pytest.raises(ValueError, match=r"data.max_bytes=null reads all of it") as raised:
        text_corpus(None, max_bytes=None, seq_len=whole)
    assert "raise data.max_bytes" not in str(raised.value)


# ------------------------------------------------------------------ models and their errors


def test_a_local_checkpoint_loads_and_predicts_without_its_weights(hydra_conf, tmp_path):
    cfg = hydra_conf([*LLM, "model.lora=null"])
    pipeline, task = build_pipeline(cfg, torch.device("cpu")), build_task(cfg)
    torch.manual_seed(0)
    saved = build_model(cfg, pipeline, task, "none")
    saved.save_pretrained(tmp_path / "ckpt")
    cfg = hydra_conf(
        [*LLM, *STEPS, f"model.name_or_path={tmp_path / 'ckpt'}", "trainer.batch_size=2"]
    )
    loaded = build_model(cfg, pipeline, task, "none")  # with LoRA adapters on its weights
    base = loaded.get_base_model().state_dict()
    weights = {k.replace("base_layer.", ""): w for k, w in base.items() if "lora_" not in k}
    assert weights.keys() == saved.state_dict().keys()
    assert all(torch.equal(w, weights[k]) for k, w in saved.state_dict().items())
    (tmp_path / "ckpt" / "model.safetensors").unlink()  # the prediction reads the config only
    spec = plan(cfg, None)
    assert Workloads().of(cfg).predict(spec, cfg.optimizer).peak_bytes > 0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model.config=llama9_1t"], r"model.config='llama9_1t' is neither an architecture"),
        (
            ["model.config=llama3_tiny", "data.seq_len=4096", "data.max_bytes=200000"],
            "max_position_embeddings",
        ),
        (["+model.lora.rank=8"], r"model.lora: .*rank"),
        (["model.dtype=float16"], r"model.dtype='float16'"),
        (["model.name_or_path=/nowhere"], "local checkpoints only"),
        (["model.config=null"], "give model.config"),
        (["model.quantization=int3"], r"model.quantization='int3': give one of none, nf4, fp4"),
        (["model.quantization=nf4", "model.lora=null"], r"model.quantization=nf4: 4-bit weights"),
        (["model.quantization=nf4", "model.compute_dtype=fp8"], r"model.compute_dtype='fp8'"),
        (
            ["model.quantization=nf4", "model.skip_modules=[lm_haed]"],
            r"model.skip_modules: lm_haed",
        ),
        (
            ["model.quantization=nf4", "trainer.strategy=fsdp", "trainer.devices=2"],
            "model.quantization=nf4 with trainer.strategy=fsdp",
        ),
    ],
)
def test_bad_model_settings_are_config_errors_naming_the_key(hydra_conf, overrides, match):
    cfg = hydra_conf([*LLM, *overrides])
    with pytest.raises(ConfigError, match=match):  # before any trial: the pre-study check
        check_builds(cfg, plan(cfg, None))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size=300 but the model has vocab_size=256"):
        causal_lm({"model_type": "llama", "vocab_size": 256, "hidden_size": 16,
                   "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32},
                  vocab_size=300)  # fmt: skip


def test_the_data_builds_through_its_config(hydra_conf):
    data = build_data(hydra_conf([*LLM]))
    assert data.info["vocab_size"] == 256 and len(data.train[0]["input_ids"]) == 32
