"""CudaEmulation: a step on fake CPU tensors allocates what it would on CUDA.

The oracles are the installed torch itself: its AutocastCUDA kernels (the table), real CUDA
autocast on fake CUDA tensors (output dtypes; forward works on fake CUDA tensors without a
GPU) and the CUDA attention ops called explicitly on fake tensors (bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.train.config import TrainerConfig
from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.device.gpus import gpu
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.measure.memory import TensorMemoryTracker
from batchfit.train.memory.cuda_emulation import (
    CUDA_AUTOCAST_POLICY,
    KNOWN_AUTOCAST_POLICY,
    NOT_EMULATED,
    CudaEmulation,
    autocast_kernels,
    installed_policy,
    op_exists,
)
from batchfit.train.memory.predict import MemoryPredictor
from batchfit.train.memory.sdpa import SDPA_RULES, SdpaParams, sdpa_rules, select_sdp_backend

aten = torch.ops.aten


def test_the_policy_table_is_the_installed_torchs_autocast_cuda_kernels() -> None:
    # A torch upgrade that adds, drops or renames a CUDA autocast op fails here.
    installed = autocast_kernels("AutocastCUDA")
    assert len(installed) > 100
    assert set(CUDA_AUTOCAST_POLICY) | set(NOT_EMULATED) == installed


@contextmanager
def _cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    # torch.autocast("cuda") refuses without a GPU; these calls are what it does on entry.
    prev_enabled, prev_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", prev_enabled)
        torch.set_autocast_dtype("cuda", prev_dtype)


def _t(device: str, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


# (op name, call): a sample of each policy, and ops that only CPU autocast casts (trace,
# max_pool3d), inputs chosen so that the policy changes the output dtype.
SAMPLES: list[tuple[str, Callable[[str], torch.Tensor]]] = [
    (
        "linear",
        lambda d: F.linear(_t(d, 4, 8, dtype=torch.float32), _t(d, 3, 8, dtype=torch.float32)),
    ),
    ("mv", lambda d: torch.mv(_t(d, 4, 8, dtype=torch.float32), _t(d, 8, dtype=torch.float32))),
    (
        "addmv",
        lambda d: torch.addmv(
            _t(d, 4, dtype=torch.float32),
            _t(d, 4, 8, dtype=torch.float32),
            _t(d, 8, dtype=torch.float32),
        ),
    ),
    (
        "einsum",
        lambda d: torch.einsum(
            "ij,jk->ik", _t(d, 4, 8, dtype=torch.float32), _t(d, 8, 2, dtype=torch.float32)
        ),
    ),
    (
        "conv2d",
        lambda d: F.conv2d(
            _t(d, 1, 2, 5, 5, dtype=torch.float32), _t(d, 3, 2, 3, 3, dtype=torch.float32)
        ),
    ),
    ("exp", lambda d: torch.exp(_t(d, 4))),
    ("layer_norm", lambda d: F.layer_norm(_t(d, 4, 8), (8,))),
    ("rms_norm", lambda d: F.rms_norm(_t(d, 4, 8), (8,))),
    ("mse_loss", lambda d: F.mse_loss(_t(d, 4), _t(d, 4))),
    ("pow", lambda d: torch.pow(_t(d, 4), 2)),
    ("logsumexp", lambda d: torch.logsumexp(_t(d, 4, 8), 1)),
    ("softmax", lambda d: torch.softmax(_t(d, 4, 8), -1)),
    ("log_softmax", lambda d: torch.log_softmax(_t(d, 4, 8), -1)),
    ("sum", lambda d: _t(d, 4, 8).sum()),
    ("cumsum", lambda d: torch.cumsum(_t(d, 4, 8), 1)),
    ("norm", lambda d: torch.norm(_t(d, 4, 8))),
    ("addcmul", lambda d: torch.addcmul(_t(d, 4), _t(d, 4, dtype=torch.float32), _t(d, 4))),
    ("atan2", lambda d: torch.atan2(_t(d, 4), _t(d, 4, dtype=torch.float32))),
    ("dot", lambda d: torch.dot(_t(d, 4), _t(d, 4))),
    ("trace", lambda d: torch.trace(_t(d, 4, 4))),
    ("max_pool3d", lambda d: F.max_pool3d(_t(d, 1, 1, 4, 4, 4), 2)),
]


@pytest.mark.parametrize(("name", "call"), SAMPLES, ids=[name for name, _ in SAMPLES])
def test_output_dtypes_are_real_cuda_autocasts(name: str, call: Callable) -> None:
    with FakeTensorMode():
        with _cuda_autocast(torch.bfloat16):
            expected = call("cuda").dtype
        with CudaEmulation(), torch.autocast("cpu", dtype=torch.bfloat16):
            emulated = call("cpu").dtype
    assert emulated == expected


def test_the_emulation_differs_from_cpu_autocast_and_is_gone_after_exit() -> None:
    with FakeTensorMode():
        x = _t("cpu", 4, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.softmax(x, -1).dtype == torch.bfloat16  # CPU's policy
        with CudaEmulation(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.softmax(x, -1).dtype == torch.float32  # CUDA's
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.softmax(x, -1).dtype == torch.bfloat16


def test_a_weight_cast_is_cached_until_the_autocast_region_exits() -> None:
    # CUDA autocast keeps the bf16 copy of an fp32 leaf weight for the whole region, so it
    # is cast once however often it is used, and freed only when the region ends.
    with FakeTensorMode():
        weight = torch.randn(64, 64, requires_grad=True)  # 16 KiB fp32, 8 KiB in bf16
        x = torch.randn(2, 64)
        with CudaEmulation(), TensorMemoryTracker() as tracker:
            with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
                for _ in range(3):
                    torch.mv(weight, x[0])  # mv: cast by CUDA autocast, not by CPU's
                in_region = tracker.live_bytes
            after_region = tracker.live_bytes
    # the outputs and x[0]'s casts are dropped at once; the cache holds the one bf16 copy
    assert in_region - after_region == 64 * 64 * 2


def _attention_step(mode: str, dtype: torch.dtype, capability=(8, 0)) -> tuple[int, int]:  # noqa: ANN001
    """(bytes live after forward, peak through backward) of one causal attention step."""
    with FakeTensorMode():
        q, k, v = (torch.randn(2, 4, 256, 64, dtype=dtype, requires_grad=True) for _ in range(3))
        with TensorMemoryTracker() as tracker:
            if mode == "emulated":
                with CudaEmulation(capability):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif mode == "flash":
                out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
            elif mode == "efficient":
                out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[
                    0
                ]
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            after_forward = tracker.live_bytes
            out.backward(torch.ones_like(out))
        return after_forward, tracker.peak_bytes


def test_attention_allocates_what_cuda_flash_attention_does() -> None:
    emulated = _attention_step("emulated", torch.bfloat16)
    assert emulated == _attention_step("flash", torch.bfloat16)
    # flash saves its output and an fp32 logsumexp (B, H, L): 2*4*256*4 B beyond the output
    assert emulated[0] == 2 * 4 * 256 * 64 * 2 + 2 * 4 * 256 * 4 + 2 * 8 + 8
    assert emulated != _attention_step("cpu", torch.bfloat16)


def test_fp32_attention_allocates_what_cuda_memory_efficient_attention_does() -> None:
    emulated = _attention_step("emulated", torch.float32)
    assert emulated == _attention_step("efficient", torch.float32)
    assert emulated != _attention_step("cpu", torch.float32)


def _backend(dtype: torch.dtype, capability, head_dim: int = 64, mask: bool = False) -> str:  # noqa: ANN001
    with FakeTensorMode():
        q = torch.randn(2, 4, 128, head_dim, dtype=dtype, requires_grad=True)
        attn_mask = torch.ones(128, 128, dtype=torch.bool) if mask else None
        return select_sdp_backend(SdpaParams(q, q, q, attn_mask, 0.0, False, False), capability)


def test_the_attention_backend_follows_cudas_rules() -> None:
    assert _backend(torch.bfloat16, (8, 0)) == "flash"
    assert _backend(torch.float32, (8, 0)) == "efficient"  # flash needs fp16/bf16
    assert _backend(torch.bfloat16, (8, 0), mask=True) == "efficient"  # flash takes no mask
    assert _backend(torch.bfloat16, (9, 0)) == "cudnn"  # preferred on sm90 (cuDNN > 9.15)
    assert _backend(torch.float16, (7, 5)) == "efficient"  # flash needs sm80
    assert _backend(torch.bfloat16, (7, 0)) == "math"  # no bf16 kernel before sm80
    assert _backend(torch.bfloat16, (8, 6), head_dim=200) == "efficient"  # flash bwd limit
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert _backend(torch.bfloat16, (8, 0)) == "math"


def test_an_fp16_step_with_grad_scaler_runs() -> None:
    with FakeTensorMode():
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        with CudaEmulation(), TensorMemoryTracker():
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, 16))
                assert out.dtype == torch.float32  # layer_norm runs in fp32 on CUDA
                loss = out.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # step() reads found_inf with .item(): no fake value
        assert model[0].weight.grad.dtype == torch.float32


def _live_after_dropout(device: str, emulate: bool) -> int:
    with FakeTensorMode():
        x = torch.empty(1024, 1024, device=device, requires_grad=True)
        emulation = CudaEmulation() if emulate else contextmanager(lambda: iter([None]))()
        with emulation, TensorMemoryTracker() as tracker:
            y = F.dropout(x, 0.1, training=True)
        del y
        return tracker.peak_bytes


def test_dropout_saves_cudas_bool_mask() -> None:
    """aten::dropout runs native_dropout (a bool mask) on CUDA inputs only; on CPU its mask
    has the input's dtype (4 B a value in fp32, not 1)."""
    values = 1024 * 1024
    assert _live_after_dropout("cuda", emulate=False) == values * (4 + 1)  # the reference
    assert _live_after_dropout("cpu", emulate=True) == values * (4 + 1)
    assert _live_after_dropout("cpu", emulate=False) == values * (4 + 4)  # CPU's own kernel


def test_a_failed_registration_leaves_no_kernel_behind(monkeypatch) -> None:  # noqa: ANN001
    """Half-registered, CUDA's casts would apply to real CPU training afterwards."""
    import batchfit.train.memory.cuda_emulation as emulation

    policy = {**emulation.CUDA_AUTOCAST_POLICY, "no_such_op": "fp32"}
    monkeypatch.setattr(emulation, "CUDA_AUTOCAST_POLICY", policy)
    with pytest.raises(Exception, match="no_such_op"):
        CudaEmulation().__enter__()
    with torch.autocast("cpu", torch.bfloat16):  # CPU's own policy: addmv not cast
        out = torch.addmv(torch.zeros(4), torch.ones(4, 4), torch.ones(4))
    assert out.dtype == torch.float32


# ---------------------------------------------------------------- grouped-query attention

HEADS, KV_HEADS, TOKENS, HEAD_DIM = 8, 2, 32, 16


class _GroupedQueryAttention(torch.nn.Module):
    """One attention layer as Llama's (8 query heads sharing 2 key/value heads), then a
    classifier head: input (B, TOKENS * HEAD_DIM) -> logits (B, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(HEAD_DIM, HEADS * HEAD_DIM, bias=False)
        self.kv = torch.nn.Linear(HEAD_DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.view(x.size(0), TOKENS, HEAD_DIM)
        q = self.q(tokens).view(x.size(0), TOKENS, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(tokens).view(x.size(0), TOKENS, 2 * KV_HEADS, HEAD_DIM).transpose(1, 2)\
            .chunk(2, dim=1)  # fmt: skip  # (B, KV_HEADS, TOKENS, HEAD_DIM) each
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(out.transpose(1, 2).reshape(x.size(0), TOKENS, -1).mean(1))


def test_a_grouped_query_attention_model_predicts_for_an_h100_in_fp32() -> None:
    """torch 2.11's memory-efficient kernel has no GQA: the emulation chose it by 2.14's rules
    and its backward returned key gradients with the query's 8 heads ("returned an invalid
    gradient at index 1"). Each torch's own rules pick a kernel its backward can run."""
    h100 = gpu("H100-80GB")
    assert h100.capability == (9, 0)
    target = DeviceSpec("cuda", h100.total_bytes, h100, AllocatorSettings(), local=False)
    example = (torch.zeros(4, TOKENS * HEAD_DIM), torch.zeros(4, dtype=torch.long))
    predictor = MemoryPredictor(
        _GroupedQueryAttention, lambda p: torch.optim.SGD(p, lr=0.1), example, target
    )
    trainer = TrainerConfig(batch_size=4, accum_steps=1, precision="fp32")
    assert predictor.predict(trainer, 64).tensor_bytes > 0


# ---------------------------------------------------------------- torch releases

OLD, NEW = sdpa_rules("2.11.0+cu130"), sdpa_rules("2.14.1")


def test_the_table_names_only_ops_this_torch_has() -> None:
    # torch 2.11 has no linalg_matrix_sqrth: a table naming it failed every CUDA prediction
    assert all(op_exists(name) for name in CUDA_AUTOCAST_POLICY)
    assert op_exists("mm") and op_exists("softmax.int") and op_exists("sum")
    assert not op_exists("no_such_op") and not op_exists("softmax.no_such_overload")


def test_the_policy_is_that_of_the_kernels_a_torch_registers() -> None:
    """2.11 autocasts softmax's Dimname overload and not rms_norm, 2.14 the other way round;
    a kernel without a known policy (here _cudnn_rnn, left alone) is not in the table."""
    as_211 = installed_policy({"mm", "softmax.Dimname", "norm.names_ScalarOpt_dim", "_cudnn_rnn"})
    assert as_211 == {
        "mm": "lower_precision_fp",
        "softmax.Dimname": "fp32_set_opt_dtype",
        "norm.names_ScalarOpt_dim": "fp32_append_dtype",
    }
    assert installed_policy({"mm", "rms_norm"}) == {"mm": "lower_precision_fp", "rms_norm": "fp32"}
    assert set(CUDA_AUTOCAST_POLICY) <= set(KNOWN_AUTOCAST_POLICY)


@pytest.mark.parametrize(
    ("version", "newer", "cudnn"),
    [
        ("2.11.0+cu130", False, 91900),  # the H200 machine's torch; its wheel: cuDNN 9.19
        ("2.12.1", False, 92000),
        ("2.13.0+cpu", False, 92000),  # 2.13's headers: none of the changes; cuDNN: 2.12's
        ("2.14.0a0+git0123abc", False, 92000),  # a pre-release of 2.14 may lack them
        ("2.14.1", True, 92400),
        ("2.15.0", True, 92600),
        ("2.16.0.dev20261201", True, 92600),  # newer than known: 2.15's
    ],
)
def test_the_attention_rules_per_torch_release(version: str, newer: bool, cudnn: int) -> None:
    rules = sdpa_rules(version)
    assert (rules.efficient_gqa, rules.implicit_mqa, rules.unbatched_fused) == (newer,) * 3
    assert rules.wheel_cudnn_version == cudnn


def test_the_installed_torchs_rules_are_its_efficient_kernels() -> None:
    """The rules read from the release's version agree with the installed torch's own
    memory-efficient backward: key gradients with the key's 2 heads where GQA is supported,
    with the query's 4 heads where it is not (2.11 to 2.13)."""
    with FakeTensorMode():
        q, k = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, k, None, True)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            out, q, k, k, None, out, lse, seed, offset, 0.0, [True, True, True, False]
        )
    assert grads[1].size(1) == (2 if SDPA_RULES.efficient_gqa else 4)


def test_the_installed_torchs_rules_are_its_headers() -> None:
    """The installed torch's own sdp_utils_cpp.h (pip wheels ship ATen's headers) has 2.14's
    implicit MQA (supports_mqa) and unbatched inputs exactly where the rules say so."""
    header = Path(torch.__file__).parent / "include/ATen/native/transformers/sdp_utils_cpp.h"
    if not header.exists():
        pytest.skip(f"this torch ships no {header.name}")
    text = header.read_text()
    assert ("supports_mqa" in text) == SDPA_RULES.implicit_mqa
    assert ("normalize_unbatched_input" in text) == SDPA_RULES.unbatched_fused


def _heads_backend(dtype, capability, rules, kv_heads=(2, 2), gqa=True, dims=4) -> str:  # noqa: ANN001
    with FakeTensorMode():
        shape = (2, 8, 64, 16)[4 - dims :]
        q = torch.randn(*shape, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(*shape[:-3], h, *shape[-2:], dtype=dtype) for h in kv_heads)
        return select_sdp_backend(SdpaParams(q, k, v, None, 0.0, True, gqa), capability, rules)


def test_grouped_query_attention_takes_the_kernel_each_release_allows() -> None:
    fp32, bf16 = torch.float32, torch.bfloat16
    # fp32 GQA: memory-efficient from 2.14 on; before, the math kernel (neither flash nor
    # cuDNN takes fp32)
    assert _heads_backend(fp32, (9, 0), OLD) == "math"
    assert _heads_backend(fp32, (9, 0), NEW) == "efficient"
    for rules in (OLD, NEW):  # flash and cuDNN took GQA before 2.11
        assert _heads_backend(bf16, (8, 0), rules) == "flash"
        assert _heads_backend(bf16, (9, 0), rules) == "cudnn"
        # key and value with other head counts (8 query heads, 2 and 4): cuDNN only
        assert _heads_backend(bf16, (9, 0), rules, kv_heads=(2, 4)) == "cudnn"
        assert _heads_backend(bf16, (8, 0), rules, kv_heads=(2, 4)) == "math"
        # without enable_gqa, 2 key/value heads are for no fused kernel
        assert _heads_backend(bf16, (8, 0), rules, gqa=False) == "math"
    # one key/value head without enable_gqa (implicit MQA): fused kernels from 2.14 on
    assert _heads_backend(bf16, (8, 0), OLD, kv_heads=(1, 1), gqa=False) == "math"
    assert _heads_backend(bf16, (8, 0), NEW, kv_heads=(1, 1), gqa=False) == "flash"
    assert _heads_backend(fp32, (8, 0), NEW, kv_heads=(1, 1), gqa=False) == "efficient"


def _gqa_step(rules, oracle: str | None = None) -> tuple[int, int]:  # noqa: ANN001
    """(bytes live after forward, peak through backward) of an fp32 causal GQA attention
    step for an H100 (8 query heads, 2 key/value heads, 64 tokens, head dim 16), emulated
    under `rules` or run as the `oracle` CUDA op explicitly."""
    with FakeTensorMode():
        q = torch.randn(2, 8, 64, 16, requires_grad=True)
        k, v = (torch.randn(2, 2, 64, 16, requires_grad=True) for _ in range(2))
        with TensorMemoryTracker() as tracker:
            if oracle == "math":
                out = aten._scaled_dot_product_attention_math(
                    q, k, v, None, 0.0, True, None, enable_gqa=True
                )[0]
            elif oracle == "efficient":
                out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
                out = out[0]
            else:
                with CudaEmulation((9, 0), rules):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            after_forward = tracker.live_bytes
            out.backward(torch.ones_like(out))
        assert k.grad.shape == k.shape
        return after_forward, tracker.peak_bytes


def test_fp32_grouped_query_attention_allocates_what_its_kernel_does() -> None:
    as_211 = _gqa_step(OLD)
    assert as_211 == _gqa_step(None, oracle="math")
    # the math kernel keeps the (B, 8, 64, 64) fp32 attention weights for backward
    assert as_211[0] >= 2 * 8 * 64 * 64 * 4
    if SDPA_RULES.efficient_gqa:  # this torch's efficient kernel runs GQA: 2.14's choice
        as_214 = _gqa_step(NEW)
        assert as_214 == _gqa_step(None, oracle="efficient")
        # output (B, 8, 64, 16) fp32 and logsumexp (B, 8, 64) fp32, the philox seed and offset
        assert as_214[0] == 2 * 8 * 64 * 16 * 4 + 2 * 8 * 64 * 4 + 2 * 8


def _step_bytes(q, k, v, rules, gqa: bool = False) -> tuple[int, int]:  # noqa: ANN001
    with TensorMemoryTracker() as tracker:
        with CudaEmulation((8, 0), rules):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        after_forward = tracker.live_bytes
        out.backward(torch.ones_like(out))
    assert all(t.grad.shape == t.shape for t in (q, k, v))
    return after_forward, tracker.peak_bytes


@pytest.mark.parametrize("rules", [OLD, SDPA_RULES], ids=["2.11", "installed"])
def test_unbatched_attention_runs_as_a_batch_of_one_where_the_release_allows(rules) -> None:  # noqa: ANN001
    """3-D inputs: a fused kernel with a batch of one from 2.14 on (the same bytes as the 4-D
    inputs), the math kernel before (which keeps the (8, 64, 64) attention weights)."""
    with FakeTensorMode():
        q, k, v = (torch.randn(8, 64, 16, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        three_d = _step_bytes(q, k, v, rules)
        q4, k4, v4 = (torch.randn(1, 8, 64, 16, dtype=torch.bfloat16, requires_grad=True)
                      for _ in "qkv")  # fmt: skip
        four_d = _step_bytes(q4, k4, v4, rules)
    if rules.unbatched_fused:
        assert three_d == four_d
    else:
        assert three_d[0] >= 8 * 64 * 64 * 2 > four_d[0]


@pytest.mark.parametrize("rules", [OLD, SDPA_RULES], ids=["2.11", "installed"])
def test_one_key_value_head_without_enable_gqa_runs_its_kernel(rules) -> None:  # noqa: ANN001
    """Implicit MQA in fp32: the memory-efficient kernel on key and value expanded to the
    query's 8 heads from 2.14 on (their gradients come back with 8 heads, then are summed to
    one), the math kernel before."""
    with FakeTensorMode():
        q = torch.randn(2, 8, 64, 16, requires_grad=True)
        k, v = (torch.randn(2, 1, 64, 16, requires_grad=True) for _ in "kv")
        emulated = _step_bytes(q, k, v, rules)
        for t in (q, k, v):
            t.grad = None
        with TensorMemoryTracker() as tracker:
            expanded = (t.expand(2, 8, 64, 16) for t in (k, v))
            out = aten._scaled_dot_product_efficient_attention(q, *expanded, None, True, 0.0, True)
            out = out[0]  # the logsumexp and philox state live on in autograd's node only
            after_forward = tracker.live_bytes
            out.backward(torch.ones_like(out))
        efficient = after_forward, tracker.peak_bytes
    if rules.implicit_mqa:
        assert emulated == efficient
    else:
        assert emulated[0] >= 2 * 8 * 64 * 64 * 4 > efficient[0]
