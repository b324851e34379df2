"""Does cuDNN honour CUDNN_CONV_WSCAP_DBG on PyTorch's cuDNN v8/v9 path? Each convolution call of
small_cnn and resnet18 (32 px, a training step's forward, backward-data and backward-filter
calls, fp32 and bf16), run alone on the card and its workspace read from the caching allocator's
history (MeasureOnDevice, batchfit/train/device/cudnn_workspaces.py), in a fresh process per way
the cap is given:

- `unset`: no CUDNN_CONV_WSCAP_DBG (the heuristics' own first choice);
- `64` and `8`: exported before torch is imported (cuDNN reads its environment);
- `after`: unset at start, 8 exported after the process's first convolution (is it read once?).

The cap's only documentation is cuDNN 8.0.5's release note, about the legacy
cudnnGetConvolution*WorkspaceSize calls; neither PyTorch's Conv_v8.cpp nor cudnn-frontend reads
it. What batchfit rests on it: with room, a planned card's convolution counts its workspace at
the cap (`cudnn_workspace_mib`); what fits does not (a workspace gives way: ElasticKey). The
engine of each call is read from cudnn-frontend's log where it prints one
(CUDNN_FRONTEND_LOG_INFO; `eng<N>` plan tags).

With the cap unset, each cuDNN batch norm of those steps (contiguous input: cuDNN's SPATIAL
mode; channels-last: SPATIAL_PERSISTENT) is run too: its forward workspace, its reserve and
its backward workspace, which a planned card counts as none for SPATIAL (an inference) and
does not know for SPATIAL_PERSISTENT.

Verdict: HONOURED when every call's workspace is within 64 MiB and 8 MiB under those caps
and no SPATIAL batch norm needs a buffer (exit 0); NOT HONOURED otherwise (exit 1: the fit
report's "a bound where cuDNN honours it", or its batch norms' none, does not hold on this
card, so the reserve with room of a planned card is an estimate). With
`--device cpu` the same processes run on the CPU (its convolutions' temporaries, from the
tracker): a dry run of the script, no cuDNN figure.

    python bench/gpu/conv_cap.py                  # on a GPU
    python bench/gpu/conv_cap.py --device cpu     # the dry run
    python bench/gpu/conv_cap.py --device cpu --models small_cnn --batch 2   # its quick mode
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WSCAP = "CUDNN_CONV_WSCAP_DBG"
MODES = ("unset", "64", "8", "after")
MiB = 2**20
_ENGINE = re.compile(r"\beng(\d+)(?:_k\d+=\d+)*")


def signatures(
    batch: int, image: int, models: list[str]
) -> tuple[list[tuple[str, str, tuple]], list[tuple[str, str, tuple]]]:
    """(model, precision, signature) of every cuDNN convolution call of a training step of
    small_cnn and resnet18 at `batch` x 3 x image x image, fp32 and bf16 (autocast), on fake
    tensors, as a predicted CUDA step makes them (conv_composites); and of its cuDNN batch
    norms (norm_composites: fp32 only, bf16's run on ATen's kernels), contiguous and
    channels-last (cuDNN's SPATIAL and SPATIAL_PERSISTENT modes)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from batchfit.train.device.cudnn_workspaces import CudnnWorkspaces
    from batchfit.train.measure.memory import TensorMemoryTracker
    from batchfit.train.memory.cudnn import conv_composites, norm_composites
    from batchfit.train.models import resnet18, small_cnn

    convs: list[tuple[str, str, tuple]] = []
    norms: list[tuple[str, str, tuple]] = []
    for name, build in (("small_cnn", small_cnn), ("resnet18", resnet18)):
        if name not in models:
            continue
        for precision, layout in (("fp32", torch.contiguous_format), ("bf16", None),
                                  ("fp32", torch.channels_last)):  # fmt: skip
            calls: dict = {}
            met: dict = {}
            workspaces = CudnnWorkspaces(cap_bytes=None)
            composites = conv_composites(workspaces, calls) | norm_composites(workspaces, met)
            form = layout or torch.contiguous_format  # the input's: the layers' outputs follow
            with FakeTensorMode():
                model = build(num_classes=10)
                x = torch.empty(batch, 3, image, image).to(memory_format=form)
                tracker = TensorMemoryTracker(composites=composites)
                with tracker, torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                    model(x).float().sum().backward()
            if layout is not torch.channels_last:
                convs += [(name, precision, s) for s in calls if (name, precision, s) not in convs]
            norms += [(name, precision, s) for s in met if (name, precision, s) not in norms]
    return convs, norms


def measure(
    mode: str, device: str, items: list[tuple[str, str, tuple]], norms: list, log: Path
) -> dict:
    """In this process (the environment set for `mode` before torch was imported): each
    call's workspace in bytes (None: out of memory alone) and the engine tag its plan has;
    with the cap unset, each batch norm's forward workspace, reserve and backward workspace
    (None: not measured)."""
    import torch

    from batchfit.train.device.cudnn_workspaces import MeasureOnDevice, operands, run_call
    from batchfit.train.measure.memory import TensorMemoryTracker

    results: list[dict] = []
    if device == "cuda":
        measurer = MeasureOnDevice(torch.device("cuda", torch.cuda.current_device()))
    for i, (_, _, signature) in enumerate(items):
        if mode == "after" and i == 1:  # the first convolution ran: now the cap
            os.environ[WSCAP] = "8"
        seen = log.stat().st_size if log.exists() else 0
        if device == "cuda":
            workspace = measurer(signature)
        else:  # a dry run: the CPU convolution's temporaries, as the tracker sees them
            x, w, grad = operands(signature, "cpu")
            tracker = TensorMemoryTracker()
            with tracker, torch.no_grad():
                out = run_call(signature, x, w, grad)
            kept = sum(t.untyped_storage().nbytes() for t in _tensors(out))
            workspace = max(0, tracker.peak_bytes - kept)
        engines = _ENGINE.findall(log.read_text(errors="replace")[seen:]) if log.exists() else []
        results.append({"workspace": workspace, "engine": f"eng{engines[-1]}" if engines else "-"})
    sizes = []
    if mode == "unset":
        sizes = [measurer.norm(s) if device == "cuda" else None for _, _, s in norms]
    return {"mode": mode, "results": results, "norms": sizes}


def _tensors(out: object) -> list:
    import torch

    items = out if isinstance(out, tuple | list) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _child(mode: str, device: str, signatures_file: Path, work: Path) -> dict:
    """A fresh process measuring every call with the cap given the `mode` way."""
    env = dict(os.environ)
    env.pop(WSCAP, None)
    if mode in ("64", "8"):
        env[WSCAP] = mode
    log = work / f"frontend-{mode}.log"
    env.update(CUDNN_FRONTEND_LOG_INFO="1", CUDNN_FRONTEND_LOG_FILE=str(log))
    command = [sys.executable, __file__, "--child", mode, "--device", device,
               "--signatures", str(signatures_file), "--log", str(log)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: int | None) -> str:
    return "OOM" if n is None else f"{n / MiB:.1f}"


def _shape(signature: tuple) -> str:
    kind, shape, weight = signature[0], signature[1], signature[3]
    short = {"forward": "fwd", "backward_data": "bwd-data", "backward_filter": "bwd-filter"}
    return f"{short[kind]} {'x'.join(map(str, shape))} w {'x'.join(map(str, weight))}"


def norm_report(norms: list, sizes: list, device: str) -> bool:
    """The batch norms' buffers as measured; False where a SPATIAL one (contiguous input)
    needs any: the off-card rule (none) does not hold."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title=f"cuDNN batch norm buffers (KiB), on {device}: forward workspace, "
                        "reserve, backward workspace")  # fmt: skip
    for column in ("model", "prec", "input", "mode", "forward", "reserve", "backward"):
        table.add_column(column, justify="right")
    spatial_needs = 0
    for (model, precision, signature), found in zip(norms, sizes, strict=True):
        persistent = signature[-1]
        cells = ["-"] * 3 if found is None else [f"{n / 1024:.1f}" for n in found]
        spatial_needs += not persistent and found is not None and any(found)
        mode = "SPATIAL_PERSISTENT" if persistent else "SPATIAL"
        table.add_row(model, precision, "x".join(map(str, signature[1])), mode, *cells)
    console.print(table)
    if device == "cuda":
        console.print(f"{spatial_needs} SPATIAL batch norms need a buffer (off the card none "
                      "is counted)")  # fmt: skip
    return spatial_needs == 0


def report(items: list, by_mode: dict, device: str) -> bool:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title=f"cuDNN workspace per call (MiB) by how {WSCAP} is given, on {device}")
    for column in ("model", "prec", "call", *MODES, "engines (unset / 64 / 8)"):
        table.add_column(column, justify="right" if column in MODES else "left")
    over = {"64": 0, "8": 0}
    same_after = True
    for i, (model, precision, signature) in enumerate(items):
        row = {m: by_mode[m]["results"][i] for m in MODES}
        for cap in over:
            ws = row[cap]["workspace"]
            over[cap] += ws is not None and ws > int(cap) * MiB
        same_after &= row["after"]["workspace"] == row["unset"]["workspace"]
        engines = " / ".join(row[m]["engine"] for m in ("unset", "64", "8"))
        cells = [_mib(row[m]["workspace"]) for m in MODES]
        table.add_row(model, precision, _shape(signature), *cells, engines)
    console.print(table)
    largest = max((r["workspace"] or 0) for r in by_mode["unset"]["results"])
    if not same_after:
        after = "not those of no cap: the cap is read again after the first convolution"
    elif largest > 8 * MiB and over["8"] == 0:
        after = "those of no cap: the cap is read once, before the first convolution"
    else:
        after = "those of no cap (no call needs more than 8 MiB uncapped, or 8 had no effect)"
    console.print(
        f"{len(items)} calls; largest workspace with no cap {_mib(largest)} MiB; calls over the "
        f"cap: {over['64']} at 64 MiB, {over['8']} at 8 MiB; with 8 exported after the first "
        f"convolution the workspaces are {after}"
    )
    if device != "cuda":
        console.print("dry run on the CPU: no cuDNN, no verdict on the cap")
        return True
    honoured = over["64"] == 0 and over["8"] == 0
    console.print(
        "verdict: HONOURED: the planned card's reserve with room counts a bound"
        if honoured
        else "verdict: NOT HONOURED: the reserve with room of a planned card's convolutions is "
        "an estimate, not a bound (what fits does not rest on it: workspaces give way)"
    )
    return honoured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=["small_cnn", "resnet18"],
                        choices=("small_cnn", "resnet18"))  # fmt: skip
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--signatures", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import pickle

        items, norms = pickle.loads(args.signatures.read_bytes())
        print(json.dumps(measure(args.child, args.device, items, norms, args.log)))
        return
    import pickle

    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)
    items, norms = signatures(args.batch, args.image, args.models)
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        signatures_file = work / "signatures.pkl"
        signatures_file.write_bytes(pickle.dumps((items, norms)))
        by_mode = {mode: _child(mode, args.device, signatures_file, work) for mode in MODES}
    capped = report(items, by_mode, args.device)
    normed = norm_report(norms, by_mode["unset"]["norms"], args.device)
    sys.exit(0 if capped and normed else 1)


if __name__ == "__main__":
    main()
