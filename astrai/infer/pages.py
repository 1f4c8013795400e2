"""The KV page pool: K/V entries for every layer in fixed-size pages, plus reference counts.

The pool is a pytree `{"k": [L, pages, page_size, *k], "v": [L, pages, page_size, *v],
"refs": int32 [pages]}` with per-token shapes from `kv_shapes(cfg)`, so an MLA pool holds the
compressed latent and the rope key, not expanded K/V. A page with refs == 0 is free; every
holder (a running sequence, the prefix cache) counts once.

All functions here take the pool and return it. The pool is donated: buffers are updated in
place for speed, so the caller must use the returned pool and never the one it passed in. The
pool passed in is emptied and marked: reading it again raises DonatedError.
"""

from __future__ import annotations

import torch

from astrai.config import ModelConfig
from astrai.infer.donation import donated_error
from astrai.kernels.huge_pages import zeros_in_huge_pages
from astrai.model import kv_shapes


class Pool(dict):
    """The pool's pytree, a dict of tensors. Once donated it is empty, and reading it raises
    DonatedError naming the function it went to."""

    donated_to: str | None = None

    def __missing__(self, key):
        if self.donated_to is not None:
            raise donated_error("page pool", self.donated_to)
        raise KeyError(key)


def passed_on(pool: Pool, to: str) -> Pool:
    """The pool once `to` has used it: the same buffers in a new Pool. The one given is emptied
    and marked donated to `to`."""
    new = Pool(pool)
    pool.clear()
    if isinstance(pool, Pool):
        pool.donated_to = to
    return new


def init_pages(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Pool:
    """An empty pool of `num_pages` pages of `page_size` tokens, every page free."""
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
    k_shape, v_shape = kv_shapes(cfg)
    shape = (cfg.num_hidden_layers, num_pages, page_size)
    return Pool(
        # on the CPU in 2 MiB pages, as the weights: a step reads every page of its sequences
        k=zeros_in_huge_pages((*shape, *k_shape), dtype, device),
        v=zeros_in_huge_pages((*shape, *v_shape), dtype, device),
        refs=torch.zeros(num_pages, dtype=torch.int32),
    )


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` tokens."""
    return -(-tokens // page_size)


def page_size_of(pool: Pool) -> int:
    return pool["k"].shape[2]


def num_free_pages(pool: Pool) -> int:
    return int((pool["refs"] == 0).sum())


def alloc_pages(pool: Pool, n: int) -> tuple[Pool, list[int] | None]:
    """Take n free pages (refs 0 -> 1). Returns (pool, pages), or (pool, None) when fewer than
    n pages are free: nothing is taken then, and the caller decides what to give up."""
    free = torch.nonzero(pool["refs"] == 0).flatten()
    if len(free) < n:
        return passed_on(pool, "alloc_pages"), None
    pages = free[:n]
    pool["refs"][pages] = 1
    return passed_on(pool, "alloc_pages"), pages.tolist()


def share_pages(pool: Pool, pages: list[int]) -> Pool:
    """One more holder for each page (refs + 1); a shared page is freed by its last holder."""
    index = torch.as_tensor(pages, dtype=torch.long)
    if len(index) and bool((pool["refs"][index] <= 0).any()):
        raise ValueError(f"cannot share free pages: {pages}")
    pool["refs"].index_add_(0, index, torch.ones(len(index), dtype=torch.int32))
    return passed_on(pool, "share_pages")


def free_pages(pool: Pool, pages: list[int]) -> Pool:
    """One holder fewer for each page (refs - 1); pages reaching 0 are free again."""
    index = torch.as_tensor(pages, dtype=torch.long)
    if len(index) and bool((pool["refs"][index] <= 0).any()):
        raise ValueError(f"double free: some of {pages} are already free")
    pool["refs"].index_add_(0, index, torch.full((len(index),), -1, dtype=torch.int32))
    return passed_on(pool, "free_pages")
