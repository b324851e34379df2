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

A torchvision ImageFolder reads its images only as the DataLoader asks for them, so an empty
or damaged file would stop a run mid-epoch; `Datasets` opens every image's header when it is
built, and refuses the folder, naming each such file, before anything trains.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from batchfit.common.checks import number_problems

OFFLINE_HINT = "offline alternatives: data=digits (scikit-learn's bundled digits) or data=synthetic"
MAX_FILES_SHOWN = 5  # unreadable images named in the message; the rest are counted
JPEG_END = b"\xff\xd9"  # the end-of-image marker a complete JPEG closes with


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

    Images of a torchvision ImageFolder (any DatasetFolder read by PIL) are checked as it is
    built: a ValueError names every file PIL cannot open (empty, not an image, damaged), and
    the key of its folder. `check_images=False` skips the check (0.05-0.3 ms a file from a
    warm cache, more from a slow disk); damage only decoding finds (a truncated GIF or BMP)
    still names its file and key, as the DataLoader reads it.

    In a data config:
        _target_: batchfit.Datasets
        train: {_target_: torchvision.datasets.ImageFolder, root: ..., transform: ...}
        val: {_target_: torchvision.datasets.ImageFolder, root: ..., transform: ...}
    """

    def __init__(self, train: Dataset, val: Dataset, *, check_images: bool = True, **info: Any):
        for name, dataset in (("train", train), ("val", val)):
            if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
                raise TypeError(
                    f"data.{name} must be a map-style torch Dataset (with __getitem__ and "
                    f"__len__), got {type(dataset).__name__}"
                )
            if len(dataset) == 0:
                raise ValueError(f"data.{name} ({type(dataset).__name__}) is empty")
        folders = _image_folders({"train": train, "val": val})
        if check_images and (problems := _unreadable_folders(folders)):
            raise ValueError("; ".join(problems))
        for key, dataset in folders:
            if not isinstance(dataset.loader, _NamedImageErrors):  # one dataset given as both
                dataset.loader = _NamedImageErrors(dataset.loader, key, str(dataset.root))
        self.train, self.val = train, val
        if "num_classes" not in info and hasattr(train, "classes"):
            info["num_classes"] = len(train.classes)
        self.info = info


def _image_folders(datasets: dict[str, Dataset]) -> list[tuple[str, Any]]:
    """(key of its folder, dataset) of each torchvision DatasetFolder among `datasets` that
    reads its files with PIL (ImageFolder's default loader)."""
    folder = sys.modules.get("torchvision.datasets.folder")
    if folder is None:  # torchvision not imported: none of them is an ImageFolder
        return []
    found = []
    for name, dataset in datasets.items():
        if not isinstance(dataset, folder.DatasetFolder):
            continue
        loader = dataset.loader
        loader = loader.loader if isinstance(loader, _NamedImageErrors) else loader
        if loader in (folder.default_loader, folder.pil_loader):
            found.append((f"data.{name}.root", dataset))
    return found


def _unreadable_folders(folders: list[tuple[str, Any]]) -> list[str]:
    """One problem per folder holding files PIL cannot open (a folder given by both keys is
    read once)."""
    keys: dict[str, list[str]] = {}
    paths: dict[str, dict[str, None]] = {}  # ordered sets
    for key, dataset in folders:
        keys.setdefault(str(dataset.root), []).append(key)
        paths.setdefault(str(dataset.root), {}).update(dict.fromkeys(p for p, _ in dataset.samples))
    problems = []
    for root, files in paths.items():
        bad = [(path, why) for path in files if (why := _unreadable_image(path))]
        if bad:
            problems.append(_unreadable_problem(keys[root], root, bad, len(files)))
    return problems


def _unreadable_problem(
    keys: list[str], root: str, bad: list[tuple[str, str]], num_files: int
) -> str:
    """The key, the first files with why, how many, what batchfit did and the fix."""
    given = f"{keys[0]}={root!r}" if len(keys) == 1 else f"{' and '.join(keys)} (both {root!r})"
    shown = ", ".join(f"{path} ({why})" for path, why in bad[:MAX_FILES_SHOWN])
    more = f", and {len(bad) - MAX_FILES_SHOWN} more" if len(bad) > MAX_FILES_SHOWN else ""
    them = "it" if len(bad) == 1 else "them"
    return (
        f"{given}: {len(bad)} of the {num_files} files ImageFolder found there cannot be "
        f"opened as images: {shown}{more}; nothing was trained: remove or replace {them}, "
        f"or move {them} out of {root}"
    )


def _unreadable_image(path: str) -> str | None:
    """Why PIL cannot open the image at `path`, or None when it can. Image.open reads the
    header and verify() the structure (a PNG's chunk checksums) without decoding pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        if os.path.getsize(path) == 0:
            return "empty, 0 bytes"
        with Image.open(path) as image:
            image.verify()
        if image.format == "JPEG" and not _ends_with(path, JPEG_END):
            # verify() reads only a JPEG's header: one cut short (a download stopped) shows
            # only when decoded, so one without its end marker is decoded to be sure.
            with Image.open(path) as image:
                image.load()
    except UnidentifiedImageError:
        return "not an image PIL can identify"
    except OSError as error:  # unreadable, or damaged (e.g. 'Truncated File Read')
        return error.strerror or str(error)
    except Exception as error:  # noqa: BLE001 - whatever a damaged file makes a decoder raise
        return f"{type(error).__name__}: {error}"
    return None


def _ends_with(path: str, tail: bytes) -> bool:
    with open(path, "rb") as file:
        file.seek(-len(tail), os.SEEK_END)
        return file.read() == tail


class _NamedImageErrors:
    """An ImageFolder's loader whose errors name the file and the key of its folder: damage
    verify() cannot see (a truncated GIF or BMP) shows only as the DataLoader decodes it, and
    PIL says "image file is truncated" without saying which file."""

    def __init__(self, loader: Callable[[str], Any], key: str, root: str):
        self.loader, self.key, self.root = loader, key, root

    def __call__(self, path: str) -> Any:
        try:
            return self.loader(path)
        except OSError as error:
            raise OSError(
                f"{path} cannot be read as an image ({error}); remove or replace it, or move "
                f"it out of {self.key}={self.root!r}"
            ) from error


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
