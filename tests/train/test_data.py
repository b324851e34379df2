"""Datasets: digits, synthetic, the fixed-seed split, and CIFAR-10 from its real on-disk format."""

from __future__ import annotations

import hashlib
import pickle
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.datasets import CIFAR10

from batchfit.train.data import OFFLINE_HINT, Splits, cifar10, digits, split, synthetic

# --------------------------------------------------------------------------- split


def test_split_partitions_with_a_fixed_seed():
    x = torch.arange(50, dtype=torch.float32).view(50, 1, 1, 1)
    y = torch.arange(50) % 5
    parts = split(x, y, val_fraction=0.2, seed=3, num_classes=5)
    assert isinstance(parts, Splits)
    assert (len(parts.train_y), len(parts.val_y)) == (40, 10)
    ids = torch.cat([parts.train_x, parts.val_x]).flatten().long()
    assert sorted(ids.tolist()) == list(range(50))  # disjoint and complete
    # Labels travel with their samples.
    assert torch.equal(parts.train_y, parts.train_x.flatten().long() % 5)
    assert torch.equal(parts.val_y, parts.val_x.flatten().long() % 5)
    assert parts.num_classes == 5 and parts.in_channels == 1
    # Shuffled, and the same seed gives the same split.
    assert not torch.equal(parts.val_x.flatten(), torch.arange(10, dtype=torch.float32))
    again = split(x, y, val_fraction=0.2, seed=3, num_classes=5)
    assert torch.equal(again.val_x, parts.val_x)
    other = split(x, y, val_fraction=0.2, seed=4, num_classes=5)
    assert not torch.equal(other.val_x, parts.val_x)


def test_split_holds_out_at_least_one_sample():
    x, y = torch.zeros(5, 1, 1, 1), torch.zeros(5, dtype=torch.int64)
    parts = split(x, y, val_fraction=0.01, seed=0, num_classes=1)
    assert (len(parts.train_y), len(parts.val_y)) == (4, 1)


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5])
def test_split_rejects_bad_fractions(fraction):
    x, y = torch.zeros(5, 1, 1, 1), torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"data.val_fraction must be in \(0, 1\)"):
        split(x, y, fraction, 0, 1)


# --------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_default() -> Splits:
    return digits()


def test_digits_shapes(digits_default):
    data = digits_default
    assert data.num_classes == 10
    assert data.in_channels == 1
    # 1,797 images, 20% (359) held out.
    assert data.train_x.shape == (1438, 1, 8, 8)
    assert data.val_x.shape == (359, 1, 8, 8)
    assert data.train_y.shape == (1438,) and data.val_y.shape == (359,)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert set(data.train_y.tolist()) == set(range(10))
    assert set(data.val_y.tolist()) <= set(range(10))
    # Standardised over the whole set.
    everything = torch.cat([data.train_x, data.val_x])
    assert everything.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert everything.std().item() == pytest.approx(1.0, abs=1e-3)


def test_digits_split_follows_the_seed(digits_default):
    same = digits(seed=0)
    assert torch.equal(same.val_x, digits_default.val_x)
    assert torch.equal(same.val_y, digits_default.val_y)
    other = digits(seed=1)
    assert not torch.equal(other.val_y, digits_default.val_y)
    # A different split of the same images: the union is unchanged.
    assert torch.equal(
        torch.cat([other.train_y, other.val_y]).sort().values,
        torch.cat([digits_default.train_y, digits_default.val_y]).sort().values,
    )
    smaller = digits(val_fraction=0.5)
    assert (len(smaller.train_y), len(smaller.val_y)) == (899, 898)


# --------------------------------------------------------------------------- synthetic


def test_synthetic_shapes_and_determinism():
    data = synthetic(num_samples=100, num_classes=7, channels=2, image_size=5, seed=1)
    assert data.train_x.shape == (80, 2, 5, 5) and data.val_x.shape == (20, 2, 5, 5)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert data.num_classes == 7 and data.in_channels == 2
    assert data.train_y.min() >= 0 and data.train_y.max() < 7
    again = synthetic(num_samples=100, num_classes=7, channels=2, image_size=5, seed=1)
    assert torch.equal(again.train_x, data.train_x) and torch.equal(again.val_y, data.val_y)
    other = synthetic(num_samples=100, num_classes=7, channels=2, image_size=5, seed=2)
    assert not torch.equal(other.train_x, data.train_x)


def test_synthetic_is_learnable():
    data = synthetic(num_samples=600, num_classes=5, channels=3, image_size=4, noise=1.0, seed=0)
    flat_train = data.train_x.flatten(1)
    means = torch.stack([flat_train[data.train_y == k].mean(0) for k in range(5)])
    # Class templates are distinct: far apart compared with the per-sample noise.
    gaps = torch.cdist(means, means) + torch.eye(5) * 1e9
    assert gaps.min().item() > 2.0
    # A nearest-class-mean classifier fitted on train is near perfect on val.
    predicted = torch.cdist(data.val_x.flatten(1), means).argmin(1)
    accuracy = (predicted == data.val_y).float().mean().item()
    assert accuracy > 0.9
    # With pure noise the same classifier is at chance.
    noise_only = synthetic(num_samples=600, num_classes=5, channels=3, image_size=4,
                           noise=1e6, seed=0)  # fmt: skip
    flat = noise_only.train_x.flatten(1)
    noisy_means = torch.stack([flat[noise_only.train_y == k].mean(0) for k in range(5)])
    predicted = torch.cdist(noise_only.val_x.flatten(1), noisy_means).argmin(1)
    assert (predicted == noise_only.val_y).float().mean().item() < 0.5


# --------------------------------------------------------------------------- cifar10

PER_BATCH = 6  # images per fake batch file: 30 training images, 6 test images


def _write_cifar(root: Path, with_meta: bool = True) -> dict[str, np.ndarray]:
    """A tiny archive in CIFAR-10's python format: cifar-10-batches-py/ with data_batch_1..5,
    test_batch and batches.meta, each a pickled dict (keys as torchvision reads them with
    encoding='latin1': 'data' uint8 (N, 3072) in R, G, B planes of 32x32, 'labels' a list)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for index, name in enumerate(names):
        data = rng.integers(0, 256, size=(PER_BATCH, 3072), dtype=np.uint8)
        labels = [(index + k) % 10 for k in range(PER_BATCH)]
        if name == "test_batch":
            labels = [9] * PER_BATCH
        entry = {
            "batch_label": f"fake {name}",
            "labels": labels,
            "data": data,
            "filenames": [f"{name}_{k}.png" for k in range(PER_BATCH)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        written[name] = (data, labels)
    if with_meta:
        meta = {
            "num_cases_per_batch": PER_BATCH,
            "label_names": ["airplane", "automobile", "bird", "cat", "deer",
                            "dog", "frog", "horse", "ship", "truck"],
            "num_vis": 3072,
        }  # fmt: skip
        with open(folder / "batches.meta", "wb") as f:
            pickle.dump(meta, f, protocol=2)
    return written


def _expected_splits(written, val_fraction: float, seed: int, max_samples=None) -> Splits:
    """What cifar10() must return, computed independently from the raw arrays."""
    raw = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    x = torch.from_numpy(raw).float().div(255).view(-1, 3, 32, 32)  # planes are channels
    y = torch.tensor(labels, dtype=torch.int64)
    if max_samples is not None:
        x, y = x[:max_samples], y[:max_samples]
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True)
    return split((x - mean) / std, y, val_fraction, seed, num_classes=10)


@pytest.fixture
def cifar_root(tmp_path, monkeypatch):
    """A fake archive whose batches.meta checksum torchvision accepts.

    torchvision's CIFAR10._load_meta checks the md5 of batches.meta unconditionally (see
    test_cifar10_without_checksums_loads_any_batches_meta), so the known checksum is pointed
    at this file; everything else goes through the real code path."""
    written = _write_cifar(tmp_path)
    meta = tmp_path / "cifar-10-batches-py" / "batches.meta"
    monkeypatch.setitem(CIFAR10.meta, "md5", hashlib.md5(meta.read_bytes()).hexdigest())
    return tmp_path, written


def test_cifar10_loads_the_python_format(cifar_root):
    root, written = cifar_root
    data = cifar10(root=str(root), download=False, verify_checksums=False, val_fraction=0.1)
    total = 5 * PER_BATCH  # the test batch is left out
    assert data.num_classes == 10 and data.in_channels == 3
    assert data.train_x.shape == (total - 3, 3, 32, 32)
    assert data.val_x.shape == (3, 3, 32, 32)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    # Label 9 appears once in the training batches, six times in the (excluded) test batch.
    assert ((data.train_y == 9).sum() + (data.val_y == 9).sum()).item() == 1
    expected = _expected_splits(written, 0.1, 0)
    # Same samples, labels, channel layout (NCHW from the R, G, B planes) and normalisation.
    torch.testing.assert_close(data.train_x, expected.train_x, rtol=0, atol=1e-5)
    torch.testing.assert_close(data.val_x, expected.val_x, rtol=0, atol=1e-5)
    assert torch.equal(data.train_y, expected.train_y)
    assert torch.equal(data.val_y, expected.val_y)


def test_cifar10_max_samples_and_seed(cifar_root):
    root, written = cifar_root
    data = cifar10(root=str(root), download=False, verify_checksums=False, max_samples=10,
                   val_fraction=0.2, seed=5)  # fmt: skip
    assert (len(data.train_y), len(data.val_y)) == (8, 2)
    expected = _expected_splits(written, 0.2, 5, max_samples=10)
    torch.testing.assert_close(data.val_x, expected.val_x, rtol=0, atol=1e-5)
    assert torch.equal(data.train_y, expected.train_y)


def test_cifar10_checksums_reject_a_fake_archive(cifar_root):
    root, _ = cifar_root
    with pytest.raises(FileNotFoundError, match="data.root=") as info:
        cifar10(root=str(root), download=False, verify_checksums=True)
    assert str(root) in str(info.value)


def test_cifar10_without_checksums_loads_any_batches_meta(tmp_path):
    _write_cifar(tmp_path)
    data = cifar10(root=str(tmp_path), download=False, verify_checksums=False)
    assert data.train_x.shape[1:] == (3, 32, 32)


def test_cifar10_missing_batches_meta_is_reported_as_missing(tmp_path):
    _write_cifar(tmp_path, with_meta=False)
    with pytest.raises(FileNotFoundError, match="data.root="):
        cifar10(root=str(tmp_path), download=False, verify_checksums=False)


def _assert_offline_hint(message: str, root: Path) -> None:
    assert f"data.root={str(root)!r}" in message
    assert "data=digits" in message and "data=synthetic" in message
    assert OFFLINE_HINT in message


@pytest.mark.parametrize("verify", [True, False])
def test_cifar10_missing_without_download(tmp_path, verify):
    root = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="data.download=false") as info:
        cifar10(root=str(root), download=False, verify_checksums=verify)
    _assert_offline_hint(str(info.value), root)
    assert not root.exists()  # nothing was attempted


def test_cifar10_download_without_network_fails_fast(tmp_path, monkeypatch):
    # No name resolution, as on an offline machine (the mirror's host cannot be looked up).
    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    previous_timeout = socket.getdefaulttimeout()
    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match="could not be downloaded") as info:
        cifar10(root=str(tmp_path), download=True)
    assert time.monotonic() - started < 15
    _assert_offline_hint(str(info.value), tmp_path)
    assert "URLError" in str(info.value)
    assert socket.getdefaulttimeout() == previous_timeout  # the global timeout is restored


@pytest.mark.slow
def test_cifar10_download_from_an_unreachable_mirror_times_out(tmp_path, monkeypatch):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never routed, so a connection either fails at once
    # or hangs until download_timeout_s; either way the run must fail within seconds.
    monkeypatch.setattr(CIFAR10, "url", "http://192.0.2.1/cifar-10-python.tar.gz")
    previous_timeout = socket.getdefaulttimeout()
    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match="could not be downloaded") as info:
        cifar10(root=str(tmp_path), download=True, download_timeout_s=1.0)
    assert time.monotonic() - started < 15
    _assert_offline_hint(str(info.value), tmp_path)
    assert socket.getdefaulttimeout() == previous_timeout
