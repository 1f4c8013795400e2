"""The two paths of masked attention (astrai/model/masked_attention.py) and the choice."""

import pytest
import torch
from numerics import assert_close

from astrai.kernels import prompt_attention
from astrai.model import masked_attention
from astrai.model.masked_attention import (
    attend_by_products,
    attend_causal,
    attend_fused,
    attend_fused_causal,
    attend_masked,
    products_win,
)


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
    masked_attention.kernel_wins.cache_clear()
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    products_win(torch.float32, "cpu", 1, 2, 8)
    if prompt_attention.runs_here():  # our kernel against torch's faster path
        masked_attention.kernel_wins(torch.float32, 1, 2, 8)
    assert torch.equal(torch.rand(3), expected)


def _training_inputs(heads: int, groups: int, length: int, g: torch.Generator):
    q = torch.randn(3, heads * groups, length, 8, generator=g).requires_grad_()
    k = torch.randn(3, heads, length, 8, generator=g).requires_grad_()
    v = torch.randn(3, heads, length, 8, generator=g).requires_grad_()
    return q, k, v


def _output_and_gradients(attend, q, k, v, *args):
    out = attend(q, k, v, *args)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    return out, *grads


@pytest.mark.parametrize("heads, groups", [(2, 2), (3, 1)])
def test_training_paths_agree_in_values_and_gradients(heads, groups):
    # packed documents (a block-diagonal causal mask) and plain causal attention: the products
    # and the fused kernels give the same outputs and the same gradients of q, k and v, up to
    # the order of their sums over the 12 keys and the backward's over 12 queries
    g = torch.Generator().manual_seed(0)
    q, k, v = _training_inputs(heads, groups, 12, g)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 3 + [1] * 3 + [2] * 6])
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    mask = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
    for products, fused in [
        (_output_and_gradients(attend_by_products, q, k, v, mask, None),
         _output_and_gradients(attend_fused, q, k, v, mask, None)),
        (_output_and_gradients(attend_by_products, q, k, v, causal[None, None], None),
         _output_and_gradients(attend_fused_causal, q, k, v, None)),
    ]:  # fmt: skip
        for a, b in zip(products, fused, strict=True):
            assert_close(a, b, 4 * 12)


@pytest.mark.parametrize("native", [True, False])
def test_training_takes_the_products_exactly_in_native_bf16(native, monkeypatch):
    # a rule, not a timing: a resumed run must take the path its first process took
    monkeypatch.setattr(masked_attention, "_native_bf16", lambda device_type: native)
    monkeypatch.setattr(masked_attention, "products_win", lambda *shape: pytest.fail("timed"))
    # inference's prompt kernel (tests/infer/test_prompt_attention.py) held off: torch's paths
    monkeypatch.setattr(masked_attention, "kernel_wins", lambda *shape: False)
    g = torch.Generator().manual_seed(0)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in _training_inputs(2, 2, 12, g))
        # the same kernels on the same inputs give the same sums: compared exactly
        causal_path = attend_causal(q, k, v, None)
        masked_path = attend_masked(q, k, v, causal, None)
        if native and dtype == torch.bfloat16:
            assert torch.equal(causal_path, attend_by_products(q, k, v, causal, None))
            assert torch.equal(masked_path, attend_by_products(q, k, v, causal, None))
        else:
            assert torch.equal(causal_path, attend_fused_causal(q, k, v, None))
            assert torch.equal(masked_path, attend_fused(q, k, v, causal, None))
        with torch.no_grad():  # a whole prompt without gradients keeps the causal kernel
            assert torch.equal(attend_causal(q, k, v, None), attend_fused_causal(q, k, v, None))
