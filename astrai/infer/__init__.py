"""Inference: a paged KV pool, a radix prefix cache, paged prefill / decode_step, sampling,
continuous batching as pure functions over an engine state (step.py) and the Engine that runs
them on a background thread."""

from astrai.hardware import native_bf16
from astrai.infer.acceptance import Verdict, verify_greedy, verify_sampled
from astrai.infer.adapters import (
    AdapterError,
    AdapterInfo,
    AdapterInUse,
    AdapterMismatch,
    UnknownAdapter,
    adapter_bytes,
    adapter_list,
    load_adapter,
    unload_adapter,
)
from astrai.infer.constraints import (
    Constraint,
    ConstraintError,
    accept_token,
    allowed_tokens,
    start_constraint,
)
from astrai.infer.donation import DonatedError
from astrai.infer.draft import (
    DraftState,
    draft_propose,
    draft_propose_batch,
    draft_release,
    draft_rollback,
    init_draft,
)
from astrai.infer.engine import Engine
from astrai.infer.events import (
    Completion,
    Logprob,
    Overloaded,
    PromptTooLong,
    StreamEvent,
    Usage,
)
from astrai.infer.hardware import auto_dtype
from astrai.infer.int4 import Int4Matrix
from astrai.infer.lookup import LookupIndex, extend_lookup, init_lookup, propose_lookup
from astrai.infer.packed import PackedMatrix
from astrai.infer.paged import decode_step, prefill, prefill_logits
from astrai.infer.pages import (
    alloc_pages,
    free_pages,
    init_pages,
    num_free_pages,
    pages_for,
    share_pages,
)
from astrai.infer.prepare import kernels_used, prepare_params
from astrai.infer.proposal import Proposal
from astrai.infer.quant import Int8Matrix
from astrai.infer.radix import (
    PrefixCache,
    clear_prefix_cache,
    evict,
    init_prefix_cache,
    insert_prefix,
    match_prefix,
)
from astrai.infer.requests import Request
from astrai.infer.sampling import SamplingParams, sample, sample_requests, token_logprobs
from astrai.infer.speculative import discard_after, verify_forward
from astrai.infer.speculative_loop import SpecStats, speculative_generate
from astrai.infer.state import (
    EngineState,
    add_request,
    cancel_request,
    forget_cached_kv,
    init_engine,
)
from astrai.infer.stats import EngineStats, engine_stats
from astrai.infer.step import engine_step, run_requests
from astrai.infer.support import products_here

__all__ = [
    "AdapterError",
    "AdapterInUse",
    "AdapterInfo",
    "AdapterMismatch",
    "Completion",
    "Constraint",
    "ConstraintError",
    "DonatedError",
    "DraftState",
    "Engine",
    "EngineState",
    "EngineStats",
    "Int4Matrix",
    "Int8Matrix",
    "Logprob",
    "LookupIndex",
    "Overloaded",
    "PackedMatrix",
    "PrefixCache",
    "PromptTooLong",
    "Proposal",
    "Request",
    "SamplingParams",
    "SpecStats",
    "StreamEvent",
    "UnknownAdapter",
    "Usage",
    "Verdict",
    "accept_token",
    "adapter_bytes",
    "adapter_list",
    "add_request",
    "alloc_pages",
    "allowed_tokens",
    "auto_dtype",
    "cancel_request",
    "clear_prefix_cache",
    "decode_step",
    "discard_after",
    "draft_propose",
    "draft_propose_batch",
    "draft_release",
    "draft_rollback",
    "engine_stats",
    "engine_step",
    "evict",
    "extend_lookup",
    "forget_cached_kv",
    "free_pages",
    "init_draft",
    "init_engine",
    "init_lookup",
    "init_pages",
    "init_prefix_cache",
    "insert_prefix",
    "kernels_used",
    "load_adapter",
    "match_prefix",
    "native_bf16",
    "num_free_pages",
    "pages_for",
    "prefill",
    "prefill_logits",
    "prepare_params",
    "products_here",
    "propose_lookup",
    "run_requests",
    "sample",
    "sample_requests",
    "share_pages",
    "speculative_generate",
    "start_constraint",
    "token_logprobs",
    "unload_adapter",
    "verify_forward",
    "verify_greedy",
    "verify_sampled",
]
