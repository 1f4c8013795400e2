"""KV memory of a window-only model: the pages the engine holds for one sequence at 8k tokens,
against the pages its window needs.

Every layer of a window-only model (Mistral with its sliding_window, Phi-3-mini-4k) attends to
its last `sliding_window` positions only, so pages wholly behind the window hold K/V no step
reads again; an engine that returns them to the pool holds about the window's worth however long
the sequence grows. The count is read from the engine's own statistics (engine_stats), so the
figure follows whatever the engine does, with no change here.
"""

from __future__ import annotations

import torch

from astrai.config import ModelConfig
from astrai.infer.pages import pages_for

NEW_TOKENS = 64  # decode steps at the end, where pages behind the window could go back
PAGE_SIZE = 16
# The pages count is the same at any width: the window section runs the tiny shape
SHAPE = dict(
    vocab_size=4096,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=352,
)


def window_config(window: int, length: int) -> ModelConfig:
    """A Mistral-style model: every layer slides over `window` positions."""
    return ModelConfig(**SHAPE, sliding_window=window, max_position_embeddings=length)


def window_pages(window: int, page_size: int) -> int:
    """The most pages a sequence needs to keep a window of K/V: the window spans
    pages_for(window) pages when it starts on a page boundary, one more otherwise."""
    return pages_for(window, page_size) + 1


@torch.inference_mode()
def pages_held(
    cfg: ModelConfig, length: int, new_tokens: int, page_size: int, device, dtype
) -> int:
    """The most KV pages the engine holds (engine_stats' pages_used) while one greedy request of
    length - new_tokens prompt tokens and new_tokens completion tokens runs, the prefix cache
    off (a finished request's pages would stay cached otherwise)."""
    import astrai
    from astrai.infer import (
        Request,
        SamplingParams,
        add_request,
        engine_stats,
        engine_step,
        init_engine,
    )

    params = {k: v.to(device=device, dtype=dtype) for k, v in astrai.init_params(cfg).items()}
    state = init_engine(
        params, cfg, num_pages=pages_for(length, page_size) + 4, page_size=page_size,
        max_batch=1, max_seq_len=length, prefix_cache=False, device=device, dtype=dtype,
    )  # fmt: skip
    prompt = torch.randint(0, cfg.vocab_size, (length - new_tokens,)).tolist()
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    state = add_request(state, Request("window", prompt, sampling))
    held, done = 0, False
    while not done:
        state, events = engine_step(state, params)
        held = max(held, engine_stats(state).pages_used)
        done = any(e.finish_reason is not None for e in events)
    return held


def window_memory(b) -> None:
    """The window section: pages held at the workload's length (8k tokens; 1k with --quick)
    against the window's pages, as rows, and a note while the engine keeps the pages behind
    the window."""
    from .report import figure

    length, window = b.work.window
    cfg = window_config(window, length)
    held = pages_held(cfg, length, min(NEW_TOKENS, length // 4), PAGE_SIZE, b.device, b.dtype)
    bound = window_pages(window, PAGE_SIZE)
    label = f"window-only model (every layer {window} tokens), KV pages held at {length} tokens"
    b.rows.append(figure("window", label, "pages", held, None, bound, higher_is_better=False))
    b.rows.append(figure("window", f"pages of a {window}-token window", "pages", bound))
    b.rows.append(figure("window", f"pages of {length} tokens", "pages", pages_for(length, PAGE_SIZE)))  # fmt: skip
    if held > bound:
        b.note(
            f"window: {held} KV pages held at {length} tokens for a {window}-token window "
            f"({bound} pages): pages behind the window are not released yet"
        )
