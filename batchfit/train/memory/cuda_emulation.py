"""Run a training step on CPU (fake) tensors so that it allocates what it would on a CUDA GPU.

The predictor (train/memory/predict.py) runs a step on FakeTensors under a tensor tracker. Fake CUDA
tensors cannot run backward without a GPU (the autograd engine asks the CUDA driver for a
device), so the step runs on fake CPU tensors, and `CudaEmulation` changes the two things
where CPU and CUDA allocate differently:

- Autocast's cast policy. CPU autocast casts other ops than CUDA autocast (CUDA runs softmax,
  layer_norm, sum, exp, ... in fp32 and casts addmv, einsum, mv, ... down; CPU does neither).
  While the emulation is active, `torch.autocast("cpu", dtype)` applies CUDA's policy
  (`CUDA_AUTOCAST_POLICY`: the ops the installed torch has AutocastCUDA kernels for, each
  with its policy from PyTorch's AT_FORALL_* lists of aten/src/ATen/autocast_mode.h):
  Python kernels at the AutocastCPU dispatch key cast exactly as CUDA's C++ kernels do and
  redispatch below autocast; ops that only CPU autocasts fall through. The weight-cast cache
  is CUDA's: an fp32 leaf requiring grad is cast once per autocast region and the cast lives
  until the outermost `torch.autocast` exits. tests/train/test_cuda_emulation.py checks the
  table against the installed binary's AutocastCUDA kernels and the output dtypes against
  real CUDA autocast on fake CUDA tensors.
- The attention kernel. `scaled_dot_product_attention` on CPU runs a CPU kernel; under the
  emulation it picks a backend by CUDA's rules for the emulated compute capability and the
  installed torch's release (cuDNN, flash, memory-efficient or math; aten/src/ATen/native/
  transformers/cuda/sdp_utils.cpp; `SdpaRules`) and calls that CUDA op, whose meta kernel
  runs on fake CPU tensors: its outputs and what its autograd node saves (flash's fp32
  logsumexp (B, H, L), philox state) are CUDA's, forward and backward.

The attention rules and kernels are train/memory/sdpa.py's. cuDNN convolutions' workspaces are
train/memory/cudnn.py's (the predictor runs each convolution with its workspace); cuBLAS's are
train/memory/reserve.py's. Not emulated: cuDNN RNNs (`_cudnn_rnn`: CPU's LSTM runs other
ops), nested-tensor attention.

Example::

    with FakeTensorMode(), CudaEmulation(capability=(8, 0)):
        model = ...  # built on fake CPU tensors
        with torch.autocast("cpu", dtype=torch.bfloat16):  # CUDA's bf16 autocast
            loss = model(batch).sum()
        loss.backward()

Real CPU training after the context is unaffected: the kernels are deregistered on exit.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from batchfit.train.memory.sdpa import (
    SDPA_RULES,
    SdpaParams,
    SdpaRules,
    run_sdp_backend,
    select_sdp_backend,
)

aten = torch.ops.aten

LOWER = "lower_precision_fp"  # cast floating inputs to the autocast dtype
FP32 = "fp32"  # cast floating inputs to float32
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # set the op's dtype argument to float32 if unset
FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatch to the overload taking a dtype
PROMOTE = "promote"  # run in the widest floating dtype among the inputs
BANNED = "banned"  # raises under CUDA autocast

_LOWER_OPS = """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm
mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
cudnn_convolution_transpose"""
_FP32_OPS = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm
group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
_upsample_bicubic2d_aa linalg_matrix_sqrth"""
_FP32_SET_OPT_DTYPE_OPS = """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum
linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"""
_PROMOTE_OPS = (
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
)
# Registered by torch 2.11 and 2.12 only (autocast_mode.h's Dimname overloads, dropped later).
_FP32_SET_OPT_DTYPE_DIMNAME_OPS = """prod.dim_Dimname softmax.Dimname log_softmax.Dimname
cumprod.dimname cumsum.dimname sum.dim_DimnameList"""

# CUDA autocast's policy for every op that some supported torch (2.11 to 2.15) autocasts on
# CUDA, from each release's aten/src/ATen/autocast_mode.h and autocast_mode.cpp. Which ops a
# torch autocasts differs between releases: rms_norm from 2.12 on, linalg_matrix_sqrth (an op
# new in 2.14) from 2.14, the Dimname overloads until 2.12.
KNOWN_AUTOCAST_POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER_OPS.split(), LOWER),
    **dict.fromkeys(_FP32_OPS.split(), FP32),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE_OPS.split(), FP32_SET_OPT_DTYPE),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE_DIMNAME_OPS.split(), FP32_SET_OPT_DTYPE),
    "norm.Scalar": FP32_APPEND_DTYPE,
    "norm.ScalarOpt_dim": FP32_APPEND_DTYPE,
    "norm.names_ScalarOpt_dim": FP32_APPEND_DTYPE,
    **dict.fromkeys(_PROMOTE_OPS.split(), PROMOTE),
    "binary_cross_entropy": BANNED,
}


def op_exists(name: str) -> bool:
    """Whether this torch has the aten op overload `name` ('softmax.int', 'mm')."""
    packet, _, overload = name.partition(".")
    return hasattr(aten, packet) and (overload or "default") in getattr(aten, packet).overloads()


def autocast_kernels(dispatch_key: str) -> set[str]:
    """Names ('softmax.int') of the aten ops with a kernel at `dispatch_key` in this torch."""
    found = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
            qualified, dispatch_key
        ):
            found.add(qualified.removeprefix("aten::"))
    return found


def installed_policy(cuda_kernels: set[str]) -> dict[str, str]:
    """The known policies of the ops that have an AutocastCUDA kernel in this torch
    (`cuda_kernels`); every torch build registers them, CPU wheels included. An op this torch
    autocasts without a known policy is left out here and fails the table's test."""
    return {name: policy for name, policy in KNOWN_AUTOCAST_POLICY.items() if name in cuda_kernels}


# CUDA autocast's policy per aten op (overload), as the installed torch registers it.
CUDA_AUTOCAST_POLICY: dict[str, str] = installed_policy(autocast_kernels("AutocastCUDA"))
# Ops with an AutocastCUDA kernel that the emulation leaves alone, and why (where they exist).
NOT_EMULATED: dict[str, str] = {
    name: why
    for name, why in {
        "_cudnn_rnn": "cuDNN's fused RNN; CPU's nn.LSTM/GRU run other ops (mkldnn or composite)",
    }.items()
    if op_exists(name)
}
# fp32_append_dtype: the overload each one redispatches to, with the dtype appended.
_APPEND_DTYPE_TARGET = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}
_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_"
    "logits\nor torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits "
    "are\nsafe to autocast."
)
_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _op(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


class _CastCache:
    """CUDA autocast's weight-cast cache: lower-precision casts of fp32 leaves requiring grad,
    kept (strongly, as C++ keeps them) until the outermost autocast region exits."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cacheable = (
            dtype == torch.get_autocast_dtype("cpu")
            and tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not tensor._is_view()
            and torch.is_autocast_cache_enabled()
            and not torch._C._is_cached_tensor(tensor)
        )
        if not cacheable:
            return tensor.to(dtype)
        hit = self._casts.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        casted = tensor.to(dtype)
        self._casts[id(tensor)] = (weakref.ref(tensor), casted)
        return casted

    def clear(self) -> None:
        self._casts.clear()


def _eligible(value: object) -> bool:
    # CUDA's is_eligible, with CPU in CUDA's place: floating, not double
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.is_floating_point()
        and value.dtype != torch.float64
    )


class _Policy:
    """The Python twin of one of autocast_mode.h's WrapFunction_ policies for one op."""

    def __init__(self, name: str, policy: str, cache: _CastCache) -> None:
        self.op = _op(name)
        self.policy = policy
        self.cache = cache
        arguments = self.op._schema.arguments
        self.names = [argument.name for argument in arguments]
        self.optional = {a.name for a in arguments if isinstance(a.type, torch._C.OptionalType)}
        self.dtype_arg = "dtype"  # the ScalarType? argument of every fp32_set_opt_dtype op
        target = _APPEND_DTYPE_TARGET.get(name)
        self.redispatch = _op(target) if target else self.op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(self.names, args, strict=False)) | kwargs
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return self.redispatch(**self._apply(bound))

    def _apply(self, bound: dict[str, Any]) -> dict[str, Any]:
        lower = torch.get_autocast_dtype("cpu")
        if self.policy == BANNED:
            raise RuntimeError(_BCE_MESSAGE)
        if self.policy == LOWER:
            return self._cast_all(bound, lower)
        if self.policy == FP32:
            return self._cast_all(bound, torch.float32)
        first = bound[self.names[0]]
        if self.policy == FP32_SET_OPT_DTYPE:
            if _eligible(first) and bound.get(self.dtype_arg) is None:
                bound[self.dtype_arg] = torch.float32
            return bound
        if self.policy == FP32_APPEND_DTYPE:
            return bound | {"dtype": torch.float32 if _eligible(first) else first.dtype}
        return self._cast_all(bound, self._promote_type(bound, lower))

    def _promote_type(self, bound: dict[str, Any], lower: torch.dtype) -> torch.dtype:
        # prioritize(): optional tensors take no part, as in the C++ template
        current = lower
        for name, value in bound.items():
            values = value if isinstance(value, list | tuple) else [value]
            for tensor in values if name not in self.optional else ():
                if not _eligible(tensor):
                    continue
                if current == torch.float32 or tensor.dtype == torch.float32:
                    current = torch.float32
                elif not (current == lower and tensor.dtype == lower):
                    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        return current

    def _cast_all(self, bound: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        def cast(value: object) -> object:
            if _eligible(value) and value.dtype != dtype:
                return self.cache.cast(value, dtype)
            if isinstance(value, list | tuple):
                return type(value)(cast(item) for item in value)
            return value

        return {name: cast(value) for name, value in bound.items()}


class CudaEmulation:
    """While active, CPU tensors allocate as CUDA tensors of a GPU of `capability` would:
    CPU autocast applies CUDA's cast policy and cache, and scaled_dot_product_attention runs
    CUDA's attention kernels, chosen by `rules` (SdpaRules; default: the installed torch's).
    See the module docstring for an example."""

    def __init__(
        self, capability: tuple[int, int] = (8, 0), rules: SdpaRules | None = None
    ) -> None:
        self.capability = capability
        self.rules = rules or SDPA_RULES
        self._cache = _CastCache()
        self._library: torch.library.Library | None = None
        self._clear_autocast_cache: Callable[[], None] | None = None

    def __enter__(self) -> CudaEmulation:
        assert self._library is None, "CudaEmulation is not reentrant"
        library = torch.library.Library("aten", "IMPL")
        try:  # half-registered, CUDA's casts would outlive the context: all or nothing
            for name, policy in CUDA_AUTOCAST_POLICY.items():
                library.impl(name, _Policy(name, policy, self._cache), "AutocastCPU")
            for name in _cpu_only_autocast_ops():
                library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            library.impl("scaled_dot_product_attention", self._attention, "AutogradCPU")
            library.impl("dropout", _dropout, "AutogradCPU")
        except BaseException:
            library._destroy()
            raise
        self._library = library
        self._hook_cache_clearing()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.clear_autocast_cache = self._clear_autocast_cache
        self._cache.clear()
        self._library._destroy()
        self._library = None

    def _hook_cache_clearing(self) -> None:
        # torch.autocast.__exit__ calls torch.clear_autocast_cache() when the outermost
        # region ends; CUDA's cache and this one must empty at the same moment.
        original = self._clear_autocast_cache = torch.clear_autocast_cache

        def clear_autocast_cache() -> None:
            original()
            self._cache.clear()

        torch.clear_autocast_cache = clear_autocast_cache

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   *, scale=None, enable_gqa=False):  # fmt: skip  # noqa: ANN001, ANN202
        params = SdpaParams(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        unbatched = self.rules.unbatched_fused and all(t.dim() == 3 for t in (query, key, value))
        if unbatched:  # normalize_unbatched_input(): a batch of one for the fused kernels
            mask = attn_mask
            while mask is not None and mask.dim() < 4:
                mask = mask.unsqueeze(0)
            batched = (t.unsqueeze(0) for t in (query, key, value))
            params = SdpaParams(*batched, mask, dropout_p, is_causal, enable_gqa)
        backend = select_sdp_backend(params, self.capability, self.rules)
        if unbatched and backend == "math":
            params = SdpaParams(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        out = run_sdp_backend(backend, params, scale)
        return out.squeeze(0) if unbatched and backend != "math" else out


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:  # noqa: A002
    """aten::dropout as on CUDA: its fused kernel (native_dropout, whose mask is bool) for
    0 < p < 1 in training, where CPU runs `_dropout`, whose mask has the input's dtype
    (is_fused_kernel_acceptable in ATen's Dropout.cpp: CUDA inputs only)."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    return input if not train or p == 0 else input * 0.0  # p = 1: all dropped, as ATen does


@functools.cache
def _cpu_only_autocast_ops() -> tuple[str, ...]:
    # CPU autocast's own kernels (e.g. conv2d.padding, fft_*, ctc_loss): CUDA has none, so
    # under the emulation they fall through to the op itself. Fixed for a torch binary.
    return tuple(sorted(autocast_kernels("AutocastCPU") - set(CUDA_AUTOCAST_POLICY)))
