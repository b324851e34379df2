"""How much of a step waits for data: an ImageFolder read with 0 and with N loader workers.

    python bench/loader.py                      # 0 vs 2 workers, 3 rounds, small_cnn
    python bench/loader.py --workers 4 --images 4000 --rounds 5
    python bench/loader.py -- model=resnet18 trainer.device=cuda   # extra Hydra overrides

Writes a folder of PNG images (two classes, 32x32) to a temporary directory and trains the
same configuration through `train.run.run` (the code of a trial) with `loader.num_workers`
0 and N, alternating which goes first each round. Per run it prints `time/data_wait_share`
(the share of timed training time spent waiting for the next micro-batches: PNG decoding,
augmentation, collation not hidden by workers) and samples/s. The verdict: workers lower the
median wait share (exit status 0), or they do not (1). Throughput is printed beside it; on a
machine with as many cores as workers plus one, the workers also compete with training.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from batchfit.tracking.metrics import DATA_WAIT_SHARE  # noqa: E402
from batchfit.train.plan import plan  # noqa: E402
from batchfit.train.run import run  # noqa: E402
from batchfit.train.workload import Workloads  # noqa: E402


def write_images(root: Path, per_class: int, size: int = 32) -> None:
    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", per_class), ("val", max(per_class // 8, 4))):
        for label in range(2):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8)
                pixels[..., label * 2] = pixels[..., label * 2] // 2 + 128  # a colour cast
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=2000, help="training images in all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        initialize_config_dir(str(REPO / "conf"), version_base="1.3"),
    ):
        root = Path(tmp)
        write_images(root, args.images // 2)
        base = [
            "data=imagefolder",
            f"data.train.root={root}/train",
            f"data.val.root={root}/val",
            "model=small_cnn",
            "trainer.batch_size=64",
            "trainer.max_epochs=1",
            *args.overrides,
        ]
        shares: dict[int, list[float]] = {0: [], args.workers: []}
        speeds: dict[int, list[float]] = {0: [], args.workers: []}
        workloads = Workloads()  # the images are listed once, for every round
        print(f"{args.images} PNG images 32x32, RandomResizedCrop + flip; {' '.join(base[3:])}")
        for i in range(args.rounds):
            order = [0, args.workers] if i % 2 == 0 else [args.workers, 0]
            for workers in order:
                cfg = compose("config", overrides=[*base, f"loader.num_workers={workers}"])
                result = run(cfg, plan(cfg, None), None, workloads.of(cfg))
                share = result.metrics()[DATA_WAIT_SHARE]
                shares[workers].append(share)
                speeds[workers].append(result.throughput_samples_per_sec)
                print(
                    f"round {i + 1}  workers={workers}  data wait {share:6.1%}  "
                    f"{result.throughput_samples_per_sec:7.0f} samples/s  "
                    f"val acc {result.val_acc:.3f}"
                )
    none, some = statistics.median(shares[0]), statistics.median(shares[args.workers])
    speed0 = statistics.median(speeds[0])
    speed_n = statistics.median(speeds[args.workers])
    print(
        f"median data wait: {none:.1%} with 0 workers, {some:.1%} with {args.workers}; "
        f"throughput {speed_n / speed0:.2f}x ({speed0:.0f} -> {speed_n:.0f} samples/s)"
    )
    ok = some < none
    print("verdict:", "workers hide the loading" if ok else "workers did not lower the wait")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
