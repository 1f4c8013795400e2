"""The prefix cache: a radix tree whose edges are page-sized chunks of tokens.

Each node stands for one full page of K/V and is reached by the exact chain of token chunks
from the root, so a lookup reuses a page only when the whole prefix before it matches too
(K/V depend on every earlier token, not on the page's own tokens alone). Only full pages are
cached; the last partial page of a sequence is never shared.

The cache holds one reference on each of its pages (see pages.py). A cached page that a
running sequence also holds has refs > 1 and is locked; one with refs == 1 is held by the cache
alone and may be evicted, least recently used first, leaves before their parents.

Every function that changes the cache takes it and returns it (and the pool, when it changes
references): both are donated, updated in place, and the caller uses only what comes back.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from astrai.infer.pages import Pool, free_pages, share_pages


@dataclass(eq=False)
class Node:
    page: int
    chunk: tuple[int, ...]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_used: int = 0


@dataclass(eq=False)
class PrefixCache:
    page_size: int
    root: Node
    clock: itertools.count = field(default_factory=itertools.count)
    nodes: dict[int, Node] = field(default_factory=dict)  # page -> node


def init_prefix_cache(page_size: int) -> PrefixCache:
    return PrefixCache(page_size, Node(page=-1, chunk=(), parent=None))


def _chunks(cache: PrefixCache, tokens: list[int]):
    ps = cache.page_size
    for start in range(0, len(tokens) - ps + 1, ps):
        yield tuple(tokens[start : start + ps])


def match_prefix(cache: PrefixCache, tokens: list[int]) -> tuple[PrefixCache, list[int]]:
    """(cache, pages of the longest cached chain equal to the first full pages of `tokens`).

    The match marks those pages recently used, so the cache is donated. The pages are not
    locked: a caller that keeps them must `share_pages` them at once."""
    node, pages, now = cache.root, [], next(cache.clock)
    for chunk in _chunks(cache, tokens):
        node = node.children.get(chunk)
        if node is None:
            break
        node.last_used = now
        pages.append(node.page)
    return cache, pages


def insert_prefix(
    cache: PrefixCache, pool: Pool, tokens: list[int], pages: list[int]
) -> tuple[PrefixCache, Pool]:
    """Cache the full pages of `tokens`, whose K/V live in `pages` (one page per chunk).

    Chunks already cached keep their existing page; the cache takes a reference on every page
    it adds. Returns (cache, pool); both are donated."""
    node, now, added = cache.root, next(cache.clock), []
    for chunk, page in zip(_chunks(cache, tokens), pages):
        child = node.children.get(chunk)
        if child is None:
            if page in cache.nodes:  # this page already caches another prefix
                break
            child = Node(page=page, chunk=chunk, parent=node)
            node.children[chunk] = child
            cache.nodes[page] = child
            added.append(page)
        child.last_used = now
        node = child
    return cache, (share_pages(pool, added) if added else pool)


def evict(cache: PrefixCache, pool: Pool, n: int) -> tuple[PrefixCache, Pool, int]:
    """Free up to n pages that only the cache holds, least recently used leaves first.

    Returns (cache, pool, number of pages freed); cache and pool are donated."""
    refs = pool["refs"]
    heap = [
        (node.last_used, node.page)
        for node in cache.nodes.values()
        if not node.children and int(refs[node.page]) == 1
    ]
    heapq.heapify(heap)
    freed = []
    while heap and len(freed) < n:
        _, page = heapq.heappop(heap)
        node = cache.nodes.pop(page)
        del node.parent.children[node.chunk]
        freed.append(page)
        parent = node.parent
        if parent is not cache.root and not parent.children and int(refs[parent.page]) == 1:
            heapq.heappush(heap, (parent.last_used, parent.page))
    return cache, (free_pages(pool, freed) if freed else pool), len(freed)


def clear_prefix_cache(cache: PrefixCache, pool: Pool) -> tuple[PrefixCache, Pool]:
    """Drop every cached page (pages that running sequences hold stay theirs). Returns
    (cache, pool); both are donated."""
    pages = list(cache.nodes)
    cache.nodes.clear()
    cache.root.children.clear()
    return cache, (free_pages(pool, pages) if pages else pool)


def num_cached_pages(cache: PrefixCache) -> int:
    return len(cache.nodes)


def num_evictable_pages(cache: PrefixCache | None, pool: Pool) -> int:
    """Cached pages that only the cache holds (refs == 1): what `evict` could free."""
    if cache is None or not cache.nodes:
        return 0
    pages = torch.tensor(list(cache.nodes), dtype=torch.long)
    return int((pool["refs"][pages] == 1).sum())
