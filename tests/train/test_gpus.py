"""The GPU table: sane figures, torch device names matched to entries, the lookup's errors,
and train/measure/flops.py's cuda_peak answering from it."""

from __future__ import annotations

import pytest
import torch

from batchfit.train.device.gpus import GB, GPUS, gpu, gpu_of_device_name
from batchfit.train.measure.flops import cuda_peak


@pytest.mark.parametrize("entry", GPUS, ids=lambda entry: entry.name)
def test_every_entry_is_sane(entry) -> None:  # noqa: ANN001
    assert 14 * GB < entry.total_bytes < 200 * GB
    assert entry.capability >= (7, 0)
    peaks = entry.peak_flops
    assert 5e12 < peaks["fp32"] < 100e12
    for precision in ("tf32", "bf16", "fp16"):
        if precision in peaks:
            assert peaks[precision] >= peaks["fp32"]
    assert ("bf16" in peaks) == ("tf32" in peaks) or entry.name == "A10G"
    if entry.capability < (8, 0):
        assert "bf16" not in peaks  # bf16 tensor cores came with Ampere


def test_names_are_unique_and_every_entry_is_found_by_its_device_patterns() -> None:
    assert len({entry.name.upper() for entry in GPUS}) == len(GPUS)
    assert all(entry.device_patterns for entry in GPUS)


@pytest.mark.parametrize(
    ("device_name", "name"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("Tesla V100-SXM2-16GB", "V100-16GB"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("Tesla T4", "T4"),
    ],
)
def test_torch_device_names_match_their_entry(device_name: str, name: str) -> None:
    assert gpu_of_device_name(device_name).name == name


@pytest.mark.parametrize(
    "device_name",
    ["NVIDIA GeForce GTX 1080", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA L40", "NVIDIA H100 NVL"],
)
def test_unknown_cards_match_nothing(device_name: str) -> None:
    assert gpu_of_device_name(device_name) is None


def test_lookup_is_case_insensitive_and_takes_unique_prefixes_and_device_names() -> None:
    assert gpu("a100-40gb").total_bytes == 42_298_834_944
    assert gpu("rtx-40").name == "RTX-4090"
    assert gpu("NVIDIA H100 80GB HBM3").capability == (9, 0)
    assert gpu("L4").name == "L4"  # exact before prefix: not ambiguous with L40S


def test_an_ambiguous_name_lists_the_candidates() -> None:
    with pytest.raises(ValueError, match=r"search\.gpu='A100' is ambiguous: A100-40GB, A100-80GB;"):
        gpu("A100")


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"search\.gpu='MI300X' is not a known GPU; use one of A100-40GB, "
    ):
        gpu("MI300X")


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 PCIe", "bf16", 756e12),  # not the SXM part's
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
        ("Tesla T4", "fp16", 65e12),
        ("NVIDIA A10G", "bf16", None),  # no published tensor-core figure
    ],
)
def test_cuda_peak_answers_from_the_table(name: str, precision: str, peak: float | None) -> None:
    assert cuda_peak(name, precision) == peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_this_machines_card_offers_what_cuda_reports_free() -> None:
    """On the card itself, `usable` (search.memory_budget=usable) is measured, not the
    table's 512 MiB context: what mem_get_info reported free plus what this process's
    caching allocator held, at the process's first plan (once: its plans agree). Since
    then the context can only have grown (kernels loaded, handles made)."""
    from batchfit.train.device.spec import device_spec

    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # the allocator holds some
    spec = device_spec(device, None)
    assert spec.gpu is not None and device_spec(device, None).gpu == spec.gpu
    free, total = torch.cuda.mem_get_info(device)
    now = free + torch.cuda.memory_reserved(device)
    assert spec.gpu.total_bytes == total
    assert now <= spec.gpu.usable_bytes < now + 2**30
    del held
