"""Known GPUs: memory, compute capability and dense peak FLOP/s, for planning without the card.

A user on a laptop asks "what fits on an A100-40GB?" (`search.gpu=A100-40GB`): the predictor
needs the card's memory (`total_bytes`, what `torch.cuda.get_device_properties().total_memory`
reports, which is a little under the marketed size), its compute capability (which decides
e.g. the attention kernel, train/memory/cuda_emulation.py) and, for MFU, its peak FLOP/s
(train/measure/flops.py). On a real GPU, `gpu_of_device_name(torch.cuda.get_device_name())` finds
the entry.

Peaks are dense (no 2:4 sparsity), from NVIDIA's data sheets, SXM parts where both exist:
fp32 is plain FP32 on the CUDA cores (no TF32); tf32, bf16 and fp16 run on the tensor cores
with fp32 accumulation (what PyTorch's matmuls use; GeForce cards run fp16 accumulation at
twice that rate, which PyTorch does not use). A precision a card lacks has no entry.

What a process can have of a card is less than its total (`usable_bytes`, the default budget of
`search.gpu=CARD`, what `torch.cuda.mem_get_info()` reports free in a fresh process once its
context exists): the CUDA context with what the runtime loads into it (`context_bytes`) and,
where the table's total is not CUDA's own count, what the card does not report to CUDA
(`unreported_bytes`). Figures:

- The context. With lazy module loading (CUDA >= 11.7; PyTorch sets CUDA_MODULE_LOADING=LAZY
  since 1.13) a fresh context measured 287,047,680 B (666,632,192 B loading eagerly: the PR
  that made it PyTorch's default, pytorch/pytorch#86509); "~300MB" and "around 400MB with
  CUDA >= 11.7 and lazy module loading" (ptrblck, pytorch/pytorch#107667, #109888). A
  training step then loads its kernels into it and creates the cuBLAS and cuDNN handles:
  vLLM's profile measures that as non_torch_memory, 0.16 GiB on an H100 (vllm-project/vllm
  #12126) and 0.20 GiB on 24 GB cards (#14447). Together 438-586 MiB: CONTEXT_BYTES, 512 MiB,
  is its middle, the same for every card (no public figure per generation was found; none of
  these was measured by batchfit).
- CUDA's own total, where the table holds nvidia-smi's: on an H100-80GB vLLM's
  `torch.cuda.mem_get_info()` reports a total of 79.22 GiB (vllm-project/vllm#10511, #12126)
  where nvidia-smi prints 81,559 MiB: 438 MiB that no process gets. The other Hopper and
  Blackwell entries (totals from nvidia-smi too) are assumed to lose the same; unmeasured.
- Totals given as the vendor's GiB that NVML reports lower: L40S 46,068 MiB, L4 23,034 MiB,
  A10 23,028 MiB (Modal's table, thundergolfer.com/blog/nvidia-gpu-memory-capacity), RTX 3090
  24,268 MiB (nvidia-smi in pytorch/pytorch#54564). CUDA's total may be lower still (on an
  A100-40GB it is 621 MiB under nvidia-smi's 40,960 MiB); not counted where not known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

GIB = 2**30
MIB = 2**20
GB = 10**9
TFLOPS = 1e12
# The CUDA context, its lazily loaded kernels and the library handles (module docstring)
CONTEXT_BYTES = 512 * MIB
# What CUDA reports less than nvidia-smi's total on an H100-80GB: 81,559 MiB against 79.22 GiB
HOPPER_UNREPORTED_BYTES = 81_559 * MIB - round(79.22 * GIB / MIB) * MIB


@dataclass(frozen=True)
class Gpu:
    name: str  # the key users write: search.gpu=A100-40GB
    total_bytes: int  # as torch reports it (see the comment of each entry)
    capability: tuple[int, int]  # (major, minor) compute capability
    peak_flops: dict[str, float] = field(hash=False)  # per precision: fp32, tf32, bf16, fp16
    # Regular expressions matched against the upper-cased torch device name, e.g.
    # "NVIDIA A100-SXM4-40GB": one of them matching means this card.
    device_patterns: tuple[str, ...] = ()
    # Streaming multiprocessors, from NVIDIA's data sheets (bitsandbytes picks its 4-bit
    # matmul kernel by them: train/language/quantize.py); None: not known.
    sms: int | None = None
    # What a fresh process cannot allocate of total_bytes (module docstring): the CUDA
    # context, and what the card does not report to CUDA where total_bytes is another count
    context_bytes: int = CONTEXT_BYTES
    unreported_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        """What `torch.cuda.mem_get_info()` reports free in a fresh process once its CUDA
        context exists: the most a run's caching allocator can reserve."""
        return self.total_bytes - self.unreported_bytes - self.context_bytes

    def __post_init__(self) -> None:
        assert self.capability >= (7, 0), f"{self.name}: capability {self.capability}"
        assert set(self.peak_flops) <= {"fp32", "tf32", "bf16", "fp16"}, self.name


_AMPERE_DC = {"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS,
              "fp16": 312 * TFLOPS}  # fmt: skip
_HOPPER_SXM = {"fp32": 67 * TFLOPS, "tf32": 494.5 * TFLOPS, "bf16": 989.5 * TFLOPS,
               "fp16": 989.5 * TFLOPS}  # fmt: skip
_VOLTA = {"fp32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS}  # no bf16, no tf32 before Ampere

GPUS: tuple[Gpu, ...] = (
    # 42,298,834,944 bytes reported by deviceQuery on an A100-SXM4-40GB (driver 12.2)
    Gpu("A100-40GB", 42_298_834_944, (8, 0), _AMPERE_DC, (r"A100.*40GB",)),
    # 81,049 MiB reported on an A100 80GB PCIe (mixbench); the SXM4 part reports the same
    Gpu("A100-80GB", 81_049 * 2**20, (8, 0), _AMPERE_DC, (r"A100.*80GB",)),
    # Hopper, Blackwell: the total nvidia-smi prints (MiB); CUDA reports a few MiB less
    Gpu("H100-80GB", 81_559 * 2**20, (9, 0), _HOPPER_SXM, (r"H100.*(SXM|HBM3)",)),
    Gpu(
        "H100-PCIe",
        81_559 * 2**20,
        (9, 0),
        {"fp32": 51 * TFLOPS, "tf32": 378 * TFLOPS, "bf16": 756 * TFLOPS, "fp16": 756 * TFLOPS},
        (r"H100.*PCIE",),
    ),  # fmt: skip
    Gpu("H200", 143_771 * 2**20, (9, 0), _HOPPER_SXM, (r"(?<!G)H200",)),  # 141 GB HBM3e
    Gpu("GH200", 97_871 * 2**20, (9, 0), _HOPPER_SXM, (r"GH200",)),  # the 96 GB HBM3 part
    Gpu(
        "B200",
        183_359 * 2**20,
        (10, 0),
        {"fp32": 75 * TFLOPS, "tf32": 1125 * TFLOPS, "bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS},
        (r"B200",),
    ),  # fmt: skip
    # Ada and Ampere workstation / inference cards: the vendor's size in GiB (GDDR, ECC off)
    Gpu(
        "L40S",
        48 * GIB,
        (8, 9),
        {"fp32": 91.6 * TFLOPS, "tf32": 183 * TFLOPS, "bf16": 362 * TFLOPS, "fp16": 362 * TFLOPS},
        (r"L40S",),
    ),  # fmt: skip
    Gpu(
        "L4",
        24 * GIB,
        (8, 9),
        {"fp32": 30.3 * TFLOPS, "tf32": 60 * TFLOPS, "bf16": 121 * TFLOPS, "fp16": 121 * TFLOPS},
        (r"\bL4\b",),
    ),  # fmt: skip
    Gpu(
        "A10",
        24 * GIB,
        (8, 6),
        {"fp32": 31.2 * TFLOPS, "tf32": 62.5 * TFLOPS, "bf16": 125 * TFLOPS, "fp16": 125 * TFLOPS},
        (r"\bA10\b",),
    ),  # fmt: skip
    # AWS's A10G: NVIDIA publishes no tensor-core figures for it, so only fp32
    Gpu("A10G", 24 * GIB, (8, 6), {"fp32": 31.2 * TFLOPS}, (r"\bA10G\b",)),
    Gpu(
        "RTX-A6000",
        48 * GIB,
        (8, 6),
        {
            "fp32": 38.7 * TFLOPS,
            "tf32": 77.4 * TFLOPS,
            "bf16": 154.8 * TFLOPS,
            "fp16": 154.8 * TFLOPS,
        },
        (r"RTX A6000",),
    ),  # fmt: skip
    Gpu(
        "RTX-4090",
        24 * GIB,
        (8, 9),
        {
            "fp32": 82.6 * TFLOPS,
            "tf32": 82.6 * TFLOPS,
            "bf16": 165.2 * TFLOPS,
            "fp16": 165.2 * TFLOPS,
        },
        (r"RTX 4090(?! D)",),
    ),  # fmt: skip
    Gpu(
        "RTX-3090",
        24 * GIB,
        (8, 6),
        {"fp32": 35.6 * TFLOPS, "tf32": 35.6 * TFLOPS, "bf16": 71 * TFLOPS, "fp16": 71 * TFLOPS},
        (r"RTX 3090(?! TI)",),
    ),  # fmt: skip
    Gpu("V100-16GB", 16 * GIB, (7, 0), _VOLTA, (r"V100.*16GB",)),
    Gpu("V100-32GB", 32 * GIB, (7, 0), _VOLTA, (r"V100.*32GB",)),
    # 15,102 MiB is what a Tesla T4 reports on Colab
    Gpu(
        "T4", 15_102 * 2**20, (7, 5), {"fp32": 8.1 * TFLOPS, "fp16": 65 * TFLOPS}, (r"\bT4\b",)
    ),  # fmt: skip
)
_SMS = {
    "A100-40GB": 108, "A100-80GB": 108, "H100-80GB": 132, "H100-PCIe": 114, "H200": 132,
    "GH200": 132, "B200": 148, "L40S": 142, "L4": 58, "A10": 72, "A10G": 80, "RTX-A6000": 84,
    "RTX-4090": 128, "RTX-3090": 82, "V100-16GB": 80, "V100-32GB": 80, "T4": 40,
}  # fmt: skip
# Entries whose total is nvidia-smi's, for which CUDA reports less (module docstring)
_UNREPORTED = {
    **{
        name: HOPPER_UNREPORTED_BYTES
        for name in ("H100-80GB", "H100-PCIe", "H200", "GH200", "B200")
    },
    "L40S": 48 * GIB - 46_068 * MIB,
    "L4": 24 * GIB - 23_034 * MIB,
    "A10": 24 * GIB - 23_028 * MIB,
    "RTX-3090": 24 * GIB - 24_268 * MIB,
}
GPUS = tuple(
    replace(entry, sms=_SMS[entry.name], unreported_bytes=_UNREPORTED.get(entry.name, 0))
    for entry in GPUS
)
_BY_NAME = {entry.name.upper(): entry for entry in GPUS}


def gpu_of_device_name(device_name: str) -> Gpu | None:
    """The entry for a torch device name ('NVIDIA H100 80GB HBM3', 'Tesla T4'), or None."""
    upper = device_name.upper()
    for entry in GPUS:
        if any(re.search(pattern, upper) for pattern in entry.device_patterns):
            return entry
    return None


def gpu(name: str) -> Gpu:
    """The entry named `name` (case-insensitive), a unique prefix of one, or a device name.

    Raises ValueError naming `search.gpu` and the known names when none or several match.
    """
    name = str(name)  # search.gpu=4090 reaches here as an int
    key = name.strip().upper()
    if key in _BY_NAME:
        return _BY_NAME[key]
    by_device = gpu_of_device_name(name)
    if by_device is not None:
        return by_device
    candidates = [entry.name for entry in GPUS if entry.name.upper().startswith(key)] if key else []
    if len(candidates) == 1:
        return _BY_NAME[candidates[0].upper()]
    known = ", ".join(entry.name for entry in GPUS)
    if candidates:
        raise ValueError(
            f"search.gpu={name!r} is ambiguous: {', '.join(candidates)}; "
            f"override with one of them, e.g. search.gpu={candidates[0]}"
        )
    raise ValueError(
        f"search.gpu={name!r} is not a known GPU; use one of {known} "
        "(or a torch device name such as 'NVIDIA A100-SXM4-40GB')"
    )
