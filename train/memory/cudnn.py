"""cuDNN convolutions' workspaces in a predicted CUDA step.

A cuDNN convolution allocates a workspace through the caching allocator for each call, frees
it when the call returns, and nothing else of the call outlives it. The predictor's step on
fake CPU tensors has the convolutions' outputs (their meta kernels) but not these workspaces:
on a real H200 they made small_cnn and resnet18 steps take up to 65% more than predicted.
`conv_composites` runs each convolution as CUDA runs it, workspace included, for the memory
tracker (train/memory/budget.py); `CudnnWorkspaces` says how large each workspace is taken to be.

What PyTorch does (aten/src/ATen/native/Convolution.cpp, cudnn/ConvShared.cpp and
cudnn/Conv_v8.cpp, the cuDNN v8/v9 frontend path every CUDA build takes by default):

- Forward (`_convolution`, ConvBackend::Cudnn): `cudnn_convolution` allocates the output, then
  `raw_cudnn_convolution_forward_out` -> `run_single_conv` -> `run_conv_plan`, which allocates
  `plan.getWorkspaceSize()` bytes with `CUDACachingAllocator::get()->allocate` (a DataPtr,
  freed when `run_conv_plan` returns), executes the plan, and returns; a bias is then added
  in place (no allocation). A transposed convolution (ConvBackend::CudnnTranspose) is the
  same with the backward-data plan.
- Backward (`convolution_backward`, ConvBackend::Cudnn): `cudnn_convolution_backward` makes
  the input-gradient first (`cudnn_convolution_backward_input`: the gradient allocated, then
  `run_conv_plan` with its workspace, freed), then the weight-gradient the same way
  (`cudnn_convolution_backward_weight`); the bias gradient comes last, outside cuDNN
  (`grad_output.sum({0, 2, 3})`), with no workspace.
- Which plan, and so how large its workspace: with `torch.backends.cudnn.benchmark` off
  (PyTorch's default, which batchfit keeps), `run_single_conv` takes the first engine config
  of cuDNN's heuristics (`get_configs_from_heuristics`, after `filterEngineConfigs` drops
  configs that are non-deterministic when asked, down-convert their inputs, or use tensor
  cores in fp32 without TF32), caches the plan per shape, dtype, layout and alignment
  (`_get_benchmark_cache`), and on an out-of-memory error tries the next config. The size
  depends on the card, the cuDNN version and the shapes: cuDNN's heuristics are not
  published and cannot run without the card. cuDNN bounds them with the environment
  variable `CUDNN_CONV_WSCAP_DBG` (MiB per allocation; PyTorch documents it in
  docs/source/cuda_environment_variables.rst beside CUBLAS_WORKSPACE_CONFIG), read by cuDNN
  itself: configs whose workspace passes the cap are not returned.

So batchfit sets the cap (`cudnn_workspace_mib`, conf/config.yaml; the environment's
CUDNN_CONV_WSCAP_DBG wins), and a prediction for a card it does not have counts every
cuDNN call's workspace at the cap: a bound, which the fit report says it is. On the card
itself (a study or a fit report on the GPU) each convolution is run once for real, alone, for
each shape the step has, and its workspace is what the caching allocator measured
(`measure_on_device`): the plan cache makes the training step take the same plan. With
`benchmark` on (not batchfit's), the first call of each shape also allocates the largest
workspace of all configs that fit to time them (`get_plans_from_find`): not modelled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten

MiB = 2**20
WSCAP_ENV = "CUDNN_CONV_WSCAP_DBG"  # cuDNN's own cap, MiB per workspace allocation
CONFIG_KEY = "cudnn_workspace_mib"
# batchfit's cap when neither the config nor the environment sets one. Caffe2 used 64 MiB as
# its default cuDNN workspace limit: "this enables the use of Winograd in many cases"
# (caffe2/operators/op_utils_cudnn.h, kCONV_CUDNN_WORKSPACE_LIMIT_BYTES).
DEFAULT_CAP_MIB = 64

# A convolution call as its plan is keyed (setConvolutionParams: shapes, strides, dtype,
# parameters): ("forward" | "backward_data" | "backward_filter", input shape, input
# stride, weight shape, dtype, stride, padding, dilation, transposed, output padding, groups).
Signature = tuple


@dataclass
class CudnnWorkspaces:
    """How large a cuDNN call's workspace is taken to be: `measured` bytes per call
    signature where known (on the card), else `cap_bytes` (None: no cap, nothing counted).
    `seen` collects the signatures of the calls met, for measuring them."""

    cap_bytes: int | None = DEFAULT_CAP_MIB * MiB
    measured: dict[Signature, int] = field(default_factory=dict)
    measure: Callable[[Signature, tuple], int] | None = None  # on the card: runs the call
    seen: set[Signature] = field(default_factory=set)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CudnnWorkspaces:
        """The cap of CUDNN_CONV_WSCAP_DBG (MiB), as cuDNN reads it; unset: no cap."""
        value = environ.get(WSCAP_ENV)
        return cls(cap_bytes=None if value is None else int(value) * MiB)

    def bytes_of(self, signature: Signature, args: tuple) -> int:
        """The workspace of one call: measured on the card, else the cap, else 0."""
        self.seen.add(signature)
        if signature not in self.measured and self.measure is not None:
            self.measured[signature] = self.measure(signature, args)
        if signature in self.measured:
            return self.measured[signature]
        return self.cap_bytes or 0

    @property
    def largest_bytes(self) -> int | None:
        """The largest workspace counted for a call met (None: none met)."""
        if not self.seen:
            return None
        return max(self.measured.get(s, self.cap_bytes or 0) for s in self.seen)

    @property
    def source(self) -> str:
        """What a call's workspace is: "measured" on the card, the "cap", or "none" counted."""
        if self.measure is not None:
            return "measured"
        return "cap" if self.cap_bytes is not None else "none"

    @property
    def is_bound(self) -> bool:
        """Whether a call's workspace was counted at the cap (not measured)."""
        return self.measure is None and self.cap_bytes is not None


def cap_problems(value: Any) -> list[str]:
    """What is wrong with cudnn_workspace_mib: a whole number of MiB >= 0, or null."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return []
    if isinstance(value, str) and value.strip().isdigit():
        return []
    return [
        f"{CONFIG_KEY} must be a whole number of MiB >= 0 (cuDNN's workspace cap per "
        f"convolution call) or null (no cap), got {value!r}; override with "
        f"{CONFIG_KEY}={DEFAULT_CAP_MIB}"
    ]


_EXPORTED: dict[int, str] = {}  # id(environ) -> the value apply_cap last exported there


def apply_cap(value: Any, environ: Any = os.environ) -> None:
    """Export cudnn_workspace_mib as CUDNN_CONV_WSCAP_DBG for cuDNN in this process (before
    its first convolution: cuDNN reads its own environment), where CudnnWorkspaces.from_env
    reads it too. null takes back the cap batchfit exported; one set by hand stays."""
    if value is None:
        if environ.get(WSCAP_ENV) is not None and environ.get(WSCAP_ENV) == _EXPORTED.get(
            id(environ)
        ):
            del environ[WSCAP_ENV]
        return
    environ[WSCAP_ENV] = _EXPORTED[id(environ)] = str(int(value))


def _dims(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride())


def _signature(kind: str, input_: torch.Tensor, weight: torch.Tensor, rest: tuple) -> Signature:
    (stride, padding, dilation, transposed, output_padding, groups) = rest
    return (
        kind,
        *_dims(input_),
        tuple(weight.shape),
        input_.dtype,
        tuple(stride),
        tuple(padding),
        tuple(dilation),
        bool(transposed),
        tuple(output_padding),
        int(groups),
    )


def _workspace(workspaces: CudnnWorkspaces, signature: Signature, args: tuple, like: Any) -> None:
    """One call's workspace: allocated, then freed (run_conv_plan's DataPtr)."""
    nbytes = workspaces.bytes_of(signature, args)
    if nbytes > 0:
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        del workspace


def _memory_format(input_: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """cudnn_conv_suggest_memory_format (aten/src/ATen/native/ConvUtils.h): channels-last
    when the input or the weight is laid out so, else contiguous."""
    if input_.dim() not in (4, 5):
        return torch.contiguous_format
    last = torch.channels_last if input_.dim() == 4 else torch.channels_last_3d
    for tensor in (input_, weight):
        if tensor.is_contiguous(memory_format=last) and not tensor.is_contiguous():
            return last
    return torch.contiguous_format


def conv_composites(workspaces: CudnnWorkspaces) -> dict[Any, Callable[..., Any]]:
    """aten.convolution and aten.convolution_backward run as CUDA's cuDNN backend runs
    them (module docstring): the copies that make their operands contiguous in the layout
    cuDNN is given (`input.contiguous(backend_memory_format)` in Convolution.cpp, the
    gradient's `.to(input.suggest_memory_format())` in ConvShared.cpp), each output, then
    the workspace of the cuDNN call that fills it, allocated and freed; the bias gradient
    last. For the memory tracker's `composites`."""

    def convolution(input_, weight, bias, stride, padding, dilation, transposed,
                    output_padding, groups):  # fmt: skip  # noqa: ANN001, ANN202
        rest = (stride, padding, dilation, transposed, output_padding, groups)
        input_ = input_.contiguous(memory_format=_memory_format(input_, weight))
        out = aten.convolution.default(input_, weight, bias, *rest)
        kind = "backward_data" if transposed else "forward"  # a transposed conv's plan
        _workspace(workspaces, _signature(kind, input_, weight, rest), (input_, weight), out)
        return out

    def convolution_backward(grad_output, input_, weight, bias_sizes, stride, padding,
                             dilation, transposed, output_padding, groups, output_mask):  # fmt: skip  # noqa: ANN001, ANN202, E501
        rest = (stride, padding, dilation, transposed, output_padding, groups)
        layout = _memory_format(input_, weight)
        if output_mask[1]:  # "only make input contiguous when it is necessary"
            input_ = input_.contiguous(memory_format=layout)
        grad_output = grad_output.contiguous(memory_format=layout)
        grads: list[Any] = [None, None, None]
        # the input-gradient of a transposed convolution is a forward convolution's plan
        parts = (("forward" if transposed else "backward_data", 0), ("backward_filter", 1))
        for kind, index in parts:
            if not output_mask[index]:
                continue
            mask = [i == index for i in range(3)]
            grads[index] = aten.convolution_backward.default(
                grad_output, input_, weight, bias_sizes, *rest, mask
            )[index]
            signature = _signature(kind, input_, weight, rest)
            _workspace(workspaces, signature, (grad_output, input_, weight), grads[index])
        if output_mask[2]:
            grads[2] = aten.convolution_backward.default(
                grad_output, input_, weight, bias_sizes, *rest, [False, False, True]
            )[2]
        return tuple(grads)

    return {
        aten.convolution.default: convolution,
        aten.convolution_backward.default: convolution_backward,
    }


def measure_on_device(device: torch.device) -> Callable[[Signature, tuple], int]:
    """A CudnnWorkspaces.measure for this machine's GPU: runs the call of a signature once on
    real tensors of its shapes (random values), alone, and returns what the caching
    allocator's peak rose above what the call leaves allocated: its workspace and any
    temporary of the call, as the caching allocator rounds them. The plan it runs is cached
    by cuDNN for those shapes (module docstring), so the step runs the same one. The
    precision settings in force (TF32, determinism) are the step's: the predictor measures
    inside its step."""
    from torch.utils._python_dispatch import _disable_current_modes

    def measure(signature: Signature, _args: tuple) -> int:
        (kind, shape, strides, weight_shape, dtype, *params) = signature
        stride, padding, dilation, transposed, output_padding, groups = params
        rest = (list(stride), list(padding), list(dilation), transposed, list(output_padding),
                groups)  # fmt: skip
        with _disable_current_modes(), torch.no_grad():
            x = torch.empty_strided(shape, strides, dtype=dtype, device=device).normal_()
            w = torch.randn(weight_shape, dtype=dtype, device=device)
            out_shape = aten.convolution.default(x.to("meta"), w.to("meta"), None, *rest).shape
            grad = torch.randn(out_shape, dtype=dtype, device=device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            if (kind, transposed) in (("forward", False), ("backward_data", True)):  # the conv
                result = aten.convolution.default(x, w, None, *rest)
            else:
                index = 1 if kind == "backward_filter" else 0
                mask = [i == index for i in range(3)]
                result = aten.convolution_backward.default(grad, x, w, None, *rest, mask)
            torch.cuda.synchronize(device)
            left = torch.cuda.memory_allocated(device)
            peak = torch.cuda.max_memory_allocated(device)
            del result, x, w, grad
        torch.cuda.empty_cache()
        return max(0, peak - left)

    return measure
