"""4-bit base weights (train/language/quantize.py): what the memory tracker counts of them,
byte for byte from the shapes bitsandbytes documents, and the kernel a CUDA card runs.

The to-the-byte agreement of prediction and measurement for QLoRA runs is
tests/train/test_hf.py's; agreement alone cannot show that the dequantized weights or the
scales are counted (both sides would miss them alike), which these tests do."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("bitsandbytes")

from batchfit.train.device.gpus import GPUS, gpu  # noqa: E402
from batchfit.train.language.quantize import (  # noqa: E402
    BLOCKSIZE,
    cuda_card,
    quant_state_tensors,
    quantize,
    unfused_gemm_4bit,
)
from batchfit.train.measure.memory import TensorMemoryTracker  # noqa: E402
from batchfit.train.step import state_tensors  # noqa: E402

OUT, IN = 256, 128  # one layer's weight: 32,768 values, 512 blocks of 64


class _Net(nn.Module):
    """What `quantize` expects of a transformers model: linear layers and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=False)
        self.lm_head = nn.Linear(OUT, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.proj(x))


def _quantized(double_quant: bool) -> nn.Module:
    torch.manual_seed(0)
    return quantize(_Net(), "nf4", double_quant, None)


@pytest.mark.parametrize("double_quant", [True, False])
def test_the_scales_are_state_beside_the_packed_weights(double_quant):
    """Per layer: the packed weight (two values a byte), one absmax per 64 values (fp32, or
    with double quantization uint8 plus an fp32 offset, one fp32 scale per 256 blocks and
    the 256-value fp32 code of the 8-bit map) and the 16-value fp32 code of NF4."""
    model = _quantized(double_quant)
    values = OUT * IN
    blocks = values // BLOCKSIZE
    nested = blocks + 4 + 4 * math.ceil(blocks / 256) + 4 * 256  # uint8, offset, fp32
    scales = nested if double_quant else 4 * blocks
    expected = scales + 4 * 16
    got = sum(t.untyped_storage().nbytes() for t in quant_state_tensors(model))
    assert got == expected
    assert model.proj.weight.untyped_storage().nbytes() == values // 2
    assert type(model.lm_head) is nn.Linear  # the head stays 16/32-bit
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad] or [
        nn.Parameter(torch.zeros(1))])  # fmt: skip
    tracked = {id(t) for t in state_tensors(model, optimizer)}
    assert all(id(t) in tracked for t in quant_state_tensors(model))


def _forward_peak(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    tracker = TensorMemoryTracker()
    with tracker:
        tracker.register([x, *state_tensors(model, torch.optim.SGD([x]))])
        before = tracker.live_bytes
        tracker.peak_bytes = before
        y = model.proj(x)
    return tracker.peak_bytes - before, y.untyped_storage().nbytes()


@pytest.mark.parametrize("double_quant", [True, False])
def test_the_dequantized_weight_of_a_matmul_counts(double_quant):
    """bitsandbytes' gemm_4bit is one op to a dispatch mode; its kernel dequantizes the
    weight (fp32 here: the input's dtype) and, with double quantization, the scales first.
    The tracker counts them: the peak of one forward is the output, the dequantized weight
    and the dequantized scales, not the output alone."""
    model = _quantized(double_quant)
    x = torch.randn(8, IN, requires_grad=True)
    peak, output = _forward_peak(model, x)
    assert output == 8 * OUT * 4
    scales = 4 * (OUT * IN // BLOCKSIZE) if double_quant else 0  # fp32, offset added
    assert peak == output + 4 * OUT * IN + scales


def test_the_matmuls_compute_in_the_autocast_dtype():
    """model.compute_dtype=null: under autocast (trainer.precision=bf16) each 4-bit matmul
    dequantizes to bf16 and computes in it, whatever its input's dtype (peft's fp32
    residual stream); without autocast, in its input's dtype. The output keeps the input's
    dtype, as bitsandbytes returns it."""
    model = _quantized(False)
    x = torch.randn(8, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model.proj(x)
        assert model.proj.compute_dtype == torch.bfloat16 and y.dtype == torch.float32
        half, _ = _forward_peak(model, x)
    full, _ = _forward_peak(model, x)
    assert model.proj.compute_dtype == torch.float32
    # the dequantized weight in 2 bytes instead of 4; the bf16 copy of the input and the
    # bf16 output are smaller than that
    assert full - half > OUT * IN, (full, half)


def test_a_fused_cuda_kernel_has_no_dequantized_weight():
    """On a CUDA card bitsandbytes runs its fused kernel for a few rows (up to 4 always):
    the composition is declined and the op's output alone is allocated; past 1536 rows it
    dequantizes, keeping the dequantized scales until the matmul returns."""
    model = _quantized(True)
    state = model.proj.weight.quant_state
    weight = model.proj.weight.view(-1, 1)
    args = (weight, state.shape, state.state2.absmax, BLOCKSIZE, "nf4")
    kwargs = {
        "absmax_8bit": state.absmax, "absmax_code": state.state2.code,
        "absmax_offset": state.offset,
    }  # fmt: skip
    card = gpu("RTX-4090")
    with FakeTensorMode(allow_non_fake_inputs=True), cuda_card(card.sms, card.capability):
        few = torch.empty(2, IN)
        assert unfused_gemm_4bit(few, *args, **kwargs) is NotImplemented
        many = torch.empty(2048, IN)
        assert unfused_gemm_4bit(many, *args, **kwargs).shape == (2048, OUT)
    x = torch.randn(2048, IN)
    blocks = OUT * IN // BLOCKSIZE
    with cuda_card(card.sms, card.capability):
        peak, output = _forward_peak(model, x)
    assert peak == output + 4 * OUT * IN + 2 * 4 * blocks  # both fp32 scale tensors live
    with cuda_card(card.sms, card.capability):
        peak, output = _forward_peak(model, torch.randn(2, IN))
    assert peak == output


def test_every_card_of_the_table_has_its_sm_count():
    """bitsandbytes' kernel choice reads the card's SM count; a card without one would be
    planned with the dequantizing kernel whatever the shapes."""
    assert all(entry.sms and entry.sms > 0 for entry in GPUS)
    assert gpu("H100-80GB").sms == 132 and gpu("A100-40GB").sms == 108


def test_a_quantized_model_trains_and_its_adapters_learn():
    """Four steps of QLoRA on a fixed batch lower its loss; the 4-bit weights stay as they
    were (frozen), the adapters change."""
    pytest.importorskip("peft")
    from batchfit.train.language.hf import causal_lm

    torch.manual_seed(0)
    model = causal_lm(
        config="llama3_tiny", lora={"r": 8, "alpha": 16}, vocab_size=256, quantization="nf4"
    )
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    assert packed and all(not p.requires_grad for p in model.parameters() if p.dtype == torch.uint8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(0, 256, (2, 32))
    losses = []
    for _ in range(4):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in packed.items())


def test_a_saved_quantized_model_rebuilds_with_its_own_4bit_weights(hydra_conf, tmp_path):
    """`python -m train` saves the model (train/model_file.py); bitsandbytes writes the
    quantization state beside each 4-bit weight and does not read it back: rebuilt from
    its config (other random weights) and loaded, the model computes what the saved one
    did, to the bit."""
    pytest.importorskip("peft")
    from omegaconf import OmegaConf

    from batchfit.train.language.hf import causal_lm
    from batchfit.train.model_file import load, rebuild, to_bytes

    cfg = hydra_conf(["+experiment=llm_qlora"])
    torch.manual_seed(123)  # not the config's seed: rebuild's fresh weights differ
    model = causal_lm(
        config="llama3_tiny", lora=OmegaConf.to_container(cfg.model.lora), vocab_size=256,
        quantization="nf4",
    )  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # adapters that change the output
    path = tmp_path / "model.pt"
    path.write_bytes(to_bytes(model, OmegaConf.to_yaml(cfg), []))
    rebuilt = rebuild(load(path))
    x = torch.randint(0, 256, (2, 16))
    model.eval(), rebuilt.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, rebuilt(input_ids=x).logits)
