"""A caller's request, checked against the engine and made into the sequence it runs as."""

from __future__ import annotations

import msgspec
import torch

from astrai.config import EngineConfig, ModelConfig
from astrai.infer.constraints import start_constraint
from astrai.infer.events import PromptTooLong
from astrai.infer.pages import pages_for
from astrai.infer.sampling import SamplingParams
from astrai.infer.sequence import Sequence


class Request(msgspec.Struct, frozen=True):
    """What a caller asks for: a prompt (text, or token ids) and how to sample it. The id names
    the request in the events; it must differ from those of the requests still running.
    `adapter` names a loaded LoRA adapter to run it with (None: the base model)."""

    id: str
    prompt: str | list[int]
    sampling: SamplingParams = SamplingParams()
    adapter: str | None = None


def tokenize(cfg: ModelConfig, tokenizer, prompt: str | list[int]) -> list[int]:
    """The prompt's token ids; raises ValueError for an empty prompt or ids outside the
    vocabulary."""
    vocab = cfg.vocab_size
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids")
        tokens = tokenizer.encode(prompt)
    else:
        tokens = [int(t) for t in prompt]
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
    if not tokens:
        raise ValueError("the prompt is empty")
    return tokens


def new_sequence(cfg: ModelConfig, config: EngineConfig, tokenizer, request: Request) -> Sequence:
    """Check a request against the model, the engine's resolved config and the tokenizer, and
    build its sequence; raises PromptTooLong or ValueError naming what is wrong. It reads no
    engine state, so a server may call it on its own thread. A request without a seed gets
    its generator when it joins an engine state (see state.enqueue)."""
    sp, tok = request.sampling, tokenizer
    tokens = tokenize(cfg, tok, request.prompt)
    max_len = len(tokens) + sp.max_tokens
    if max_len > config.max_seq_len:
        raise PromptTooLong(
            f"prompt ({len(tokens)} tokens) + max_tokens ({sp.max_tokens}) = {max_len} "
            f"exceeds max_seq_len ({config.max_seq_len})"
        )
    # the last generated token is never fed back, so it needs no K/V
    if pages_for(max_len - 1, config.page_size) > config.num_pages:
        raise PromptTooLong(
            f"prompt + max_tokens = {max_len} tokens do not fit the page pool "
            f"({config.num_pages} pages of {config.page_size})"
        )
    if sp.logit_bias and not all(0 <= t < cfg.vocab_size for t in sp.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {cfg.vocab_size})")
    if sp.stop and tok is None:
        raise ValueError("stop strings need a tokenizer")
    stop_ids = frozenset(sp.stop_token_ids)
    if not sp.ignore_eos and tok is not None:
        stop_ids |= tok.stop_ids
    matcher = (
        start_constraint(sp.constraint, tok, cfg.vocab_size) if sp.constraint is not None else None
    )
    return Sequence(
        id=request.id,
        tokens=tokens,
        prompt_len=len(tokens),
        sampling=sp,
        stop_ids=stop_ids,
        generator=torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None,
        max_len=max_len,
        decoder=tok.stream_decoder() if tok is not None else None,
        matcher=matcher,
        adapter=request.adapter,
    )
