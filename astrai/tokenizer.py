"""Tokenizer: a thin wrapper over a `tokenizers.Tokenizer`, jinja2 chat templates and a streaming
detokenizer.

Our own tokenizers are byte-level BPE with the ChatML special tokens; folders written by
`save_pretrained` load in Hugging Face `AutoTokenizer`, and Hugging Face tokenizer folders load
here (tokenizer.json, tokenizer_config.json, chat template, generation_config.json stop ids).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, trainers

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# End-of-turn tokens of the common chat formats (ChatML, Llama 3, Gemma, Phi-3): generation stops
# on any of them that the vocabulary holds, whatever the checkpoint declares as eos.
CHAT_END_TOKENS = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>"]

# ChatML, with tools in the Hermes / Qwen style: signatures as JSON in the system turn, calls as
# JSON inside <tool_call> tags, results in a "tool" turn. Rendering a longer conversation only
# appends to the rendering of a shorter one, which `chat_segments` relies on.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query. The"
    " function signatures are given within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name and"
    ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name":'
    ' <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not (tools and loop.first) %}"
    "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}"
    "{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# The same environment transformers renders chat templates in, so Hugging Face templates render
# identically here.
_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _ENV.from_string(template)


def _token_name(value) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts
    return value.get("content") if isinstance(value, dict) else value


def _normalize_message(message: dict) -> dict:
    # Templates concatenate content as a string: join text parts, and None (an assistant turn
    # holding only tool calls) becomes "".
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "\n".join(p["text"] for p in content if p.get("type", "text") == "text")
    return {**message, "content": content}


class Tokenizer:
    """Text <-> token ids, chat templates and streaming decoding over a `tokenizers.Tokenizer`.

    `backend` is the `tokenizers.Tokenizer` itself, for anything not wrapped here.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self._extra_stop_ids = tuple(extra_stop_ids)

    # ---------------------------------------------------------------- construction and files

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        special_tokens: list[str] | None = None,
        min_frequency: int = 2,
        split_digits: bool = False,
    ) -> Tokenizer:
        """Train a byte-level BPE tokenizer. The first special token (default "<|endoftext|>")
        serves as bos, eos and pad; any text round-trips through encode/decode.

        split_digits keeps every digit its own token, which makes arithmetic far easier to learn.
        """
        specials = list(CHATML_SPECIALS if special_tokens is None else special_tokens)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + len(specials):
            raise ValueError(
                f"vocab_size={vocab_size} is too small: the 256 byte tokens and "
                f"{len(specials)} special tokens need at least {len(alphabet) + len(specials)}"
            )
        backend = tokenizers.Tokenizer(models.BPE())
        # no prefix space: decode(encode(s)) must give back s exactly
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if split_digits
            else byte_level
        )
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=alphabet,  # every byte has a token, so nothing is ever unknown
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        first = specials[0] if specials else None
        return cls(backend, bos_token=first, eos_token=first, pad_token=first)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a folder written by `save_pretrained` or a Hugging Face tokenizer folder."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in this folder")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # older Hugging Face form: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (path / "chat_template.jinja").is_file():  # newer Hugging Face form
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        eos_ids = _read_json(path / "generation_config.json").get("eos_token_id")
        return cls(
            backend,
            bos_token=_token_name(config.get("bos_token")),
            eos_token=_token_name(config.get("eos_token")),
            pad_token=_token_name(config.get("pad_token")),
            chat_template=template,
            extra_stop_ids=[eos_ids] if isinstance(eos_ids, int) else eos_ids or (),
        )

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (loadable by transformers too)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (path / "tokenizer_config.json").write_text(text, encoding="utf-8")

    # ---------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        eos = self._id(self.eos_token)
        # a Hugging Face folder may name its eos only in generation_config.json
        return eos if eos is not None else next(iter(self._extra_stop_ids), None)

    @property
    def pad_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, the chat end-of-turn tokens in the vocabulary, and the
        eos ids of generation_config.json."""
        ids = {self._id(t) for t in [self.eos_token, *CHAT_END_TOKENS]} - {None}
        return frozenset(ids.union(self._extra_stop_ids))

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token text inside `text` (e.g. "<|im_end|>") becomes the special token;
        `add_special_tokens` applies the tokenizer's post-processor (a Hugging Face Llama
        tokenizer prepends bos; ours has none)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use
        fast = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in fast(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # tensors and arrays too
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    # ---------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_vars: Any,
    ) -> str:
        """Render a conversation as text. Messages are {"role", "content"} dicts (content a
        string or a list of {"type": "text", "text": ...} parts); assistant messages may carry
        "tool_calls". Extra keyword arguments (e.g. enable_thinking) go to the template."""
        return _compile(self.chat_template).render(
            messages=[_normalize_message(m) for m in messages],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **template_vars,
        )

    def chat_segments(self, messages: list[dict], tools=None) -> list[tuple[str, str]]:
        """Cut `apply_chat_template(messages, add_generation_prompt=False)` into (text, role)
        pieces whose concatenation is exactly that rendering.

        Every assistant message gives exactly one "assistant" piece, in order: its content and
        tool calls up to and including its end-of-turn token. The header the template writes
        before an assistant turn, and what follows its end-of-turn token, are "template"; text
        of other messages keeps their role. Found by rendering prefixes of the conversation and
        diffing, so it works for any template; one that rewrites earlier turns (e.g. drops
        old reasoning) only shifts piece boundaries, and the pieces still add up.
        """
        full = self.apply_chat_template(messages, add_generation_prompt=False, tools=tools)

        def boundary(k: int, prompt: bool) -> int:
            try:
                text = self.apply_chat_template(messages[:k], prompt, tools)
            except Exception:  # some templates refuse an empty or unfinished conversation
                text = ""
            return _common_prefix_len(text, full)

        stop_texts = [self.decode([i], skip_special_tokens=False) for i in self.stop_ids]
        pieces = []
        start = boundary(0, False)
        pieces.append((full[:start], "template"))
        for k, message in enumerate(messages):
            last = k == len(messages) - 1
            end = len(full) if last else max(start, boundary(k + 1, False))
            if message["role"] != "assistant":
                pieces.append((full[start:end], message["role"]))
            else:
                head = min(max(start, boundary(k, True)), end)
                turn = full[head:end]
                cut = max((turn.rfind(s) + len(s) for s in stop_texts if s in turn), default=0)
                cut = head + (cut or len(turn))
                pieces += [
                    (full[start:head], "template"),
                    (full[head:cut], "assistant"),
                    (full[cut:end], "template"),
                ]
            start = end
        return [(text, role) for text, role in pieces if text or role == "assistant"]


class StreamDecoder:
    """Token ids in, text deltas out, one token at a time.

    Only a short window of recent ids is decoded per token: `_ids` starts at the "prefix
    offset" (already emitted ids kept as context, so decoders that treat the start of a text
    specially see the same context as a full decode), and `_read` marks how much of it has been
    emitted. Text ending in U+FFFD is an incomplete UTF-8 character and is held back.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._read :]  # the window slides: emitted text is never re-decoded
        self._read = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Emit what is held back (a truly broken character comes out as U+FFFD) and reset."""
        delta = self._decode(self._ids)[len(self._decode(self._ids[: self._read])) :]
        self._ids, self._read = [], 0
        return delta


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):  # the usual case: a template that only appends
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
