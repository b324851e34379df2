"""How large a cuDNN convolution's workspace is taken to be (`CudnnWorkspaces`): the cap batchfit
exports for cuDNN (`cudnn_workspace_mib`, conf/config.yaml; the environment's
CUDNN_CONV_WSCAP_DBG wins), at which a prediction for a card this machine does not have counts
every call, or, on the card itself, each call's shapes run once for real, alone, and measured
(`MeasureOnDevice`). How a predicted step uses them: train/memory/cudnn.py.
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
