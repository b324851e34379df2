"""The attention kernel CUDA's scaled_dot_product_attention runs, for a fake CPU step emulated as
CUDA (train/memory/cuda_emulation.py): its backend chosen by CUDA's rules for a compute
capability and the installed torch's release (cuDNN, flash, memory-efficient or math;
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; `SdpaRules` for what changed between
releases), then that CUDA op called, whose meta kernel runs on fake CPU tensors: its outputs
and what its autograd node saves (flash's fp32 logsumexp (B, H, L), philox state) are CUDA's,
forward and backward."""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class SdpaRules:
    """What CUDA's attention backend choice (aten/src/ATen/native/transformers/cuda/
    sdp_utils.cpp, sdp_utils_cpp.h) allows where it changed between the supported torch
    releases, read from the headers each release's wheel ships (sdp_utils_cpp.h, cuda/
    sdp_utils.h) and its meta kernels (torch/_meta_registrations.py); 2.11, 2.12 and 2.13
    agree, 2.14 and 2.15 agree. All three changes came with torch 2.14 (pytorch PR #191085
    for the first two):

    - `efficient_gqa`: the memory-efficient kernel takes grouped-query inputs (enable_gqa,
      key/value heads dividing the query's); before, its backward returns key and value
      gradients with the query's heads, and the choice sends GQA to the math kernel in fp32.
    - `implicit_mqa`: flash, memory-efficient and cuDNN take one key/value head without
      enable_gqa (check_batch_size_and_num_heads_dense's supports_mqa); efficient gets the
      key and value expanded (zero-stride views). Before: the math kernel.
    - `unbatched_fused`: 3-D inputs get a batch of one (normalize_unbatched_input) and may
      run a fused kernel; before, only 4-D inputs did.

    `wheel_cudnn_version`: the cuDNN of the release's CUDA wheels (its nvidia-cudnn-cu13
    requirement), assumed where the local torch has none (a CPU wheel), so that a plan does not
    depend on the planning machine's wheel. Unchanged as far as the public record shows from
    2.11 on: flash and cuDNN take GQA (cuDNN with other key than value heads, PR #150337),
    cuDNN goes first on sm90/sm10x with cuDNN > 9.15 (PR #171627). What cannot be read for a
    release (its sdp_utils.cpp is not shipped) is taken from the nearest older release known
    here, whose rules never pick a kernel that holds less (the math kernel where a fused one
    came later)."""

    efficient_gqa: bool
    implicit_mqa: bool
    unbatched_fused: bool
    wheel_cudnn_version: int


# Per release: whether the 2.14 changes are in, and its CUDA wheels' cuDNN (2.11: 9.19, 2.12:
# 9.20, 2.14: 9.24, 2.15: 9.26; 2.13's CUDA wheel was not read: 2.12's is assumed).
_RELEASES = {(2, 11): (False, 91900), (2, 12): (False, 92000), (2, 14): (True, 92400),
             (2, 15): (True, 92600)}  # fmt: skip


def sdpa_rules(version: str) -> SdpaRules:
    """The rules of torch `version` ('2.11.0+cu130'); a pre-release of X.Y (2.14.0a0) and an
    unknown release take those of the nearest older known release."""
    release = TorchVersion(version)
    known = [key for key in sorted(_RELEASES) if release >= key]
    newer, cudnn = _RELEASES[known[-1] if known else min(_RELEASES)]
    return SdpaRules(newer, newer, newer, cudnn)


SDPA_RULES = sdpa_rules(torch.__version__)


class SdpaParams:
    """The arguments of one scaled_dot_product_attention call that the backend rules read."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):  # noqa: ANN001
        self.query, self.key, self.value = query, key, value
        self.attn_mask, self.dropout_p = attn_mask, dropout_p
        self.is_causal, self.enable_gqa = is_causal, enable_gqa

    @property
    def requires_grad(self) -> bool:
        tensors = (self.query, self.key, self.value)
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _dense_4d(params: SdpaParams) -> bool:
    # check_tensor_shapes, check_nonzero_sequence_lengths_dense and the batch sizes of
    # check_batch_size_and_num_heads_dense (sdp_utils_cpp.h)
    q, k, v = params.query, params.key, params.value
    if not all(t.dim() == 4 for t in (q, k, v)) or not (q.size(0) == k.size(0) == v.size(0)):
        return False
    return min(q.size(2), k.size(2), q.size(3)) > 0


def _heads_ok(params: SdpaParams, gqa: bool, same_kv_heads: bool, mqa: bool) -> bool:
    """check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads,
    supports_mqa> of sdp_utils_cpp.h on the head counts: equal, or grouped (enable_gqa, the
    key's and value's heads dividing the query's), or one key/value head broadcast (MQA)."""
    q_heads, k_heads, v_heads = (t.size(1) for t in (params.query, params.key, params.value))
    if params.enable_gqa and gqa:
        if same_kv_heads and k_heads != v_heads:
            return False
        return all(h > 0 and q_heads % h == 0 for h in (k_heads, v_heads))
    if q_heads == k_heads == v_heads:
        return True
    return mqa and q_heads > 0 and k_heads == v_heads == 1


def _last_dim_contiguous(params: SdpaParams, ignore_singleton: bool) -> bool:
    def ok(tensor: torch.Tensor) -> bool:
        return tensor.stride(-1) == 1 or (ignore_singleton and tensor.size(-1) == 1)

    return all(ok(t) for t in (params.query, params.key, params.value))


def _gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    # minimum_gemm_alignment(): elements per 128-bit load where tensor cores are used
    is_half = dtype in (torch.float16, torch.bfloat16)
    tensor_cores = capability[0] >= 8 or (capability[0] >= 7 and is_half)
    alignment = 4 if capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if is_half else 32)) if tensor_cores else alignment


def can_use_flash(
    params: SdpaParams, capability: tuple[int, int], rules: SdpaRules = SDPA_RULES
) -> bool:
    """can_use_flash_attention() of sdp_utils.cpp for a GPU of `capability`."""
    q, k, v = params.query, params.key, params.value
    head_dim = q.size(-1)
    if not torch.backends.cuda.flash_sdp_enabled() or not _dense_4d(params):
        return False
    if not _heads_ok(params, gqa=True, same_kv_heads=True, mqa=rules.implicit_mqa):
        return False
    if params.attn_mask is not None or not (head_dim == k.size(-1) == v.size(-1) <= 256):
        return False
    if not (8, 0) <= capability <= (12, 1) or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    # flash's backward fails on sm86-89 and sm120-121 for some head dims
    small_smem = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    supported_head_dim = head_dim <= 192 or (params.dropout_p == 0 and head_dim > 224)
    if small_smem and params.requires_grad and not supported_head_dim:
        return False
    if params.is_causal and q.size(-2) != k.size(-2):
        return False
    return _last_dim_contiguous(params, ignore_singleton=True)


def can_use_efficient(
    params: SdpaParams, capability: tuple[int, int], rules: SdpaRules = SDPA_RULES
) -> bool:
    """can_use_mem_efficient_attention() of sdp_utils.cpp for a GPU of `capability`."""
    q, k, v = params.query, params.key, params.value
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or not _dense_4d(params):
        return False
    if not _heads_ok(params, rules.efficient_gqa, same_kv_heads=True, mqa=rules.implicit_mqa):
        return False
    if not (5, 0) <= capability <= (12, 1):
        return False
    alignment = _gemm_alignment(q.dtype, capability)
    if q.size(-1) != k.size(-1) or q.size(-1) % alignment or v.size(-1) % alignment:
        return False
    if capability[0] >= 8 and any(t.storage_offset() % alignment for t in (q, k, v)):
        return False  # storage_offset * element_size must be a multiple of the alignment bytes
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability[0] >= 8 else ())
    return q.dtype in dtypes and _last_dim_contiguous(params, ignore_singleton=False)


def can_use_cudnn(
    params: SdpaParams, capability: tuple[int, int], rules: SdpaRules = SDPA_RULES
) -> bool:
    """can_use_cudnn_attention() of sdp_utils.cpp for a GPU of `capability` and this torch's
    cuDNN (assuming a cuDNN frontend that supports head dim 256 where cuDNN does)."""
    q, k, v = params.query, params.key, params.value
    if not torch.backends.cuda.cudnn_sdp_enabled() or not _dense_4d(params):
        return False
    if not _heads_ok(params, gqa=True, same_kv_heads=False, mqa=rules.implicit_mqa):
        return False
    if (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not (8, 0) <= capability <= (12, 1):
        return False
    if params.dropout_p * 16 != math.floor(params.dropout_p * 16):
        return False
    if max(q.size(0), q.size(1)) > 65535 or k.size(2) == 1:
        return False
    if params.dropout_p != 0 and q.size(2) == 1:
        return False
    d_qk, d_v = q.size(3), v.size(3)
    sm90_or_sm10x = capability == (9, 0) or capability[0] == 10
    d256 = sm90_or_sm10x and _cudnn_version(rules) > 92200
    if max(d_qk, d_v) > (256 if d256 else 128) or d_qk % 8 or d_v % 8:
        return False
    if (
        d256
        and params.requires_grad
        and not (max(d_qk, d_v) <= 128 or (d_qk, d_v) in ((192, 128), (256, 256)))
    ):
        return False
    return _last_dim_contiguous(params, ignore_singleton=True)


def _cudnn_version(rules: SdpaRules) -> int:
    return torch.backends.cudnn.version() or rules.wheel_cudnn_version


def sdp_priority_order(capability: tuple[int, int], rules: SdpaRules = SDPA_RULES) -> list[str]:
    """Backends in the order CUDA tries them: cuDNN first on sm90/sm10x with cuDNN > 9.15
    (priority_order() in sdp_utils.cpp), unless the user set an order of their own."""
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    order = [names[index] for index in torch._C._get_sdp_priority_order()]
    default = ["flash", "efficient", "math", "cudnn", "overrideable"]
    prefer_cudnn = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") in ("0", "")
    if (
        order == default
        and prefer_cudnn
        and capability[0] in (9, 10)
        and _cudnn_version(rules) > 91500
    ):
        order = ["cudnn", "flash", "efficient", "math", "overrideable"]
    return order


def select_sdp_backend(
    params: SdpaParams, capability: tuple[int, int], rules: SdpaRules = SDPA_RULES
) -> str:
    """The attention backend CUDA's select_sdp_backend() picks: cudnn, flash, efficient, math."""
    checks = {"cudnn": can_use_cudnn, "flash": can_use_flash, "efficient": can_use_efficient}
    for backend in sdp_priority_order(capability, rules):
        if backend in checks and checks[backend](params, capability, rules):
            return backend
        if backend == "math" and torch.backends.cuda.math_sdp_enabled():
            return backend
    raise RuntimeError("No available kernel. Aborting execution.")


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # convert_boolean_attn_mask(): a boolean mask becomes an additive one of the query's dtype
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), float("-inf"), torch.zeros((), dtype=dtype))


def _efficient_mask(mask: torch.Tensor, params: SdpaParams) -> torch.Tensor:
    # preprocess_mask(): the kernel reads the bias in rows padded to 16 elements, then
    # broadcasts it to (B, H, L, S)
    q, k = params.query, params.key
    length = mask.size(-1)
    if length % 16:
        mask = F.pad(mask, (0, 16 - length % 16))[..., :length]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def run_sdp_backend(backend: str, params: SdpaParams, scale: float | None) -> torch.Tensor:
    """Attention's output computed as scaled_dot_product_attention does on CUDA for `backend`
    (attention.cpp), so that the CUDA op's outputs and saved tensors are allocated."""
    q, k, v = params.query, params.key, params.value
    mask = _float_mask(params.attn_mask, q.dtype)
    dropout_p, causal = params.dropout_p, params.is_causal
    if backend == "cudnn":
        outputs = aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, params.requires_grad, dropout_p, causal, False, scale=scale
        )
        return outputs[0]
    if backend == "flash":
        head_dim = q.size(-1)
        scale = 1 / math.sqrt(head_dim) if scale is None else scale  # of the unpadded size
        pad = (0, -head_dim % 8)  # pad_last_dim<8>: the kernel wants a multiple of 8
        padded = [F.pad(t, pad) if pad[1] else t for t in (q, k, v)]
        out = aten._scaled_dot_product_flash_attention(
            *padded, dropout_p, causal, False, scale=scale
        )[0]
        return out[..., :head_dim] if pad[1] else out
    if backend == "efficient":
        mask = None if mask is None else _efficient_mask(mask, params)
        if not params.enable_gqa and k.size(1) != q.size(1):  # implicit MQA (PR #191085):
            # zero-stride views of the query's heads; their gradients are summed to one head
            k, v = (t.expand(t.size(0), q.size(1), *t.shape[2:]) for t in (k, v))
        outputs = aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, params.requires_grad, dropout_p, causal, scale=scale
        )
        return outputs[0]
    outputs = aten._scaled_dot_product_attention_math(
        q, k, v, mask, dropout_p, causal, None, scale=scale, enable_gqa=params.enable_gqa
    )
    return outputs[0]
