"""Weights and K/V pages in memory advised to 2 MiB pages (astrai/kernels/huge_pages.py): the
same values, in a region the kernel marks as advised (VmFlags "hg" in /proc/self/smaps),
returned when the tensor is freed; small tensors as they were. The layouts of our products and
the page pool use it."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

import astrai as ai
from astrai.infer import init_pages
from astrai.infer.panels import panel_layout
from astrai.kernels import gemv
from astrai.kernels.huge_pages import PAGE, contiguous_in_huge_pages, zeros_in_huge_pages

SMAPS = Path("/proc/self/smaps")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # absent where the kernel has none
pytestmark = pytest.mark.skipif(
    not (hasattr(mmap, "MADV_HUGEPAGE") and SMAPS.exists() and THP.exists()),
    reason="Linux's madvise, smaps and transparent huge pages",
)


def mapping_flags(address: int) -> set[str] | None:
    """The VmFlags of the mapping holding `address`, or None where none does."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(end, 16) for end in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    return None


def test_a_copy_in_advised_memory_has_the_same_values():
    w = torch.randn(1024, 768)  # 3 MiB
    laid = contiguous_in_huge_pages(w.t())
    assert laid.is_contiguous() and laid.shape == (768, 1024) and laid.dtype == w.dtype
    assert torch.equal(laid, w.t())
    assert laid.data_ptr() % PAGE == 0
    assert "hg" in mapping_flags(laid.data_ptr())


def test_the_memory_is_returned_with_the_tensor():
    laid = contiguous_in_huge_pages(torch.zeros(PAGE))
    address = laid.data_ptr()
    assert mapping_flags(address) is not None
    del laid
    gc.collect()
    assert mapping_flags(address) is None


def test_under_two_mib_a_tensor_stays_as_it_is():
    w = torch.randn(64, 64)
    assert contiguous_in_huge_pages(w) is w
    assert torch.equal(contiguous_in_huge_pages(w.t()), w.t().contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panels_are_laid_out_in_advised_memory(dtype):
    panels = panel_layout(torch.randn(2048, 1024).to(dtype))
    assert "hg" in mapping_flags(panels.data_ptr())


def test_8_bit_weights_are_laid_out_in_advised_memory():
    packed = gemv.pack_int8(torch.randint(-127, 128, (2048, 2048), dtype=torch.int8))
    assert "hg" in mapping_flags(packed.data_ptr())


def test_zeros_in_advised_memory_are_zeros():
    z = zeros_in_huge_pages((3, PAGE // 4), torch.float32)
    assert z.shape == (3, PAGE // 4) and not z.any()
    assert "hg" in mapping_flags(z.data_ptr())
    assert zeros_in_huge_pages((4, 4), torch.bfloat16).dtype == torch.bfloat16


def test_the_page_pool_is_in_advised_memory():
    cfg = ai.ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    pool = init_pages(cfg, num_pages=512, page_size=16)  # 4 MiB of keys, 4 of values
    assert all("hg" in mapping_flags(pool[name].data_ptr()) for name in ("k", "v"))
    assert not pool["k"].any() and not pool["v"].any()
