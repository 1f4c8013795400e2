"""The two paths of masked attention (astrai/model/masked_attention.py) and the choice."""

import torch
from numerics import assert_close

from astrai.model.masked_attention import attend_by_products, attend_fused, products_win


def test_products_and_fused_kernel_agree():
    # grouped and plain heads, a value head size of its own (as MLA has), a chunk after cached
    # keys and a padded row: the same attention in float32 up to the order of its sums
    g = torch.Generator().manual_seed(0)
    for heads, groups, dv in [(2, 4, 16), (3, 1, 8)]:
        q = torch.randn(2, heads * groups, 5, 16, generator=g)
        k = torch.randn(2, heads, 9, 16, generator=g)
        v = torch.randn(2, heads, 9, dv, generator=g)
        ends = torch.tensor([[4, 5, 6, 7, 8], [2, 3, 3, 3, 3]])  # keys each query may see
        mask = (torch.arange(9)[None, None, :] <= ends[:, :, None])[:, None]
        assert_close(attend_by_products(q, k, v, mask, None), attend_fused(q, k, v, mask, None), 64)


def test_timing_the_paths_leaves_the_global_random_stream_alone():
    products_win.cache_clear()
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    products_win(torch.float32, "cpu", 1, 2, 8)
    assert torch.equal(torch.rand(3), expected)
