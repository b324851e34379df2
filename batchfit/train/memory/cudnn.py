"""cuDNN convolutions' workspaces in a predicted CUDA step.

A cuDNN convolution allocates a workspace through the caching allocator for each call, frees
it when the call returns, and nothing else of the call outlives it. The predictor's step on
fake CPU tensors has the convolutions' outputs (their meta kernels) but not these workspaces:
on a real H200 they made small_cnn and resnet18 steps take up to 65% more than predicted.
`conv_composites` runs each convolution as CUDA runs it, workspace included, for the memory
tracker (train/measure/memory.py); `CudnnWorkspaces` says how large each workspace is taken to be.

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
`benchmark` on (not batchfit's; a model file or the user's code may set it) a step is not
predicted (BENCHMARK_ON, raised by the predictor for a CUDA step with convolutions): the
first call of each new shape allocates the largest workspace among the plans that fit the
free memory (`generate_and_filter_plans`: up to nearly all of it) to time them, then empties
the cache, and the plan caches are per thread, so the backward pass's autograd thread times
its convolutions again.

Whatever a call's workspace, it never makes a step run out of memory: when the caching
allocator cannot serve it, PyTorch runs the next engine config (`try_configs`, `try_plans`,
also for a cached plan), down to one without a workspace. The workspace is marked elastic
(train/device/cudnn_workspaces.py ElasticKey) and the allocator model skips it where it would
not fit (train/memory/reserve.py): what fits never rests on a workspace's size, or on
whether cuDNN honours the cap (documented only for cuDNN 8.0.5's legacy calls; the conv-cap
section of bench/gpu_checks.sh settles it on a card).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchfit.train.device.cudnn_workspaces import Calls, CudnnWorkspaces, NormSizes, Signature

aten = torch.ops.aten

BENCHMARK_ON = (
    "torch.backends.cudnn.benchmark is on (set by the model's code or yours): on each new "
    "input shape cuDNN then times every engine with the largest workspace that fits the free "
    "memory, up to nearly all of it, empties the cache, and does it again for the backward "
    "pass's thread, so the step's memory cannot be predicted; set "
    "torch.backends.cudnn.benchmark = False where it is set to have it predicted"
)


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


def _dims(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride())


def _signature(kind: str, input_: torch.Tensor, weight: torch.Tensor, rest: tuple) -> Signature:
    (stride, padding, dilation, transposed, output_padding, groups) = rest
    return (
        kind,
        *_dims(input_),
        *_dims(weight),
        input_.dtype,
        tuple(stride),
        tuple(padding),
        tuple(dilation),
        bool(transposed),
        tuple(output_padding),
        int(groups),
    )


Elastic = Callable[[torch.Tensor], None]  # marks a workspace's allocation as one that gives way


def _workspace(
    workspaces: CudnnWorkspaces, calls: Calls, signature: Signature, like: Any, elastic: Elastic
) -> None:
    """One call's workspace: allocated, then freed (run_conv_plan's DataPtr)."""
    nbytes = calls[signature] = workspaces.bytes_of(signature)
    if nbytes > 0:
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        elastic(workspace)
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


def conv_composites(
    workspaces: CudnnWorkspaces, calls: Calls, elastic: Elastic = lambda _: None
) -> dict[Any, Callable[..., Any]]:
    """aten.convolution and aten.convolution_backward run as CUDA's cuDNN backend runs
    them (module docstring), each call's signature and workspace recorded in `calls`, each
    workspace passed to `elastic` (the tracker's: it gives way under a limit). For the
    memory tracker's `composites`. The copies are those that make operands contiguous
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
        _workspace(workspaces, calls, _signature(kind, contiguous, weight, rest), out, elastic)
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
            _workspace(workspaces, calls, _signature(kind, inputs, weight, rest), grads[0], elastic)
            del copies
        if output_mask[1]:
            copies = [t.contiguous(memory_format=layout) for t in (grad, inputs)]
            grads[1] = call(1, grad, inputs)
            signature = _signature("backward_filter", inputs, weight, rest)
            _workspace(workspaces, calls, signature, grads[1], elastic)
            del copies
        del inputs, grad  # the operands' copies end with cuDNN's calls
        if output_mask[2]:
            grads[2] = call(2, grad_output, input_)
        return tuple(grads)

    return {
        aten.convolution.default: convolution,
        aten.convolution_backward.default: convolution_backward,
    }


# ------------------------------------------------------------------------ batch norm

_INT32_MAX = 2**31 - 1  # "some cuDNN kernels have 32-bit indexing limitations"
_CUDNN_BN_MAX_BATCH = 880801  # training, as _select_batch_norm_backend checks it


def cudnn_batch_norm(input_: Any, weight: Any, bias: Any, training: bool) -> bool:
    """Whether CUDA runs this training batch norm on cuDNN (Normalization.cpp
    `_select_batch_norm_backend`, as read at torch 2.4-2.6: neither operand bfloat16, half
    input only over float weights, weight and bias given, 3 or more dims, at most 880,801
    samples, fewer than 2**31 elements; the gpu checks' conv-cap section measures it on the
    card), else ATen's own CUDA kernels (native_batch_norm, as on the CPU)."""
    if not training or weight is None or bias is None or input_.dim() < 3:
        return False
    if torch.bfloat16 in (input_.dtype, weight.dtype):
        return False
    if input_.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    return input_.shape[0] <= _CUDNN_BN_MAX_BATCH and input_.numel() < _INT32_MAX


def norm_signature(input_: Any, weight: Any) -> Signature:
    """A batch norm's signature (cudnn_workspaces.NormSizes' key): persistent where the input
    is channels-last (getCudnnBatchNormMode, in training)."""
    layout = _memory_format(input_, input_)
    return ("batch_norm", *_dims(input_), input_.dtype, weight.dtype,
            layout != torch.contiguous_format)  # fmt: skip


def norm_composites(workspaces: CudnnWorkspaces, met: dict) -> dict[Any, Callable[..., Any]]:
    """aten.native_batch_norm and its backward, for a training step's batch norms that CUDA
    runs on cuDNN (`cudnn_batch_norm`), as aten/src/ATen/native/cudnn/BatchNorm.cpp allocates:
    in the forward pass the input made contiguous in its suggested layout, the output, the
    saved mean and inverse variance ({C}, the weight's dtype), a workspace (freed when the
    call returns) and the reserve, which autograd keeps with the saved statistics until the
    backward pass (here: held by the saved mean); in the backward pass the gradient made
    contiguous, the input's, weight's and bias's gradients (all three, whatever autograd
    needs) and a workspace. Sizes: CudnnWorkspaces.norm_bytes_of, each signature's recorded
    in `met` (None: not known off the card, counted as none)."""

    def sizes(input_: Any, weight: Any) -> NormSizes:
        signature = norm_signature(input_, weight)
        found = met[signature] = workspaces.norm_bytes_of(signature)
        return found or (0, 0, 0)

    def forward(input_, weight, bias, running_mean, running_var, training, momentum, eps):  # noqa: ANN001, ANN202, E501
        if not cudnn_batch_norm(input_, weight, bias, training):
            return NotImplemented
        before, reserved, _ = sizes(input_, weight)
        contiguous = input_.contiguous(memory_format=_memory_format(input_, input_))
        out, mean, invstd = aten.native_batch_norm.default(
            contiguous, weight, bias, running_mean, running_var, training, momentum, eps
        )
        workspace = torch.empty(before, dtype=torch.uint8, device=input_.device)
        mean.cudnn_reserve = torch.empty(reserved, dtype=torch.uint8, device=input_.device)
        del workspace, contiguous
        return out, mean, invstd

    def backward(grad_out, input_, weight, running_mean, running_var, save_mean, save_invstd,
                 train, eps, output_mask):  # fmt: skip  # noqa: ANN001, ANN202
        signature = norm_signature(input_, weight)
        if not train or signature not in met:  # its forward did not run on cuDNN
            return NotImplemented
        _, _, after = met[signature] or (0, 0, 0)
        grad = grad_out.contiguous(memory_format=_memory_format(input_, input_))
        grads = aten.native_batch_norm_backward.default(
            grad, input_, weight, running_mean, running_var, save_mean, save_invstd, train,
            eps, [True, True, True],
        )  # fmt: skip
        workspace = torch.empty(after, dtype=torch.uint8, device=input_.device)
        del workspace, grad
        return tuple(g if wanted else None for g, wanted in zip(grads, output_mask, strict=True))

    return {
        aten.native_batch_norm.default: forward,
        aten.native_batch_norm_backward.default: backward,
    }
