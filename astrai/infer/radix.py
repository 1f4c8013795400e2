"""The prefix cache: a radix tree whose edges are page-sized chunks of tokens.

Each node stands for one full page of K/V and is reached by the exact chain of token chunks
from the root, so a lookup reuses a page only when the whole prefix before it matches too
(K/V depend on every earlier token, not on the page's own tokens alone). Only full pages are
cached; the last partial page of a sequence is never shared.

The cache holds one reference on each of its pages (see pages.py). A cached page that a
running sequence also holds has refs > 1 and is locked; one with refs == 1 is held by the cache
alone and may be evicted, least recently used first, leaves before their parents.

Requests served with a LoRA adapter compute other K/V for the same tokens, so each adapter has
a tree of its own: `key` names it (None: the base model), and a lookup under one key never
reaches a page cached under another.

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
    root: Node  # the base model's tree
    clock: itertools.count = field(default_factory=itertools.count)
    nodes: dict[int, Node] = field(default_factory=dict)  # page -> node
    roots: dict[object, Node] = field(default_factory=dict)  # adapter key -> its tree


def init_prefix_cache(page_size: int) -> PrefixCache:
    return PrefixCache(page_size, Node(page=-1, chunk=(), parent=None))


def _root(cache: PrefixCache, key: object, make: bool = False) -> Node | None:
    """The tree of `key` (None: the base model's); made when asked and missing."""
    if key is None:
        return cache.root
    root = cache.roots.get(key)
    if root is None and make:
        root = cache.roots[key] = Node(page=-1, chunk=(), parent=None)
    return root


def _chunks(cache: PrefixCache, tokens: list[int]):
    ps = cache.page_size
    for start in range(0, len(tokens) - ps + 1, ps):
        yield tuple(tokens[start : start + ps])


def match_prefix(
    cache: PrefixCache, tokens: list[int], key: object = None
) -> tuple[PrefixCache, list[int]]:
    """(cache, pages of the longest chain cached under `key` equal to the first full pages of
    `tokens`).

    The match marks those pages recently used, so the cache is donated. The pages are not
    locked: a caller that keeps them must `share_pages` them at once."""
    node, pages, now = _root(cache, key), [], next(cache.clock)
    if node is None:
        return cache, pages
    for chunk in _chunks(cache, tokens):
        node = node.children.get(chunk)
        if node is None:
            break
        node.last_used = now
        pages.append(node.page)
    return cache, pages


def insert_prefix(
    cache: PrefixCache, pool: Pool, tokens: list[int], pages: list[int], key: object = None
) -> tuple[PrefixCache, Pool]:
    """Cache, under `key`, the full pages of `tokens`, whose K/V live in `pages` (one page per
    chunk).

    Chunks already cached keep their existing page; the cache takes a reference on every page
    it adds. Returns (cache, pool); both are donated."""
    node, now, added = _root(cache, key, make=True), next(cache.clock), []
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
        if parent.parent is not None and not parent.children and int(refs[parent.page]) == 1:
            heapq.heappush(heap, (parent.last_used, parent.page))
    return cache, (free_pages(pool, freed) if freed else pool), len(freed)


def clear_prefix_cache(cache: PrefixCache, pool: Pool) -> tuple[PrefixCache, Pool]:
    """Drop every cached page (pages that running sequences hold stay theirs). Returns
    (cache, pool); both are donated."""
    pages = list(cache.nodes)
    cache.nodes.clear()
    cache.root.children.clear()
    cache.roots.clear()
    return cache, (free_pages(pool, pages) if pages else pool)


def drop_prefix_key(cache: PrefixCache, pool: Pool, key: object) -> tuple[PrefixCache, Pool]:
    """Drop every page cached under `key` (an adapter unloaded: no request can match them
    again). Returns (cache, pool); both are donated."""
    root = cache.roots.pop(key, None)
    pages, stack = [], list(root.children.values()) if root is not None else []
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        del cache.nodes[node.page]
        pages.append(node.page)
    return cache, (free_pages(pool, pages) if pages else pool)


def num_cached_pages(cache: PrefixCache) -> int:
    return len(cache.nodes)


def num_evictable_pages(cache: PrefixCache | None, pool: Pool) -> int:
    """Cached pages that only the cache holds (refs == 1): what `evict` could free."""
    if cache is None or not cache.nodes:
        return 0
    pages = torch.tensor(list(cache.nodes), dtype=torch.long)
    return int((pool["refs"][pages] == 1).sum())
