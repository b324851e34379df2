"""An ImageFolder holding files PIL cannot open (empty, random bytes named .png or .jpg, a
JPEG cut short) is refused as its data is built, naming each file and the key of its folder,
instead of a 57-line traceback ending in PIL.UnidentifiedImageError when the DataLoader first
reads one. Real files, written here."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.transforms import ToTensor

from batchfit.common.checks import ConfigError
from batchfit.train.build import build_data
from batchfit.train.data import MAX_FILES_SHOWN, Datasets
from tests.sweeps import run_module

ENTRY_POINTS = ["search", "search.fit", "train"]


def _images(folder: Path, num_images: int, suffix: str = "png") -> list[Path]:
    """`num_images` real 8x8 RGB images in two class folders, cat/ and dog/."""
    paths = []
    for i in range(num_images):
        path = folder / ("cat", "dog")[i % 2] / f"{i}.{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (30 * i % 256, 90, 200)).save(path)
        paths.append(path)
    return paths


def _jpeg_bytes() -> bytes:
    noise = torch.randint(0, 256, (48, 48, 3), generator=torch.Generator().manual_seed(0))
    out = io.BytesIO()
    Image.fromarray(noise.to(torch.uint8).numpy()).save(out, "JPEG")
    return out.getvalue()


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A folder of 8 good PNGs, a 0-byte cat/empty.png and random bytes as dog/junk.jpg."""
    root = tmp_path / "images"
    _images(root, 8)
    empty, junk = root / "cat" / "empty.png", root / "dog" / "junk.jpg"
    empty.write_bytes(b"")
    junk.write_bytes(os.urandom(512))
    return root, empty, junk


def _imagefolder(train: Path, val: Path) -> list[str]:
    return [
        "model=small_cnn",
        "model.width=4",
        "data=imagefolder",
        f"data.train.root={train}",
        f"data.val.root={val}",
    ]


def test_building_the_data_names_each_unreadable_file_and_the_key(hydra_conf, damaged) -> None:
    root, empty, junk = damaged
    with pytest.raises(ConfigError) as raised:
        build_data(hydra_conf(_imagefolder(root, root)))
    [problem] = raised.value.problems
    assert f"data.train.root and data.val.root (both {str(root)!r})" in problem
    assert "2 of the 10 files ImageFolder found there cannot be opened as images" in problem
    assert f"{empty} (empty, 0 bytes)" in problem
    assert f"{junk} (not an image PIL can identify)" in problem
    assert "0.png" not in problem  # the good ones are not named
    assert problem.endswith(f"remove or replace them, or move them out of {root}")
    assert "\n" not in problem


def test_only_the_folder_holding_them_is_named(hydra_conf, damaged, tmp_path: Path) -> None:
    root, empty, _ = damaged
    train = tmp_path / "train"
    _images(train, 4)
    with pytest.raises(ConfigError) as raised:
        build_data(hydra_conf(_imagefolder(train, root)))
    [problem] = raised.value.problems
    assert f"data.val.root={str(root)!r}: 2 of the 10 files" in problem
    assert "data.train.root" not in problem and str(train) not in problem
    assert str(empty) in problem


def test_many_unreadable_files_are_counted_beyond_the_first_few(tmp_path: Path) -> None:
    _images(tmp_path, 2)
    for i in range(MAX_FILES_SHOWN + 3):
        (tmp_path / "cat" / f"bad{i}.png").write_bytes(b"")
    with pytest.raises(ValueError, match=r"data.val.root \(both .*\): 8 of the 10 files") as raised:
        Datasets(ImageFolder(str(tmp_path)), ImageFolder(str(tmp_path)))
    message = str(raised.value)
    assert message.count("(empty, 0 bytes)") == MAX_FILES_SHOWN
    assert "(empty, 0 bytes), and 3 more; nothing was trained" in message


def test_a_jpeg_cut_short_is_found_and_whole_ones_are_not(tmp_path: Path) -> None:
    """verify() reads only a JPEG's header: a download stopped halfway passes it and failed
    only when the DataLoader decoded it. A JPEG with bytes after its end marker is whole."""
    _images(tmp_path, 4, suffix="jpg")
    whole = _jpeg_bytes()
    (tmp_path / "dog" / "trailing.jpg").write_bytes(whole + b"\x00" * 16)
    Datasets(ImageFolder(str(tmp_path)), ImageFolder(str(tmp_path)))  # all readable
    cut = tmp_path / "dog" / "cut.jpg"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError) as raised:
        Datasets(ImageFolder(str(tmp_path)), ImageFolder(str(tmp_path)))
    assert f"1 of the 6 files ImageFolder found there cannot be opened as images: {cut} (" in (
        str(raised.value)
    )
    assert "truncated" in str(raised.value)
    assert str(raised.value).endswith(f"remove or replace it, or move it out of {tmp_path}")


def test_unchecked_a_damaged_file_is_named_when_the_dataloader_reads_it(damaged) -> None:
    """check_images=False (a folder too large to check at each start): the error of the
    DataLoader's worker still names the file and the key, which PIL's does not."""
    root, empty, _ = damaged
    train = ImageFolder(str(root), transform=ToTensor())
    Datasets(train, ImageFolder(str(root)), check_images=False)
    index = [path for path, _ in train.samples].index(str(empty))
    assert train[0][0].shape == (3, 8, 8)  # the good ones read as before
    with pytest.raises(OSError, match="cannot identify image file") as raised:
        train[index]
    assert str(raised.value).startswith(f"{empty} cannot be read as an image")
    assert str(raised.value).endswith(f"move it out of data.train.root={str(root)!r}")
    one = torch.utils.data.Subset(train, [index])
    with pytest.raises(OSError, match=f"{empty} cannot be read as an image"):
        next(iter(torch.utils.data.DataLoader(one, num_workers=1)))


def test_other_datasets_are_not_checked(tmp_path: Path) -> None:
    """A DatasetFolder with a loader of its own (not PIL's) reads files PIL cannot open."""
    from torchvision.datasets import DatasetFolder

    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "0.npy").write_bytes(b"not an image")
    folder = DatasetFolder(str(tmp_path), loader=Path.read_bytes, extensions=(".npy",))
    assert Datasets(folder, folder).train is folder


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_an_unreadable_image_stops_the_command_in_one_line(
    tmp_path: Path, damaged, module: str
) -> None:
    """`python -m train ... data=imagefolder` ended in a 57-line traceback; now one message,
    exit status 2, before anything trains or is recorded."""
    root, empty, junk = damaged
    args = [*_imagefolder(root, root), "trainer.max_epochs=1", "search.n_trials=1"]
    done = run_module(module, args, tmp_path, returncode=2)
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "Error executing job" not in output, output
    assert not (tmp_path / "mlruns" / "mlflow.db").exists()
    [line] = [line for line in done.stderr.splitlines() if str(empty) in line]
    assert "data.train.root and data.val.root" in line and str(junk) in line
    assert "Configuration error" in done.stderr
