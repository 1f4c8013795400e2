"""Inference: a paged KV pool, a radix prefix cache, paged prefill / decode_step, sampling,
continuous batching and the Engine that runs them on a background thread."""

from astrai.infer.engine import Engine
from astrai.infer.events import (
    Completion,
    Overloaded,
    PromptTooLong,
    StreamEvent,
    Usage,
)
from astrai.infer.paged import decode_step, prefill, prepare_params
from astrai.infer.pages import (
    alloc_pages,
    free_pages,
    init_pages,
    num_free_pages,
    share_pages,
)
from astrai.infer.radix import (
    PrefixCache,
    clear_prefix_cache,
    evict,
    init_prefix_cache,
    insert_prefix,
    match_prefix,
)
from astrai.infer.sampling import SamplingParams, sample, sample_requests, token_logprobs

__all__ = [
    "Completion",
    "Engine",
    "Overloaded",
    "PrefixCache",
    "PromptTooLong",
    "SamplingParams",
    "StreamEvent",
    "Usage",
    "alloc_pages",
    "clear_prefix_cache",
    "decode_step",
    "evict",
    "free_pages",
    "init_pages",
    "init_prefix_cache",
    "insert_prefix",
    "match_prefix",
    "num_free_pages",
    "prefill",
    "prepare_params",
    "sample",
    "sample_requests",
    "share_pages",
    "token_logprobs",
]
