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
(`MeasureOnDevice`): the plan cache makes the training step take the same plan. With
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
Calls = dict  # Signature -> the workspace counted for it: the calls a step made


@dataclass
class CudnnWorkspaces:
    """How large a cuDNN call's workspace is taken to be: measured on the card where a
    `measure` is given (each signature once, kept in `measured`), else `cap_bytes` (None: no
    cap, nothing counted). One per run's DeviceSpec, shared by its predictors; not part of
    what identifies a prediction (train/workload.py keys predictors without it)."""

    cap_bytes: int | None = DEFAULT_CAP_MIB * MiB
    measured: dict[Signature, int] = field(default_factory=dict)
    # on the card: runs one call of a signature, its workspace in bytes (None: it could not
    # run there, out of memory: the cap is counted)
    measure: Callable[[Signature], int | None] | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CudnnWorkspaces:
        """The cap of CUDNN_CONV_WSCAP_DBG (MiB), as cuDNN reads it; unset: no cap."""
        value = environ.get(WSCAP_ENV)
        return cls(cap_bytes=None if value is None else int(value) * MiB)

    def bytes_of(self, signature: Signature) -> int:
        """The workspace of one call: measured on the card, else the cap, else 0."""
        if signature not in self.measured and self.measure is not None:
            found = self.measure(signature)
            self.measured[signature] = (self.cap_bytes or 0) if found is None else found
        if signature in self.measured:
            return self.measured[signature]
        return self.cap_bytes or 0

    @property
    def source(self) -> str:
        """What a call's workspace is: "measured" on the card, the "cap", or "none" counted."""
        if self.measure is not None:
            return "measured"
        return "cap" if self.cap_bytes is not None else "none"


def step_workspace_bytes(
    workspaces: CudnnWorkspaces, step: tuple[int, str], found: list[tuple[Calls, dict]]
) -> int | None:
    """The largest workspace counted in the step of a micro-batch size and precision, from
    (calls met, largest per step computed) of a predictor and its shallow copies: the
    step's own where it was computed, else (a step read off a line) the cap, or on the card
    the largest measured for any call met."""
    for _, by_step in found:
        if step in by_step:
            return by_step[step]
    if workspaces.source == "cap":
        return workspaces.cap_bytes
    return max((n for calls, _ in found for n in calls.values()), default=None)


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


def _workspace(workspaces: CudnnWorkspaces, calls: Calls, signature: Signature, like: Any) -> None:
    """One call's workspace: allocated, then freed (run_conv_plan's DataPtr)."""
    nbytes = calls[signature] = workspaces.bytes_of(signature)
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


def conv_composites(workspaces: CudnnWorkspaces, calls: Calls) -> dict[Any, Callable[..., Any]]:
    """aten.convolution and aten.convolution_backward run as CUDA's cuDNN backend runs
    them (module docstring), each call's signature and workspace recorded in `calls`. For
    the memory tracker's `composites`. The copies are those that make operands contiguous
    in the layout cuDNN is given, each made where the source makes it and freed when its
    function returns:

    - forward (`_convolution`): the input (Convolution.cpp), then in `cudnn_convolution` the
      output, the weight (`cudnn_convolution_forward_out`), the workspace;
    - backward (`convolution_backward`): the input when the weight's gradient is wanted
      (Convolution.cpp); a transposed convolution's gradient (`cudnn_convolution_transpose_
      backward`); then `cudnn_convolution_backward_input`: the input's gradient, the weight
      and the gradient, the workspace; `cudnn_convolution_backward_weight`: the gradient and
      the input, the weight's gradient, the workspace; the bias's gradient last, outside
      cuDNN (`grad_output.sum`)."""

    def convolution(input_, weight, bias, stride, padding, dilation, transposed,
                    output_padding, groups):  # fmt: skip  # noqa: ANN001, ANN202
        rest = (stride, padding, dilation, transposed, output_padding, groups)
        layout = _memory_format(input_, weight)
        contiguous = input_.contiguous(memory_format=layout)
        out = aten.convolution.default(contiguous, weight, bias, *rest)
        weight_copy = weight.contiguous(memory_format=layout)
        kind = "backward_data" if transposed else "forward"  # a transposed conv's plan
        _workspace(workspaces, calls, _signature(kind, contiguous, weight, rest), out)
        del weight_copy, contiguous
        return out

    def convolution_backward(grad_output, input_, weight, bias_sizes, stride, padding,
                             dilation, transposed, output_padding, groups, output_mask):  # fmt: skip  # noqa: ANN001, ANN202, E501
        rest = (stride, padding, dilation, transposed, output_padding, groups)

        def call(index: int, grad: Any, inputs: Any) -> Any:
            mask = [i == index for i in range(3)]
            backward = aten.convolution_backward.default
            return backward(grad, inputs, weight, bias_sizes, *rest, mask)[index]

        layout = _memory_format(input_, weight)
        # "only make input contiguous when it is necessary" (for the weight's gradient)
        inputs = input_.contiguous(memory_format=layout) if output_mask[1] else input_
        grad = grad_output
        if transposed:
            grad = grad_output.contiguous(memory_format=_memory_format(input_, input_))
        grads: list[Any] = [None, None, None]
        if output_mask[0]:
            grads[0] = call(0, grad, inputs)
            copies = [t.contiguous(memory_format=layout) for t in (weight, grad)]
            # the input-gradient of a transposed convolution is a forward convolution's plan
            kind = "forward" if transposed else "backward_data"
            _workspace(workspaces, calls, _signature(kind, inputs, weight, rest), grads[0])
            del copies
        if output_mask[1]:
            copies = [t.contiguous(memory_format=layout) for t in (grad, inputs)]
            grads[1] = call(1, grad, inputs)
            signature = _signature("backward_filter", inputs, weight, rest)
            _workspace(workspaces, calls, signature, grads[1])
            del copies
        del inputs, grad  # the operands' copies end with cuDNN's calls
        if output_mask[2]:
            grads[2] = call(2, grad_output, input_)
        return tuple(grads)

    return {
        aten.convolution.default: convolution,
        aten.convolution_backward.default: convolution_backward,
    }


class MeasureOnDevice:
    """A CudnnWorkspaces.measure for this machine's GPU: runs the call of a signature once on
    real tensors of its shapes (random values, contiguous: the call copies nothing), alone,
    and returns what the caching allocator's peak rose above what the call leaves
    allocated: its workspace, as the caching allocator rounds it. The plan it runs is
    cached by cuDNN for those shapes (module docstring), so the step runs the same one. The
    precision settings in force (TF32, determinism) are the step's: the predictor measures
    inside its step. A call that runs out of memory alone answers None (its cap is
    counted). A class, not a closure: a DeviceSpec travels to DDP/FSDP ranks by pickle."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, signature: Signature) -> int | None:
        from torch.utils._python_dispatch import _disable_current_modes

        (kind, shape, strides, weight_shape, dtype, *params) = signature
        stride, padding, dilation, transposed, output_padding, groups = params
        rest = (list(stride), list(padding), list(dilation), transposed, list(output_padding),
                groups)  # fmt: skip
        device = self.device
        with _disable_current_modes(), torch.no_grad():
            try:
                x = torch.empty_strided(shape, strides, dtype=dtype, device=device).normal_()
                w = torch.randn(weight_shape, dtype=dtype, device=device)
                meta = aten.convolution.default(x.to("meta"), w.to("meta"), None, *rest)
                grad = torch.randn(meta.shape, dtype=dtype, device=device)
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                if (kind, transposed) in (("forward", False), ("backward_data", True)):
                    result = aten.convolution.default(x, w, None, *rest)  # the conv itself
                else:
                    index = 1 if kind == "backward_filter" else 0
                    mask = [i == index for i in range(3)]
                    result = aten.convolution_backward.default(grad, x, w, None, *rest, mask)
                torch.cuda.synchronize(device)
                left = torch.cuda.memory_allocated(device)
                peak = torch.cuda.max_memory_allocated(device)
                del result
            except torch.OutOfMemoryError:
                return None
            finally:
                x = w = grad = None
                torch.cuda.empty_cache()
        return max(0, peak - left)
