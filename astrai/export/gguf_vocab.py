"""A byte-level BPE tokenizer as GGUF's `tokenizer.ggml.*` fields.

llama.cpp re-implements the tokenizer from these fields: the token strings (in the byte-level
alphabet, exactly as tokenizer.json holds them), the merges in priority order, each token's
kind, the special ids, and `tokenizer.ggml.pre`, the name of the regex split llama.cpp applies
before BPE. Only splits llama.cpp knows by name can go out; anything else is an error rather
than a file that tokenizes differently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from astrai.tokenizer import CHAT_END_TOKENS

# GGUF token kinds (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class GGUFVocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str  # llama.cpp's pre-tokenizer name
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    eot_id: int | None = None  # end of a chat turn: llama.cpp stops there
    chat_template: str | None = None


def pre_tokenizer_name(pre: dict | None) -> str:
    """tokenizer.json's pre_tokenizer -> the llama.cpp pre-tokenizer that splits the same way:
    plain byte-level is GPT-2's regex ("gpt-2"); single digits first, then GPT-2's regex, is
    what SmolLM's tokenizer does ("smollm")."""

    def byte_level(p: dict) -> bool:
        return p.get("type") == "ByteLevel" and p.get("use_regex", True)

    if pre and byte_level(pre) and not pre.get("add_prefix_space"):
        return "gpt-2"
    pre = pre or {}
    steps = pre.get("pretokenizers", [])
    if (
        pre.get("type") == "Sequence"
        and len(steps) == 2
        and steps[0] == {"type": "Digits", "individual_digits": True}
        and byte_level(steps[1])
        and not steps[1].get("add_prefix_space")
    ):
        return "smollm"
    raise ValueError(
        f"tokenizer.json pre_tokenizer {json.dumps(pre)} has no llama.cpp equivalent; GGUF "
        "export supports byte-level BPE (optionally with single-digit splitting)"
    )


def _merge_text(merge) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)  # newer files store pairs


def gguf_vocab(tokenizer, vocab_size: int) -> GGUFVocab | None:
    """The GGUF vocabulary of `tokenizer` (an astrai Tokenizer) padded to the model's
    vocab_size; None for no tokenizer."""
    if tokenizer is None:
        return None
    spec = json.loads(tokenizer.backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"GGUF export supports BPE tokenizers; this one is {model.get('type')}")
    if spec.get("normalizer"):
        raise ValueError(f"tokenizer.json normalizer {spec['normalizer']} has no llama.cpp equivalent")  # fmt: skip
    pre = pre_tokenizer_name(spec.get("pre_tokenizer"))
    by_id = {i: t for t, i in tokenizer.backend.get_vocab(with_added_tokens=True).items()}
    if max(by_id) >= vocab_size:
        raise ValueError(
            f"the tokenizer has ids up to {max(by_id)} but the model's vocab_size is {vocab_size}"
        )
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # the embedding has rows no token uses
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        tokens.append(by_id[i])
        types.append(NORMAL if i not in added else CONTROL if added[i]["special"] else USER_DEFINED)
    end_ids = [tokenizer.token_to_id(t) for t in CHAT_END_TOKENS]
    eot = next((i for i in end_ids if i is not None and i != tokenizer.eos_id), None)
    return GGUFVocab(
        tokens=tokens,
        types=types,
        merges=[_merge_text(m) for m in model.get("merges", [])],
        pre=pre,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        eot_id=eot,
        chat_template=tokenizer.chat_template,
    )


def write_vocab(writer, vocab: GGUFVocab | None) -> None:
    """Add the tokenizer.ggml.* and tokenizer.chat_template keys to a gguf.GGUFWriter. No
    vocabulary is llama.cpp's "none" tokenizer: vocab_size token ids that encode no text."""
    if vocab is None:
        writer.add_tokenizer_model("none")
        return
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for value, add in (
        (vocab.bos_id, writer.add_bos_token_id),
        (vocab.eos_id, writer.add_eos_token_id),
        (vocab.pad_id, writer.add_pad_token_id),
        (vocab.eot_id, writer.add_eot_token_id),
    ):
        if value is not None:
            add(value)
    # our tokenizers add no bos or eos on their own; the chat template writes what it needs
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
