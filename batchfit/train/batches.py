"""The input pipeline: each optimizer step's micro-batches, from in-memory tensors or through a
`torch.utils.data.DataLoader`, in one order.

Both paths draw the same sample indices (`StepSampler`: a seeded permutation per epoch, cut
into steps of the effective batch and those into micro-batches), so a dataset gives the same
run whichever way it is read. In-memory `Splits` are gathered by index on the host (the fast
path of the bundled sets; `loader.*` does not apply). `Datasets` are read by a DataLoader with
`loader.*`'s workers, pinned memory and collate function, one iterator for the whole run.
Batches stay on the host until the loop moves one micro-batch at a time to the device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Sampler, default_collate

from batchfit.train.config import LoaderConfig, TrainerConfig
from batchfit.train.data import Datasets, Splits
from batchfit.train.tasks import batch_size_of

# Variable-length dimensions are predicted at their longest among this many training samples.
SHAPE_SAMPLES = 256


def steps_plan(num_train: int, cfg: TrainerConfig) -> tuple[int, int]:
    """(steps per epoch, total steps) for the configured epoch/step budget; a step takes
    the global batch (all devices')."""
    steps_per_epoch = -(-num_train // cfg.global_batch_size)
    total = float("inf") if cfg.max_epochs is None else cfg.max_epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return steps_per_epoch, int(total)


def larger_than_data(cfg: TrainerConfig, num_train: int, data: str) -> str | None:
    """Why a step of `cfg`'s global batch cannot be filled by the `num_train` training
    samples of `data`: every epoch would be one short step of all of them, trained as if it
    were the batch asked for (its learning rate scaled for that batch). None where it can."""
    step = cfg.global_batch_size
    if step <= num_train:
        return None
    parts = [f"trainer.batch_size={cfg.batch_size}"]
    if cfg.accum_steps > 1:
        parts.append(f"trainer.accum_steps={cfg.accum_steps}")
    if cfg.devices > 1:
        parts.append(f"trainer.devices={cfg.devices}")
    what = " x ".join(parts) + (f" = {step} samples a step" if len(parts) > 1 else "")
    rate = "" if cfg.lr_scaling == "none" else ", at a learning rate scaled for " + str(step)
    fix = (
        f"e.g. trainer.batch_size={_power_of_two_below(num_train)}"
        if len(parts) == 1
        else "lower them so that their product is at most that"
    )
    return (
        f"{what} is larger than the {num_train} training samples of {data}: every epoch would "
        f"be one step of {num_train} samples{rate}; use at most {num_train} ({fix})"
    )


def _power_of_two_below(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class Padding:
    """A micro-batch that trains with weight 0: a rank whose share of a short last step
    is empty still runs as many forward and backward passes as the others (their
    collectives must meet), on one sample of the step that changes no gradient."""

    def __init__(self, batch: Any):
        self.batch = batch


def rank_share(chunk: torch.Tensor, size: int, rank: int) -> tuple[torch.Tensor, bool]:
    """Rank `rank`'s `size` samples of a global micro-batch (`chunk`, its ranks' shares in
    rank order), and whether it is padding: a short last chunk leaves the last ranks
    without samples, and they take its first one with weight 0."""
    share = chunk[rank * size : (rank + 1) * size]
    return (share, False) if len(share) else (chunk[:1], True)


class StepSampler(Sampler[list[int]]):
    """Micro-batch index lists of one rank for `num_steps` optimizer steps: each epoch a
    permutation of the training set drawn from a generator seeded with trainer.seed, cut
    into steps of the global batch (the last one of an epoch may be short) and each step
    into global micro-batches of batch_size x devices (its last one may be short), of
    which rank r takes the r-th batch_size. Every rank runs as many micro-batches per step;
    one with no samples left trains on padding (`padding`). One device: the step's
    micro-batches of batch_size."""

    def __init__(self, num_train: int, cfg: TrainerConfig, num_steps: int, rank: int = 0):
        self.num_train, self.cfg, self.num_steps, self.rank = num_train, cfg, num_steps, rank

    def steps(self) -> Iterator[list[torch.Tensor]]:
        """Per step, the indices of each micro-batch."""
        for micro in self.shares():
            yield [idx for idx, _ in micro]

    def shares(self) -> Iterator[list[tuple[torch.Tensor, bool]]]:
        """Per step, (indices, is padding) per micro-batch."""
        cfg = self.cfg
        steps_per_epoch, _ = steps_plan(self.num_train, cfg)
        gen = torch.Generator().manual_seed(cfg.seed)
        order = torch.empty(0, dtype=torch.int64)
        size, step_size = cfg.batch_size, cfg.global_batch_size
        for step in range(self.num_steps):
            index_in_epoch = step % steps_per_epoch
            if index_in_epoch == 0:
                order = torch.randperm(self.num_train, generator=gen)
            start = index_in_epoch * step_size
            chunks = order[start : start + step_size].split(size * cfg.devices)
            yield [rank_share(chunk, size, self.rank) for chunk in chunks]

    def __iter__(self) -> Iterator[list[int]]:
        for micro in self.steps():
            for chunk in micro:
                yield chunk.tolist()

    def __len__(self) -> int:
        return sum(len(micro) for micro in self.steps())


def to_device(batch: Any, device: torch.device, copy: bool = False) -> Any:
    """Every tensor of a batch (tuple, list, dict, nested) on `device`; non-blocking from
    pinned memory. `copy`: a new tensor even where it is already there (on CPU, the memory
    tracker then sees the micro-batch allocated as a GPU would)."""
    non_blocking = device.type == "cuda"

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=non_blocking, copy=copy)
        return value

    return tree_map(move, batch)


class Pipeline:
    """A run's training and validation batches on the host, and the seconds spent waiting for
    them."""

    def __init__(
        self, data: Splits | Datasets, loader: LoaderConfig | None = None, device: str = "cpu"
    ):
        self.data = data
        self.loader = loader or LoaderConfig()
        self.device = torch.device(device)
        self.seed = 0
        self._val_loader: DataLoader | None = None

    @classmethod
    def of(cls, data: Pipeline | Splits | Datasets, device: str | torch.device = "cpu") -> Pipeline:
        """`data` itself if it is a pipeline, else a pipeline of it with the default loader."""
        return data if isinstance(data, Pipeline) else cls(data, LoaderConfig(), device)

    @property
    def in_memory(self) -> bool:
        return isinstance(self.data, Splits)

    @property
    def num_train(self) -> int:
        return len(self.data.train_y) if self.in_memory else len(self.data.train)

    def _dataloader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        """A DataLoader of `loader.*`, with a generator of its own: starting an iteration
        draws the workers' base seed from it, never from the global RNG that dropout and
        augmentation use (reading data must not change the run)."""
        cfg = self.loader
        workers = cfg.num_workers
        pin = cfg.pin_memory if cfg.pin_memory is not None else self.device.type == "cuda"
        return DataLoader(
            dataset,
            num_workers=workers,
            collate_fn=cfg.collate_fn or default_collate,
            pin_memory=pin,
            persistent_workers=cfg.persistent_workers and workers > 0,
            prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
            generator=torch.Generator().manual_seed(self.seed),
            **kwargs,
        )

    def train_steps(
        self, cfg: TrainerConfig, num_steps: int, rank: int = 0
    ) -> Iterator[tuple[list[Any], int, float]]:
        """Per optimizer step: rank `rank`'s host micro-batches (a `Padding` where it has no
        samples left), its samples, and the seconds the loop waited for them (reading,
        decoding and collating not hidden by workers)."""
        sampler = StepSampler(self.num_train, cfg, num_steps, rank)

        def counted(micro: list[tuple[torch.Tensor, bool]], batches: list[Any]) -> tuple:
            samples = sum(len(idx) for idx, pad in micro if not pad)
            batches = [Padding(b) if pad else b for b, (_, pad) in zip(batches, micro, strict=True)]
            return batches, samples

        if self.in_memory:
            x, y = self.data.train_x, self.data.train_y
            for micro in sampler.shares():
                started = time.perf_counter()
                batches, samples = counted(micro, [(x[idx], y[idx]) for idx, _ in micro])
                yield batches, samples, time.perf_counter() - started
            return
        self.seed = cfg.seed  # of the workers' RNGs, for validation too
        loader = self._dataloader(self.data.train, batch_sampler=sampler)
        batches = iter(loader)
        try:
            for micro in sampler.shares():
                started = time.perf_counter()
                step, samples = counted(micro, [next(batches) for _ in micro])
                yield step, samples, time.perf_counter() - started
        finally:
            del batches  # shuts its workers down

    def val_batches(self, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Any]:
        """The validation split in batches; on `world` ranks, rank `rank`'s share of each
        global batch of batch_size x world (`Padding` where it has none): the ranks
        together see the split once."""
        if world > 1:
            yield from self._val_shares(batch_size, rank, world)
            return
        if self.in_memory:
            x, y = self.data.val_x, self.data.val_y
            for start in range(0, len(y), batch_size):
                yield x[start : start + batch_size], y[start : start + batch_size]
            return
        if self._val_loader is None or self._val_loader.batch_size != batch_size:
            # One loader per run: persistent workers then serve every validation.
            self._val_loader = self._dataloader(self.data.val, batch_size=batch_size)
        yield from self._val_loader

    def _val_shares(self, batch_size: int, rank: int, world: int) -> Iterator[Any]:
        num_val = len(self.data.val_y) if self.in_memory else len(self.data.val)
        shares = [
            rank_share(chunk, batch_size, rank)
            for chunk in torch.arange(num_val).split(batch_size * world)
        ]
        if self.in_memory:
            x, y = self.data.val_x, self.data.val_y
            for idx, pad in shares:
                yield Padding((x[idx], y[idx])) if pad else (x[idx], y[idx])
            return
        if self._val_loader is None or self._val_loader.batch_size is not None:
            sampler = [idx.tolist() for idx, _ in shares]
            self._val_loader = self._dataloader(self.data.val, batch_sampler=sampler)
        for batch, (_, pad) in zip(self._val_loader, shares, strict=True):
            yield Padding(batch) if pad else batch

    def example(self, n: int) -> Any:
        """The first `n` training samples as one batch (host)."""
        if self.in_memory:
            return self.data.train_x[:n], self.data.train_y[:n]
        dataset = self.data.train
        collate = self.loader.collate_fn or default_collate
        return collate([dataset[i] for i in range(min(n, len(dataset)))])

    def shape_example(self) -> Any:
        """A batch of 2 training samples whose every dimension past the batch is at its
        largest among the first SHAPE_SAMPLES samples (collated together, so a collate
        function that pads pads to the longest): the structure memory is predicted from."""
        if self.in_memory:
            return self.example(2)
        batch = self.example(SHAPE_SAMPLES)
        n = batch_size_of(batch)
        return tree_map(
            lambda t: t[:2] if isinstance(t, torch.Tensor) and t.dim() and len(t) == n else t,
            batch,
        )

    def close(self) -> None:
        self._val_loader = None


def samples_planned(num_train: int, cfg: TrainerConfig) -> int:
    """Samples the run trains on, over all its devices."""
    steps_per_epoch, num_steps = steps_plan(num_train, cfg)
    full_epochs, rest_steps = divmod(num_steps, steps_per_epoch)
    return full_epochs * num_train + min(rest_steps * cfg.global_batch_size, num_train)
