"""What a data config builds: in-memory `Splits`, or `Datasets` read through a DataLoader.

`Splits` are four tensors with a fixed-seed train/val split, the fast path of the bundled
sets (digits, synthetic, CIFAR-10): the loop gathers each micro-batch by index on the host.
`Datasets` are any two map-style torch Datasets (torchvision's ImageFolder, a user's own,
samples that are tuples or dicts of any shape), read through a DataLoader configured by
`loader.*` (train/batches.py). Either way batches stay on the host and the loop copies one
micro-batch at a time to the device, so the copy is part of the measured step time and the
dataset does not count against the device-memory budget.

Both carry `info`: what the model builder may ask for by name (`num_classes`,
`in_channels`, `vocab_size`, ...); a builder receives the names its signature takes.
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from batchfit.common.checks import number_problems

OFFLINE_HINT = "offline alternatives: data=digits (scikit-learn's bundled digits) or data=synthetic"


@dataclass(frozen=True)
class Splits:
    train_x: torch.Tensor  # (N, C, H, W) float32, normalised
    train_y: torch.Tensor  # (N,) int64
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    @property
    def info(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "in_channels": self.in_channels}


class Datasets:
    """A training and a validation map-style Dataset, read through a DataLoader. `info` is
    passed to the model builder where its signature asks for it; `num_classes` is taken
    from the training set's `classes` (as torchvision's datasets have) when not given.

    In a data config:
        _target_: batchfit.Datasets
        train: {_target_: torchvision.datasets.ImageFolder, root: ..., transform: ...}
        val: {_target_: torchvision.datasets.ImageFolder, root: ..., transform: ...}
    """

    def __init__(self, train: Dataset, val: Dataset, **info: Any):
        for name, dataset in (("train", train), ("val", val)):
            if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
                raise TypeError(
                    f"data.{name} must be a map-style torch Dataset (with __getitem__ and "
                    f"__len__), got {type(dataset).__name__}"
                )
            if len(dataset) == 0:
                raise ValueError(f"data.{name} ({type(dataset).__name__}) is empty")
        self.train, self.val = train, val
        if "num_classes" not in info and hasattr(train, "classes"):
            info["num_classes"] = len(train.classes)
        self.info = info


def split(x: torch.Tensor, y: torch.Tensor, val_fraction: float, seed: int, num_classes: int):
    """Shuffle with a fixed seed and hold out `val_fraction` of the samples for validation."""
    if problems := number_problems(
        "data.val_fraction", val_fraction, "in (0, 1)", above=0, below=1, fix=0.2
    ):
        raise ValueError(problems[0])
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    num_val = max(1, int(len(x) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    return Splits(x[train], y[train], x[val], y[val], num_classes)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    # Per-channel standardisation over the whole set: (N, C, H, W) -> same shape.
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return ((x - mean) / std).contiguous()


def digits(val_fraction: float = 0.2, seed: int = 0) -> Splits:
    """scikit-learn's 1,797 handwritten 8x8 digits: real data that is always offline."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)  # (N, 8, 8) -> (N, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    return split(_normalise(x), y, val_fraction, seed, num_classes=10)


def synthetic(
    num_samples: int = 4096,
    num_classes: int = 10,
    channels: int = 3,
    image_size: int = 32,
    noise: float = 1.0,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Splits:
    """Learnable class-dependent images of any shape: a fixed random template per class plus
    Gaussian noise, so accuracy rises with training while the shape stays realistic."""
    gen = torch.Generator().manual_seed(seed)
    templates = torch.randn(num_classes, channels, image_size, image_size, generator=gen)
    y = torch.randint(0, num_classes, (num_samples,), generator=gen)
    x = templates[y] + noise * torch.randn(
        num_samples, channels, image_size, image_size, generator=gen
    )
    return split(x, y, val_fraction, seed, num_classes)


def cifar10(
    root: str = "data",
    download: bool = True,
    val_fraction: float = 0.1,
    seed: int = 0,
    max_samples: int | None = None,
    verify_checksums: bool = True,
    download_timeout_s: float = 10.0,
) -> Splits:
    """CIFAR-10's 50,000 training images through torchvision's loader (validation is held
    out of them; the test set stays untouched). Downloads into `root` when it is missing."""
    dataset = _load_cifar10(Path(root), download, verify_checksums, download_timeout_s)
    x = torch.from_numpy(np.ascontiguousarray(dataset.data)).permute(0, 3, 1, 2)  # NHWC -> NCHW
    y = torch.tensor(dataset.targets, dtype=torch.int64)
    if max_samples is not None:
        x, y = x[:max_samples], y[:max_samples]
    return split(_normalise(x.float() / 255), y, val_fraction, seed, num_classes=10)


def _cifar10_present(root: Path, verify_checksums: bool) -> bool:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    folder = root / CIFAR10.base_folder
    files = (
        CIFAR10.train_list + CIFAR10.test_list + [(CIFAR10.meta["filename"], CIFAR10.meta["md5"])]
    )
    for name, md5 in files:
        path = folder / name
        if not (check_integrity(str(path), md5) if verify_checksums else path.is_file()):
            return False
    return True


def _load_cifar10(root: Path, download: bool, verify_checksums: bool, timeout_s: float):
    from torchvision.datasets import CIFAR10

    class Cifar10(CIFAR10):
        def _check_integrity(self) -> bool:
            return _cifar10_present(Path(self.root), verify_checksums)

        def _load_meta(self) -> None:
            # torchvision checks the meta file's md5 even when integrity checks are off.
            path = Path(self.root) / self.base_folder / self.meta["filename"]
            with path.open("rb") as infile:
                self.classes = pickle.load(infile, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    if _cifar10_present(root, verify_checksums):
        return Cifar10(str(root), train=True, download=False)
    if not download:
        raise FileNotFoundError(
            f"CIFAR-10 is not in data.root={str(root)!r} and data.download=false; put the "
            f"'cifar-10-batches-py' folder there, set data.download=true, or use the "
            f"{OFFLINE_HINT}"
        )
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)  # an unreachable mirror must fail in seconds, not hang
    try:
        return Cifar10(str(root), train=True, download=True)
    except (OSError, RuntimeError) as error:
        raise FileNotFoundError(
            f"CIFAR-10 is not in data.root={str(root)!r} and could not be downloaded "
            f"({type(error).__name__}: {error}); copy the 'cifar-10-batches-py' folder into "
            f"data.root, or use the {OFFLINE_HINT}"
        ) from None
    finally:
        socket.setdefaulttimeout(previous)
