"""The device a run's memory is planned for: the one it trains on, or a GPU named by
`search.gpu` that this machine may not have.

A run trains on `trainer.device` (train/run.py `resolve_device`); its memory is predicted
for a `DeviceSpec`: the same CPU, the same GPU, or, with `search.gpu=A100-40GB`, a card from
the table of train/device/gpus.py. On a laptop or a login node the fit report and a study's
preflight then answer "what fits on an A100-40GB?" for CUDA's reserved bytes: the step is
computed on fake CPU tensors with CUDA's behaviour (train/memory/cuda_emulation.py) and replayed
through the caching-allocator model with the card's cuBLAS workspaces (train/memory/reserve.py).
cuDNN convolutions' workspaces are counted at the cap the run sets (train/memory/cudnn.py), or
measured on this machine's GPU when it is the one planned for. Such a plan cannot train here:
`trains_here` says so, and the entry points stop before training with the command that
reports what fits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.device.cudnn_workspaces import CudnnWorkspaces, MeasureOnDevice
from batchfit.train.device.gpus import Gpu, gpu, gpu_of_device_name
from batchfit.train.device.sizes import device_total_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """What a memory prediction needs of a device. `gpu` is None for the CPU; `local` says
    whether this machine has the device (a run can train on it)."""

    type: str  # "cpu" or "cuda"
    total_bytes: int
    gpu: Gpu | None = None
    allocator: AllocatorSettings | None = None  # CUDA's caching allocator, as configured
    local: bool = True
    # cuDNN convolutions' workspaces: at the cap a run sets, measured on this machine's GPU
    # (train/memory/cudnn.py); shared by the predictors of a run, not part of its identity
    cudnn: CudnnWorkspaces | None = field(default=None, compare=False, hash=False)

    @property
    def name(self) -> str:
        return self.gpu.name if self.gpu is not None else self.type

    @property
    def capability(self) -> tuple[int, int] | None:
        return self.gpu.capability if self.gpu is not None else None


def _local_gpu(device: torch.device) -> Gpu:
    """The table's entry for this machine's GPU, or one made of what torch reports (no peak
    FLOP/s: trainer.peak_flops gives it)."""
    props = torch.cuda.get_device_properties(device)
    known = gpu_of_device_name(props.name)
    sms = props.multi_processor_count
    # What this process cannot have of the card, measured (Gpu.usable_bytes: the table's
    # figure for a card planned from elsewhere): what CUDA does not report free, less what
    # this process's caching allocator holds (its own, and usable).
    held = _held_bytes(device.index)
    name, flops = (known.name, known.peak_flops) if known is not None else (props.name, {})
    capability = (props.major, props.minor)
    return Gpu(name, props.total_memory, capability, flops, sms=sms, context_bytes=held)


@functools.cache
def _held_bytes(index: int | None) -> int:
    """What this process cannot have of the card, measured once (at its first plan, before
    it trains): what CUDA does not report free less what its caching allocator holds. Once,
    so that every plan of a process agrees (a study's predictors are shared between them)."""
    free, total = torch.cuda.mem_get_info(index)
    return max(0, total - free - torch.cuda.memory_reserved(index))


def device_spec(device: torch.device, gpu_name: str | None) -> DeviceSpec:
    """The DeviceSpec of a run on `device` (resolved) with `search.gpu` = `gpu_name`: the
    named card when given (ValueError naming search.gpu for an unknown one, or for one
    that is not the GPU this machine trains on), else the device itself."""
    named = gpu(gpu_name) if gpu_name is not None else None
    if device.type == "cuda":
        local = _local_gpu(device)
        if named is not None and gpu_of_device_name(torch.cuda.get_device_name(device)) != named:
            raise ValueError(
                f"search.gpu={gpu_name} plans for another GPU than this machine's "
                f"{torch.cuda.get_device_name(device)}, which trials train on; drop search.gpu "
                f"to train here, or plan for it with python -m search.fit trainer.device=cpu "
                f"search.gpu={gpu_name}"
            )
        cudnn = CudnnWorkspaces.from_env()
        cudnn.measure = measure = MeasureOnDevice(device)
        cudnn.measure_norm = measure.norm
        return DeviceSpec(
            "cuda", local.total_bytes, local, AllocatorSettings.from_env(), cudnn=cudnn
        )
    if named is not None:
        allocator = AllocatorSettings.from_env()
        cudnn = CudnnWorkspaces.from_env()
        return DeviceSpec("cuda", named.total_bytes, named, allocator, local=False, cudnn=cudnn)
    return DeviceSpec(device.type, device_total_bytes(device))
