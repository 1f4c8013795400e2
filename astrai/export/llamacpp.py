"""Run an exported GGUF file in llama.cpp itself (through llama-cpp-python's C bindings, the
optional `peer` extra): greedy tokens for many sequences in one batch, prefill, tokenization
and the chat template, to check an export against `forward` and to benchmark against it.

Extra buffer types (llama.cpp's weight repacking into its batched layouts, and the AMX buffer
type on Intel CPUs) are off unless `load` is asked for them (`repack`): on an AMX machine that
buffer type crashed on Q8_0 weights. llama.cpp's own programs have them on, so the benchmark's
peer does too wherever that crash cannot happen (programs/benchmark/peer_llamacpp.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ImportError(
            'llama.cpp is not installed: pip install -e ".[peer]" (compiles llama.cpp, minutes)'
        ) from None
    return llama_cpp


@dataclass(frozen=True)
class LlamaCpp:
    """A loaded GGUF model and one context for up to `n_seq` sequences at once."""

    model: object
    context: object
    batch: object
    batch_size: int
    n_seq: int
    n_vocab: int


_QUIET = None  # the ctypes callback must outlive every call into llama.cpp


def quiet_logs() -> None:
    """Send llama.cpp's log lines nowhere (they go to stderr otherwise)."""
    global _QUIET
    lib = _llama_cpp()
    if _QUIET is None:
        _QUIET = lib.llama_log_callback(lambda level, text, user_data: None)
        lib.llama_log_set(_QUIET, ctypes.c_void_p(0))


def system_info() -> str:
    """The instruction sets and features this llama.cpp was built with ("AVX2 = 1 | ...")."""
    return _llama_cpp().llama_print_system_info().decode()


def load(
    path,
    threads: int,
    n_ctx: int = 512,
    n_seq: int = 1,
    batch_size: int = 512,
    exact: bool = True,
    repack: bool = False,
) -> LlamaCpp:
    """Load a GGUF file. n_ctx: K/V cells of each of the n_seq sequences (each has its own, so a
    sequence attends over its own cells only); batch_size: the most tokens one call takes (a
    prefill of every prompt at once must fit). exact: K/V in float32 and flash attention off,
    so an F32 file computes what our float32 forward computes (llama.cpp's defaults,
    exact=False, keep K/V in float16 and its CPU flash attention rounds through float16: logits
    differ by ~1e-3 relative). repack: llama.cpp's extra buffer types, its default (see the
    top)."""
    lib = _llama_cpp()
    lib.llama_backend_init()
    mparams = lib.llama_model_default_params()
    mparams.use_extra_bufts = repack
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = n_ctx * n_seq
    cparams.n_seq_max = n_seq
    cparams.kv_unified = False
    cparams.n_batch, cparams.n_ubatch = batch_size, min(batch_size, 512)
    cparams.n_threads = cparams.n_threads_batch = threads
    if exact:
        cparams.type_k = cparams.type_v = lib.GGML_TYPE_F32
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    context = lib.llama_init_from_model(model, cparams)
    if not context:
        raise RuntimeError(f"llama.cpp could not make a context for {path}")
    batch = lib.llama_batch_init(batch_size, 0, 1)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    return LlamaCpp(model, context, batch, batch_size, n_seq, n_vocab)


def close(m: LlamaCpp) -> None:
    lib = _llama_cpp()
    lib.llama_batch_free(m.batch)
    lib.llama_free(m.context)
    lib.llama_model_free(m.model)


def _decode(m: LlamaCpp, entries: list[tuple[int, int, int, bool]]) -> None:
    """One llama_decode over (token, position, sequence, wants_logits) entries; llama.cpp
    splits it into micro-batches itself and keeps every row of logits asked for."""
    lib = _llama_cpp()
    if len(entries) > m.batch_size:
        raise ValueError(f"{len(entries)} tokens in one call; this context takes {m.batch_size}")
    b = m.batch
    b.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq
    if lib.llama_decode(m.context, b) != 0:
        raise RuntimeError("llama_decode failed (is the context large enough?)")


def _logits(m: LlamaCpp, rows: int) -> np.ndarray:
    """The rows of logits the last decode asked for, [rows, n_vocab], a view into llama.cpp."""
    lib = _llama_cpp()
    return np.ctypeslib.as_array(lib.llama_get_logits(m.context), shape=(rows, m.n_vocab))


def reset(m: LlamaCpp) -> None:
    """Forget every sequence's K/V."""
    lib = _llama_cpp()
    lib.llama_memory_clear(lib.llama_get_memory(m.context), True)


def prompt_logits(m: LlamaCpp, prompts: list[list[int]]) -> np.ndarray:
    """Prefill each prompt as its own sequence, all in one batch -> the logits after each
    prompt's last token, [len(prompts), n_vocab] float32 (a copy)."""
    if len(prompts) > m.n_seq:
        raise ValueError(f"{len(prompts)} prompts but the context holds {m.n_seq} sequences")
    reset(m)
    _decode(
        m,
        [
            (token, pos, seq, pos == len(p) - 1)
            for seq, p in enumerate(prompts)
            for pos, token in enumerate(p)
        ],
    )
    return _logits(m, len(prompts)).copy()


def greedy(m: LlamaCpp, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens after each prompt, all sequences decoded together one token a step
    (nothing stops early: every sequence gets n tokens)."""
    logits = prompt_logits(m, prompts)
    out = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(n - 1):
        entries = [
            (seq_out[-1], len(p) + len(seq_out) - 1, seq, True)
            for seq, (p, seq_out) in enumerate(zip(prompts, out))
        ]
        _decode(m, entries)
        for seq_out, t in zip(out, _logits(m, len(prompts)).argmax(-1)):
            seq_out.append(int(t))
    return out


def tokenize(m: LlamaCpp, text: str) -> list[int]:
    """llama.cpp's tokenization of text, special-token text parsed as special tokens."""
    lib = _llama_cpp()
    raw = text.encode()
    room = len(raw) + 8
    ids = (lib.llama_token * room)()
    vocab = lib.llama_model_get_vocab(m.model)
    n = lib.llama_tokenize(vocab, raw, len(raw), ids, room, False, True)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needed {-n} slots")
    return list(ids[:n])


def chat_template(m: LlamaCpp) -> str | None:
    """The chat template stored in the file, as llama.cpp reads it."""
    lib = _llama_cpp()
    text = lib.llama_model_chat_template(m.model, None)
    return text.decode() if text else None


def apply_chat_template(template: str, messages: list[dict], add_generation_prompt=True) -> str:
    """llama.cpp's own (C++) rendering of a conversation with the given template."""
    lib = _llama_cpp()
    chat = (lib.llama_chat_message * len(messages))(
        *[lib.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages]
    )
    size = 4096 + sum(len(m["content"]) * 2 for m in messages)
    out = ctypes.create_string_buffer(size)
    n = lib.llama_chat_apply_template(
        template.encode(), chat, len(messages), add_generation_prompt, out, size
    )
    if n < 0:
        raise ValueError("llama.cpp does not recognise this chat template")
    return out.raw[:n].decode()
