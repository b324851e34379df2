"""How a model is spread over the ranks of a data-parallel run, the same for a rank that
trains (train/launch/distributed.py) and for the predictor of one rank's memory
(train/memory/predict.py).

- `ddp`: torch's DistributedDataParallel. Each rank holds the whole model, its gradients
  and optimizer state, plus DDP's gradient buckets (one more copy of the trainable
  gradients, held by its C++ reducer), and all-reduces the gradients on a step's last
  micro-batch.
- `fsdp`: FSDP2 (`fully_shard`) on each block (`trainer.fsdp.sharding=blocks`, the modules
  activation checkpointing wraps) and on the whole model. Parameters, gradients and
  optimizer state are sharded over the ranks; a unit's parameters are all-gathered for its
  forward and backward (`trainer.fsdp.reshard_after_forward`) and its gradients
  reduce-scattered into the shards.

One rank's step is predicted on fake tensors with a fake process group (`fake_world`):
FSDP2 runs there as it runs on the ranks; DDP's reducer needs real storage, so its step is
the model's one-device step and its buckets are added (`ddp_bucket_sizes`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from batchfit.train.checkpointing import blocks
from batchfit.train.config import FSDPConfig

DDP_BUCKET_CAP_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default


def shard(model: nn.Module, fsdp: FSDPConfig, mesh: DeviceMesh) -> nn.Module:
    """`fully_shard` the model's blocks and then the model, in place, per `fsdp`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if fsdp.param_dtype == "bfloat16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    settings = {"mesh": mesh, "reshard_after_forward": fsdp.reshard_after_forward}
    if fsdp.sharding == "blocks":
        for block in blocks(model):
            fully_shard(block, mp_policy=policy, **settings)
    fully_shard(model, mp_policy=policy, **settings)
    return model


def ddp_bucket_sizes(model: nn.Module) -> list[int]:
    """Bytes of each of DDP's gradient buckets for `model`: its trainable parameters in
    reverse order (the order their gradients are ready in, which DDP rebuilds its buckets
    by after the first step) cut at DDP's bucket cap, one dtype per bucket."""
    sizes: list[int] = []
    current, dtype = 0, None
    for param in reversed([p for p in model.parameters() if p.requires_grad]):
        nbytes = param.numel() * param.element_size()
        if current and (current + nbytes > DDP_BUCKET_CAP_BYTES or param.dtype != dtype):
            sizes.append(current)
            current = 0
        current, dtype = current + nbytes, param.dtype
    return [*sizes, current] if current else sizes


@contextmanager
def fake_world(world: int) -> Iterator[DeviceMesh]:
    """A CPU device mesh of `world` ranks on the fake backend, this process as rank 0, for
    one rank's step on fake tensors (build it outside the FakeTensorMode: inside,
    init_device_mesh reads a fake scalar). The process group is destroyed at the end, so
    nothing else (torchmetrics) takes this process for a rank; what was sharded on the
    mesh keeps working on its fake group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already initialised in this process: memory of a "
            "data-parallel run is predicted outside its ranks"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


# FSDP2's collectives, as it calls them (torch.distributed.<name>); made settled on gloo.
# Up to torch 2.13 it called all_gather_into_tensor and reduce_scatter_tensor (the same
# output, input arguments); the _single ones are new in 2.14.
FSDP_COLLECTIVES = (
    ("all_gather_single", "reduce_scatter_single")
    if hasattr(dist, "all_gather_single")
    else ("all_gather_into_tensor", "reduce_scatter_tensor")
)
SETTLE_S = 1.0  # at most this long for gloo's worker thread to let go of a collective's tensors


@contextmanager
def settled_collectives() -> Iterator[None]:
    """FSDP2's all-gathers and reduce-scatters on gloo (CPU ranks), each run to its end
    and returned only once gloo's worker thread has dropped its references to the
    tensors. Gloo's work object holds them; its thread lets go of them after the op has
    completed, so their storage was freed there at a moment that varied from run to run
    (measured peaks differed by up to a buffer between identical runs). Settled, a rank
    frees them where FSDP2 drops them, in program order, as the fake process group's
    prediction does. The ops are synchronous here (FSDP2 takes a result that is not a
    Work as done): on CPU there is nothing to overlap them with."""
    originals = {name: getattr(dist, name) for name in FSDP_COLLECTIVES}

    def settled(collective):  # noqa: ANN001, ANN202
        def call(output, input, *args, async_op: bool = False, **kwargs):  # noqa: A002, ANN001, ANN002, ANN003, ANN202
            tensors = [output, input]
            before = [_uses(t) for t in tensors]
            work = collective(output, input, *args, async_op=True, **kwargs)
            work.wait()
            del work
            deadline = time.monotonic() + SETTLE_S
            while any(_uses(t) > n for t, n in zip(tensors, before, strict=True)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0)
            return None

        return call

    for name, collective in originals.items():
        setattr(dist, name, settled(collective))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)


def _uses(tensor: torch.Tensor) -> int:
    """References to the tensor's storage, C++ ones included."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
