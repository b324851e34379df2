"""Numeric precision of a run: autocast dtype, fp16 loss scaling and TF32, per device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.train.device.spec import DeviceSpec

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def unsupported_reason(name: str, device: torch.device | DeviceSpec) -> str | None:
    """Why `name` cannot run on `device` (a local one, or a DeviceSpec planned for, maybe
    not here), or None when it can."""
    if isinstance(device, DeviceSpec):
        if device.local or device.gpu is None:
            return unsupported_reason(name, torch.device(device.type))
        major = device.gpu.capability[0]
        if name in ("tf32", "bf16") and major < 8:
            return f"{name} needs compute capability >= 8.0, {device.name} has {major}.x"
        return None
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if name == "tf32" and major < 8:
            return f"tf32 needs compute capability >= 8.0, {torch.cuda.get_device_name(device)}"
        if name == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            return f"bf16 is not supported by {torch.cuda.get_device_name(device)}"
        return None
    if name == "tf32":
        return f"tf32 is a CUDA tensor-core mode; the device is {device.type}"
    return None


@dataclass(frozen=True)
class Precision:
    """Everything a training step needs to know about its precision."""

    name: str
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST_DTYPES.get(self.name)

    def autocast(self) -> Any:
        dtype = self.autocast_dtype
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        # fp16 has a narrow exponent range: scale the loss so small gradients do not flush to
        # zero. bf16 has fp32's range and needs no scaling.
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "fp16")

    @contextmanager
    def matmul_mode(self) -> Iterator[None]:
        """TF32 on for `tf32`, off for everything else (cuDNN enables it by default)."""
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        use_tf32 = self.name == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = use_tf32
        torch.backends.cudnn.allow_tf32 = use_tf32
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
