"""How large a cuDNN convolution's workspace is taken to be (`CudnnWorkspaces`): the cap batchfit
exports for cuDNN (`cudnn_workspace_mib`, conf/config.yaml; the environment's
CUDNN_CONV_WSCAP_DBG wins), at which a prediction for a card this machine does not have counts
every call, or, on the card itself, each call's shapes run once for real, alone, and measured
(`MeasureOnDevice`). How a predicted step uses them: train/memory/cudnn.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
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
# stride, weight shape, weight stride, dtype, stride, padding, dilation, transposed, output
# padding, groups).
Signature = tuple
Calls = dict  # Signature -> the workspace counted for it: the calls a step made
# A cuDNN batch norm as aten/src/ATen/native/cudnn/BatchNorm.cpp sizes its buffers:
# ("batch_norm", input shape, input stride, input dtype, weight dtype, persistent): persistent
# is CUDNN_BATCHNORM_SPATIAL_PERSISTENT (training over channels-last input), else SPATIAL.
NormSizes = tuple[int, int, int]  # forward workspace, reserve (kept to backward), backward's


class ElasticKey(int):
    """The event key (the storage number) of an allocation that gives way under a limit: a
    cuDNN convolution's workspace. When the caching allocator cannot serve it, even after
    releasing its cache, PyTorch catches the out-of-memory error and runs the convolution
    with the next engine config of cuDNN's list, down to one that needs no workspace, and
    a plan from its cache likewise (aten/src/ATen/native/cudnn/Conv_v8.cpp: `try_configs`,
    `try_plans`, `run_single_conv`). Such an allocation never makes a step run out of
    memory: the allocator model (train/memory/reserve.py) skips it where it would. An int
    everywhere else, equal to the plain storage number its free is recorded with."""

    __slots__ = ()


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
    # cuDNN batch norms: measured on the card (measure_norm), each signature once
    norms: dict[Signature, NormSizes] = field(default_factory=dict)
    measure_norm: Callable[[Signature], NormSizes | None] | None = None

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

    def norm_bytes_of(self, signature: Signature) -> NormSizes | None:
        """A cuDNN batch norm's forward workspace, reserve and backward workspace: measured
        on the card; off it, none for SPATIAL (an inference: cuDNN's legacy
        cudnnBatchNormalizationForwardTraining/Backward run that mode with neither, so the
        Ex calls PyTorch makes need none for it; the conv-cap section of bench/gpu_checks.sh
        measures it), and None for SPATIAL_PERSISTENT: not known off the card."""
        if signature not in self.norms and self.measure_norm is not None:
            found = self.measure_norm(signature)
            if found is not None:
                self.norms[signature] = found
        if signature in self.norms:
            return self.norms[signature]
        return None if signature[-1] else (0, 0, 0)

    @property
    def source(self) -> str:
        """What a call's workspace is: "measured" on the card, the "cap", or "none" counted."""
        if self.measure is not None:
            return "measured"
        return "cap" if self.cap_bytes is not None else "none"


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


class MeasureOnDevice:
    """A CudnnWorkspaces.measure for this machine's GPU: runs the call of a signature once on
    real tensors of its shapes and strides (random values), alone, and returns the most the
    caching allocator held during the call beyond what the call leaves allocated: its
    workspace, as the allocator rounds it. The plan it runs is cached by cuDNN for those
    shapes (module docstring), so the step runs the same one. The precision settings in
    force (TF32, determinism) are the step's: the predictor measures inside its step.

    It reads the call from the allocator's memory history (`transient_bytes`), turned on
    for the call when it was off, so the process's peak statistics (max_memory_allocated /
    reserved, which a run or the user's own code reads) are left as they were, and its
    cache is not emptied. A call that runs out of memory alone, or that a history the user
    records cannot tell apart, answers None (its cap is counted). A class, not a
    closure: a DeviceSpec travels to DDP/FSDP ranks by pickle."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, signature: Signature) -> int | None:
        from torch.utils._python_dispatch import _disable_current_modes

        device = self.device
        with _disable_current_modes(), torch.no_grad():
            try:
                x, w, grad = operands(signature, device)
                torch.cuda.synchronize(device)
                with _history(device) as window:
                    result = run_call(signature, x, w, grad)
                    torch.cuda.synchronize(device)
                    del result
            except torch.OutOfMemoryError:
                return None
            finally:
                x = w = grad = None
        return window.transient()

    def norm(self, signature: Signature) -> NormSizes | None:
        """A cuDNN batch norm of the signature run once, forward then backward, alone:
        its forward workspace and backward workspace from the allocator's history, its
        reserve as cudnn_batch_norm returns it. None: out of memory alone, or the history
        could not say."""
        from torch.utils._python_dispatch import _disable_current_modes

        (_, shape, strides, dtype, weight_dtype, _) = signature
        device, channels, eps = self.device, shape[1], 1e-5
        with _disable_current_modes(), torch.no_grad():
            try:
                x = torch.empty_strided(shape, strides, dtype=dtype, device=device).normal_()
                grad = torch.randn_like(x)
                w, b, mean, var = (torch.rand(channels, dtype=weight_dtype, device=device)
                                   for _ in range(4))  # fmt: skip
                torch.cuda.synchronize(device)
                with _history(device) as forward:
                    out, saved_mean, saved_var, reserve = aten.cudnn_batch_norm.default(
                        x, w, b, mean, var, True, 0.1, eps
                    )
                    torch.cuda.synchronize(device)
                with _history(device) as backward:
                    grads = aten.cudnn_batch_norm_backward.default(
                        x, grad, w, mean, var, saved_mean, saved_var, eps, reserve
                    )
                    torch.cuda.synchronize(device)
                    del grads
                reserved = reserve.untyped_storage().nbytes()
                del out, saved_mean, saved_var, reserve
            except torch.OutOfMemoryError:
                return None
        before, after = forward.transient(), backward.transient()  # the reserve stays: not in
        return None if before is None or after is None else (before, reserved, after)


def operands(signature: Signature, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """The input, weight and output-gradient of a signature's call on `device`: random
    values, each with the signature's shape and strides (a channels-last weight stays so)."""
    (_, shape, strides, weight_shape, weight_strides, dtype, *params) = signature
    x = torch.empty_strided(shape, strides, dtype=dtype, device=device).normal_()
    w = torch.empty_strided(weight_shape, weight_strides, dtype=dtype, device=device).normal_()
    meta = aten.convolution.default(x.to("meta"), w.to("meta"), None, *_rest(params))
    grad = torch.randn(meta.shape, dtype=dtype, device=device)
    return x, w, grad


def _rest(params: list) -> tuple:
    stride, padding, dilation, transposed, output_padding, groups = params
    return (list(stride), list(padding), list(dilation), transposed, list(output_padding),
            groups)  # fmt: skip


def run_call(signature: Signature, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> Any:
    """The one cuDNN call of a signature: a forward (or a transposed convolution's
    backward-data) convolution, or the backward pass for one gradient."""
    kind, transposed = signature[0], signature[9]
    rest = _rest(list(signature[6:]))
    if (kind, transposed) in (("forward", False), ("backward_data", True)):
        return aten.convolution.default(x, w, None, *rest)
    index = 1 if kind == "backward_filter" else 0
    mask = [i == index for i in range(3)]
    return aten.convolution_backward.default(grad, x, w, None, *rest, mask)


def transient_bytes(entries: list[dict]) -> int:
    """Of the caching allocator's history over a call (a snapshot's device_traces entries:
    `alloc` and `free_requested`, block sizes), the most it allocated beyond what the call
    leaves allocated: a kernel's workspace, allocated and freed within."""
    live = peak = 0
    for entry in entries:
        if entry["action"] == "alloc":
            live += entry["size"]
            peak = max(peak, live)
        elif entry["action"] == "free_requested":
            live -= entry["size"]
    return max(0, peak - live)


def _trace(device: torch.device) -> list[dict]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.memory._snapshot(device)["device_traces"][index]


class _Window:
    """The allocator history's entries over a call (None: the history cannot say)."""

    entries: list[dict] | None = None

    def transient(self) -> int | None:
        return None if self.entries is None else transient_bytes(self.entries)


@contextlib.contextmanager
def _history(device: torch.device) -> Iterator[_Window]:
    """The allocator's history over the block: turned on (without stacks) if it was off,
    and off again after, the entries it added being the block's. A history the user
    records stays on: its ring buffer may be full (the count of entries no longer grows),
    so the block's are those stamped after the last one before (`time_us`); without
    stamps the window says nothing."""
    window = _Window()
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)
    was_on = bool(enabled())
    if not was_on:
        torch.cuda.memory._record_memory_history("all", context=None, device=device)
    try:
        before = _trace(device)
        count, last = len(before), (before[-1] if before else {"time_us": -1})
        yield window
        after = _trace(device)
        if not was_on:
            window.entries = after[count:]
        elif "time_us" in last:
            window.entries = [e for e in after if e.get("time_us", -1) > last["time_us"]]
    finally:
        if not was_on:
            torch.cuda.memory._record_memory_history(None, device=device)
