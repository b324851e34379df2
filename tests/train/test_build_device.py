"""Models built where they train (train/build.py `build_model(..., device)`): on the device
under PyTorch's default-device context, never on the host first.

A CPU-only machine cannot watch a GPU, so the proof is twofold. Built for the meta device
(storage-less, as a GPU is host-less), the host allocates nothing of the weights: a tracker
of host storages sees only the example batch that the data collates. Built for the CPU, each
weight is allocated once: the host's peak is the weights plus that batch, no second copy. And
on the CPU the weights are the ones the builder alone draws from the same seed."""

from __future__ import annotations

import pytest
import torch

from batchfit.train.build import build_model, build_pipeline, build_task
from batchfit.train.language.hf import causal_lm
from batchfit.train.language.text import GPT
from batchfit.train.measure.memory import TensorMemoryTracker
from batchfit.train.models import mlp, resnet18, small_cnn

CPU, META = torch.device("cpu"), torch.device("meta")
TEXT = ["data.seq_len=32", "data.max_bytes=20000"]
LLAMA = ["+experiment=llm_lora", *TEXT]
CASES = {  # name: (overrides, host bytes of pipeline.example(2), the example batch's own)
    # in-memory data: the example is a slice of the data, no allocation
    "small_cnn": (["model=small_cnn", "data=digits"], 0),
    "mlp": (["model=mlp", "data=digits"], 0),
    "resnet18": (["model=resnet18", "data=synthetic"], 0),
    # ByteChunks: two 33-byte windows as int64 (2 x 264 B), then input_ids and labels
    # stacked to (2, 32) int64 (2 x 512 B)
    "gpt": (["+experiment=gpt", *TEXT], 2 * 264 + 2 * 512),
    # PackedSequences: two 32-token windows as int64 (2 x 256 B), input_ids and labels
    # (the same window) stacked to (2, 32) int64 (2 x 512 B)
    "llama3_tiny": ([*LLAMA, "model.lora=null"], 2 * 256 + 2 * 512),
    "llama3_tiny_lora": (LLAMA, 2 * 256 + 2 * 512),
}


def built(cfg, device: torch.device) -> tuple[torch.nn.Module, int]:
    """(the model built for `device` from seed 0, the peak bytes of host storage meanwhile)."""
    pipeline, task = build_pipeline(cfg, CPU), build_task(cfg)
    torch.manual_seed(0)
    with TensorMemoryTracker(CPU) as host:
        model = build_model(cfg, pipeline, task, "none", device)
    return model, host.peak_bytes


def tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_model_built_for_another_device_allocates_none_of_its_weights_on_the_host(
    hydra_conf, name
):
    overrides, example_bytes = CASES[name]
    model, host_bytes = built(hydra_conf(overrides), META)
    assert {t.device for t in tensors(model)} == {META}
    assert host_bytes == example_bytes  # the batch the data collates, nothing of the model


def test_an_8b_lora_model_built_for_another_device_costs_the_host_nothing(hydra_conf):
    # Llama-3-8B with LoRA on bf16 weights, as a GPU trial builds it: 16 GB of weights,
    # none of them on the host, built in about 2 s here.
    cfg = hydra_conf([*LLAMA, "model.config=llama3_8b", "model.dtype=bfloat16"])
    model, host_bytes = built(cfg, META)
    assert {t.device for t in tensors(model)} == {META}
    assert sum(p.numel() for p in model.parameters()) > 8_030_261_248  # with the adapters
    assert host_bytes == 2 * 256 + 2 * 512  # the example batch alone


def test_a_model_built_for_the_cpu_allocates_each_weight_once(hydra_conf):
    # llama3_tiny in fp32 over byte-level text (vocab 256): embeddings and head 256 x 64
    # each, per layer q and o 64 x 64, k and v 16 x 64 (one key/value head of 16), gate
    # and up 224 x 64, down 64 x 224 and two norms of 64; the final norm; two layers.
    layer = 2 * 64 * 64 + 2 * 16 * 64 + 3 * 224 * 64 + 2 * 64
    weight_bytes = 4 * (2 * 256 * 64 + 2 * layer + 64) + 2 * 4 * 8  # + RoPE's two (8,) fp32
    assert weight_bytes == 558_400
    model, host_bytes = built(hydra_conf([*LLAMA, "model.lora=null"]), CPU)
    assert {t.device for t in tensors(model)} == {CPU}
    assert sum(t.untyped_storage().nbytes() for t in tensors(model)) == weight_bytes
    # the weights once, and the example batch alive beside them: its (2, 32) int64 pair
    assert host_bytes == weight_bytes + 2 * 512


def test_a_tied_head_stays_tied_on_every_device(hydra_conf):
    # Llama 3.2 1B ties its head to its input embedding; so does the GPT
    one_b = hydra_conf([*LLAMA, "model.config=llama3_2_1b"])
    model, _ = built(one_b, META)
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    for device in (META, CPU):
        gpt, _ = built(hydra_conf(CASES["gpt"][0]), device)
        assert gpt.head.weight is gpt.tok.weight and gpt.head.weight.device == device


def test_quantized_weights_are_built_on_the_device(hydra_conf):
    from batchfit.train.language.quantize import quant_state_tensors

    cfg = hydra_conf(["+experiment=llm_qlora", *TEXT, "model.quantization=nf4"])
    model, _ = built(cfg, META)
    packed = [p for p in model.parameters() if p.dtype == torch.uint8]
    assert packed and {t.device for t in tensors(model) + quant_state_tensors(model)} == {META}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_4bit_weights_reach_a_gpu_packed_only(hydra_conf):
    """QLoRA's full-precision weights are made and packed on the host (train/language/hf.py):
    the card never holds them, so its peak while building is what the packed model keeps
    (the packed weights, their scales, the adapters and the rest in 16/32 bits)."""
    cfg = hydra_conf(["+experiment=llm_qlora", *TEXT, "model.quantization=nf4"])
    pipeline, task = build_pipeline(cfg, CPU), build_task(cfg)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg, pipeline, task, "none", torch.device("cuda"))
    kept = torch.cuda.memory_allocated() - before
    packed = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert packed and all(m.weight.is_cuda for m in packed)
    # what the full-precision weights of the packed layers would have held (model.dtype)
    unpacked = (
        sum(m.in_features * m.out_features for m in packed)
        * torch.finfo(getattr(torch, str(cfg.model.dtype))).bits
        // 8
    )
    assert torch.cuda.max_memory_allocated() - before < kept + unpacked // 2


def _direct(name: str) -> torch.nn.Module:
    """The model as its builder alone makes it from seed 0, outside batchfit (lazy layers
    of the MLP materialised on digits' 64 features)."""
    torch.manual_seed(0)
    if name == "small_cnn":
        return small_cnn(num_classes=10, in_channels=1)
    if name == "mlp":
        model = mlp(num_classes=10, in_channels=1)
        model(torch.zeros(2, 1, 8, 8))
        return model
    if name == "resnet18":
        return resnet18(num_classes=10)
    if name == "gpt":
        return GPT(vocab_size=256, block_size=32)
    lora = None if name == "llama3_tiny" else {"r": 8, "alpha": 16, "target_modules": ["q_proj"]}
    return causal_lm("llama3_tiny", lora=lora, vocab_size=256, block_size=32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_same_seed_gives_the_weights_the_builder_draws_on_the_cpu(hydra_conf, name):
    overrides = CASES[name][0]
    if name == "llama3_tiny_lora":
        overrides = [*overrides, "model.lora.target_modules=[q_proj]"]
    model, _ = built(hydra_conf(overrides), CPU)
    expected = _direct(name).state_dict()
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def checkpointed_builder(path: str, num_classes: int) -> torch.nn.Module:
    """A user's builder that reads its weights from a file (torch.load makes them on the
    CPU, whatever the default device) and makes one tensor on the CPU by name."""
    model = torch.nn.Linear(64, num_classes)
    model.load_state_dict(torch.load(path, weights_only=True), assign=True)
    model.register_buffer("scale", torch.ones(1, device="cpu"))
    return model


def test_what_a_builder_puts_on_the_host_is_moved_to_the_device(hydra_conf, tmp_path):
    path = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(64, 10).state_dict(), path)
    target = "tests.train.test_build_device.checkpointed_builder"
    cfg = hydra_conf(["model=mlp", "data=digits", f"model._target_={target}", "~model.hidden",
                      "~model.depth", f"+model.path={path}"])  # fmt: skip
    model, host_bytes = built(cfg, META)
    assert {t.device for t in tensors(model)} == {META}
    # read from the file on the host: weight 10 x 64 and bias 10 in fp32, and the scale
    assert host_bytes == 4 * (10 * 64 + 10) + 4


TIED = {  # llama3_tiny with its head tied to its input embedding (as Llama 3.2 1B's)
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 224,
    "tie_word_embeddings": True, "initializer_range": 0.2,
}  # fmt: skip


def _transformers_own(settings: dict, lora: dict | None) -> torch.nn.Module:
    """The model as transformers and peft build it alone, from seed 0: the weights the
    same seed gave before batchfit built tied heads without their own weight."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from batchfit.train.language.hf import architecture, lora_config

    torch.manual_seed(0)
    arch = architecture(settings)
    arch.use_cache = False
    model = AutoModelForCausalLM.from_config(arch, attn_implementation="sdpa")
    return model if lora is None else get_peft_model(model, lora_config(lora))


def test_a_tied_head_is_never_allocated_and_the_seed_gives_the_same_weights(
    hydra_conf, tmp_path, monkeypatch
):
    import yaml

    from batchfit.train.language.hf import _TiedHead

    # The head's draws go through a scratch of 2**20 elements, more than this head's 16,384:
    # 1,024 here, so that the scratch is not the head's size and the draws run in 16 chunks
    monkeypatch.setattr(_TiedHead, "CHUNK", 1024)
    path = tmp_path / "tied.yaml"
    path.write_text(yaml.safe_dump(TIED))
    # without a head of its own: llama3_tiny's weights (above) less the 256 x 64 head
    layer = 2 * 64 * 64 + 2 * 16 * 64 + 3 * 224 * 64 + 2 * 64
    weight_bytes = 4 * (256 * 64 + 2 * layer + 64) + 2 * 4 * 8
    model, host_bytes = built(hydra_conf([*LLAMA, f"model.config={path}", "model.lora=null"]), CPU)
    assert sum(t.untyped_storage().nbytes() for t in tensors(model)) == weight_bytes
    # the weights, the example batch and the scratch of 1,024 fp32: no head
    assert host_bytes == weight_bytes + 2 * 512 + 1024 * 4
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # with LoRA, drawn after the head: the adapters too are the ones drawn before
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    targets = "model.lora.target_modules=[q_proj,v_proj]"
    model, _ = built(hydra_conf([*LLAMA, f"model.config={path}", targets]), CPU)
    expected = _transformers_own({**TIED, "vocab_size": 256}, lora).state_dict()
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_a_tied_model_whose_head_cannot_be_told_apart_is_built_as_transformers_builds_it():
    # vocabulary 64 = hidden 64: the second 64 x 64 weight made is the first layer's
    # q_proj, not the head; the build sees that it did not end tied and builds again
    settings = {**TIED, "vocab_size": 64}
    torch.manual_seed(0)
    model = causal_lm(settings)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {t.device for t in tensors(model)} == {CPU}
    expected = _transformers_own(settings, None).state_dict()
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key
