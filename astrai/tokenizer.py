"""Tokenizer: a thin wrapper over a `tokenizers.Tokenizer`, jinja2 chat templates and a streaming
detokenizer.

Our own tokenizers are byte-level BPE with the ChatML special tokens; folders written by
`save_pretrained` load in Hugging Face `AutoTokenizer`, and Hugging Face tokenizer folders load
here (tokenizer.json, tokenizer_config.json, chat template, generation_config.json stop ids).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, trainers

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# End-of-turn tokens of the common chat formats (ChatML, Llama 3, Gemma, Phi-3): generation stops
# on any of them that the vocabulary holds, whatever the checkpoint declares as eos.
CHAT_END_TOKENS = [
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>",
]  # fmt: skip

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
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- elif message.content %}"
    "{%- set content = message.content | selectattr('text', 'defined')"
    " | map(attribute='text') | join('\\n') %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if message.role == 'system' %}"
    "{%- if not (tools and loop.first) %}"
    "{{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}"
    "{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
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


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names (a way out of the sandbox), as
    transformers' is."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


# While `_TRACK` is true in the render context, {% generation %} blocks come out wrapped in
# these two private-use characters, which `generation_spans` turns into offsets and removes.
_TRACK = "astrai_track_generation"
_GEN_START, _GEN_END = "\ue000", "\ue001"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: marks the text the assistant
    writes (what `return_assistant_tokens_mask` trains on); renders as its body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        track = nodes.Name(_TRACK, "load")
        return nodes.CallBlock(self.call_method("_mark", [track]), [], [], body).set_lineno(lineno)

    def _mark(self, track, caller):
        text = caller()
        return f"{_GEN_START}{text}{_GEN_END}" if track is True else text


# The same environment transformers renders chat templates in, so Hugging Face templates render
# identically here.
_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
_ENV.globals["namespace"] = _Namespace


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _ENV.from_string(template)


def _token_name(value) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} dicts
    return value.get("content") if isinstance(value, dict) else value


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value):
    """What a template may see of a value, as transformers rebuilds it: JSON types (subclasses
    such as enums stripped to their base type), mappings, lists and tuples rebuilt from them,
    dataclasses and Pydantic models as dicts, and anything else as a placeholder naming its
    type ("<ndarray>"): a rich object's methods are a way out of the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _template_message(message) -> dict:
    """A message as transformers hands it to the template: plain data (a dataclass or Pydantic
    message becomes a dict), keys holding None dropped (templates test for a missing key, not
    for None), content as given (a string or a list of parts), and reasoning under each name
    templates read it by."""
    message = _plain(message)
    if not isinstance(message, dict):
        raise TypeError(f"a chat message must be a dict, got {message!r}")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def reads_content_parts(template: str) -> bool:
    """Whether a template loops over a message's content (a list of typed parts, as OpenAI
    sends it) rather than printing it as one string."""
    return (
        re.search(r"for \w+ in (message|msg|m)(\.content|\[['\"]content['\"]\])", template)
        is not None
    )


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
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}
        if (path / "chat_template.jinja").is_file():  # newer Hugging Face form
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        # a model folder may list its stop ids in config.json only (Gemma 3's [1, 106])
        eos_ids = [
            i
            for name in ("generation_config.json", "config.json")
            for i in _as_list(_read_json(path / name).get("eos_token_id"))
        ]
        return cls(
            backend,
            bos_token=_token_name(config.get("bos_token")),
            eos_token=_token_name(config.get("eos_token")),
            pad_token=_token_name(config.get("pad_token")),
            chat_template=template,
            extra_stop_ids=list(dict.fromkeys(eos_ids)),
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
            "chat_template": (
                [{"name": k, "template": v} for k, v in self.chat_template.items()]
                if isinstance(self.chat_template, dict)
                else self.chat_template
            ),
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
        eos ids of generation_config.json and config.json."""
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

    def template_for(self, tools: list[dict] | None = None) -> str:
        """The template to render: `chat_template` itself, or, where it is a dict of named
        templates, "tool_use" when tools are given and else "default" (as transformers picks)."""
        named = self.chat_template
        if isinstance(named, str):
            return named
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ValueError(
            f"This tokenizer has several chat templates ({', '.join(named)}) and none named "
            "`default`; choose one with `tokenizer.chat_template = ...`."
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_vars: Any,
    ) -> str:
        """Render a conversation as text, exactly as transformers' `apply_chat_template(...,
        tokenize=False)` does. Messages are {"role", "content"} dicts (content a string or a
        list of parts, handed to the template as given); assistant messages may carry
        "tool_calls". `tools` are JSON schemas, `documents` dicts for retrieval-augmented
        templates (e.g. {"title", "text"}); extra keyword arguments (enable_thinking,
        date_string, ...) go to the template as variables, overriding the special tokens."""
        return self._render(messages, add_generation_prompt, tools, documents, template_vars)

    def generation_spans(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_vars: Any,
    ) -> tuple[str, list[tuple[int, int]]]:
        """(rendering, [(start, end), ...]): the conversation rendered without a generation
        prompt, and the character spans its `{% generation %}` blocks cover (what transformers'
        `return_assistant_tokens_mask` marks). No spans for a template without the tag."""
        marked = self._render(messages, False, tools, documents, {**template_vars, _TRACK: True})
        if _GEN_START in "".join(str(m.get("content", "")) for m in messages):
            raise ValueError("a message contains U+E000, which marks generation blocks")
        spans, text, at = [], [], 0
        for piece in re.split(f"({_GEN_START}|{_GEN_END})", marked):
            if piece == _GEN_START:
                start = at
            elif piece == _GEN_END:
                spans.append((start, at))
            else:
                text.append(piece)
                at += len(piece)
        return "".join(text), spans

    def _render(
        self, messages, add_generation_prompt, tools, documents, template_vars, empty=False
    ) -> str:
        """The template rendered with what transformers hands it: the messages, tools,
        documents, generation prompt flag, and the special tokens overridden by the caller's
        variables, all as plain data."""
        if not messages and not empty:  # as transformers; chat_segments renders [] to diff
            raise ValueError("Cannot apply a chat template to an empty conversation.")
        for i, document in enumerate(documents or ()):
            if not isinstance(document, dict):
                raise TypeError(
                    f"documents[{i}] must be a dict (e.g. title and text), got {document!r}"
                )
        for i, tool in enumerate(tools or ()):
            if not isinstance(tool, dict):
                raise TypeError(f"tools[{i}] must be a JSON schema dict, got {tool!r}")
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
        }
        variables = {**{k: v for k, v in special.items() if v is not None}, **template_vars}
        return _compile(self.template_for(tools)).render(
            messages=[_template_message(m) for m in messages],
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )

    def chat_segments(
        self, messages: list[dict], tools=None, documents=None, **template_vars: Any
    ) -> list[tuple[str, str]]:
        """Cut `apply_chat_template(messages, add_generation_prompt=False, tools=tools,
        documents=documents, **template_vars)` into (text, role) pieces whose concatenation is
        exactly that rendering.

        Every assistant message gives exactly one "assistant" piece, in order: its content and
        tool calls up to and including its end-of-turn token. The header the template writes
        before an assistant turn, and what follows its end-of-turn token, are "template"; text
        of other messages keeps their role. Found by rendering prefixes of the conversation and
        diffing, so it works for any template; one that rewrites earlier turns (e.g. drops
        old reasoning) only shifts piece boundaries, and the pieces still add up.

        A template with `{% generation %}` blocks says itself what the assistant writes: then
        exactly the text of those blocks is "assistant", as in transformers' assistant masks.
        """
        if not messages:
            return []
        context = (tools, documents, template_vars)
        full = self._render(messages, False, *context)

        def boundary(k: int, prompt: bool) -> int:
            try:
                text = self._render(messages[:k], prompt, *context, empty=True)
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
        if _GENERATION_TAG.search(self.template_for(tools)):
            spans = self.generation_spans(messages, tools, documents, **template_vars)[1]
            pieces = _relabel(pieces, spans)
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


def _relabel(pieces: list[tuple[str, str]], spans: list[tuple[int, int]]) -> list:
    """Pieces cut again at the spans' ends: inside a span "assistant", outside it the piece's
    own role, or "template" where that was "assistant"."""
    cuts = sorted({0, *(c for span in spans for c in span)})
    out, at = [], 0
    for text, role in pieces:
        inner = [c - at for c in cuts if at < c < at + len(text)]
        for a, b in zip([0, *inner], [*inner, len(text)]):
            inside = any(s <= at + a < e for s, e in spans)
            out.append(
                (
                    text[a:b],
                    "assistant" if inside else ("template" if role == "assistant" else role),
                )
            )
        at += len(text)
    return out


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):  # the usual case: a template that only appends
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [ids] if isinstance(ids, int) else list(ids or ())


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
