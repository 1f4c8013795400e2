"""Published chat templates render exactly as transformers renders them, and raise where it raises.

The templates are files in tests/chat_templates/ (SOURCES.md names the repository, path and
commit each was copied from). For every template, every conversation below is rendered with and
without tools and a generation prompt, by our Tokenizer and by a transformers tokenizer built
from the same tiny `tokenizers` backend (no download); the strings must be equal, or both must
fail with the same kind of error.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from astrai.tokenizer import Tokenizer

TEMPLATE_DIR = Path(__file__).parent / "chat_templates"
TEMPLATES = sorted(TEMPLATE_DIR.glob("*.jinja"))

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["c", "f"], "description": "Degrees in"},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "now",
        "description": "The time.",
        "parameters": {"type": "object", "properties": {}},
    },
}
CALL_ID = "call_abc123xyz"  # Mistral wants ids of 9 characters or more


def call(arguments, name="get_weather", call_id=CALL_ID) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


USER = {"role": "user", "content": "What is the weather in Paris?"}
SYSTEM = {"role": "system", "content": "You are terse. <|im_end|> is just text."}
CONVERSATIONS = {
    "user": [USER],
    "system-user": [SYSTEM, USER],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Tell me a joke.  \n"},
    ],
    "assistant-last": [USER, {"role": "assistant", "content": "It is sunny."}],
    "tool-call-json-text": [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "22 C"},
    ],
    "tool-call-dict": [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [call({"city": "Paris"})]},
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "22 C"},
        {"role": "assistant", "content": "22 degrees and sunny."},
    ],
    "two-calls": [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call('{"city": "Paris"}'),
                call("{}", name="now", call_id="call_987654321"),
            ],
        },
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_987654321", "name": "now", "content": "noon"},
    ],
    "content-parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Two."}],
        },
    ],
    "reasoning": [
        USER,
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
        {"role": "user", "content": "Thanks!"},
    ],
    "think-in-content": [
        USER,
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nSunny."},
        {"role": "user", "content": "And tomorrow?"},
    ],
    "unicode": [{"role": "user", "content": '天气? ☀️ "quotes" & <tags> {braces}'}],
    "no-alternation": [USER, {"role": "user", "content": "Hello?"}],
    "tool-without-name": [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "22 C"},
    ],
}
TOOLS = {"no tools": None, "tools": [WEATHER, CLOCK]}
FLAGS = {"prompt": {"add_generation_prompt": True}, "closed": {"add_generation_prompt": False}}


@pytest.fixture(scope="module")
def backend():
    return Tokenizer.train(["What is the weather in Paris? It is sunny."], vocab_size=300).backend


def ours_and_theirs(backend, template) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    ours = Tokenizer(
        backend,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )
    theirs = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    theirs.chat_template = template
    return ours, theirs


def outcome(render) -> tuple[str, str]:
    """("ok", text) or ("error", the exception's type name)."""
    try:
        return "ok", render()
    except Exception as exc:
        return "error", type(exc).__name__


def compare(ours, theirs, messages, tools, **flags) -> tuple[str, str]:
    # each side gets its own copy: a template may not change the caller's messages
    mine = outcome(lambda: ours.apply_chat_template(copy.deepcopy(messages), tools=tools, **flags))
    reference = outcome(
        lambda: theirs.apply_chat_template(
            copy.deepcopy(messages), tools=tools, tokenize=False, **flags
        )
    )
    assert mine == reference, (messages, tools, flags)
    return mine


COUNT = {"renderings": 0, "equal strings": 0, "same error": 0}


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_published_templates_render_as_transformers_does(backend, path):
    ours, theirs = ours_and_theirs(backend, path.read_text(encoding="utf-8"))
    rendered = 0
    for messages in CONVERSATIONS.values():
        for tools in TOOLS.values():
            for flags in FLAGS.values():
                kind, _ = compare(ours, theirs, messages, tools, **flags)
                COUNT["renderings"] += 1
                COUNT["equal strings" if kind == "ok" else "same error"] += 1
                rendered += kind == "ok"
    assert rendered >= len(CONVERSATIONS)  # most conversations are rendered, not refused


DOCUMENTS = [
    {"doc_id": 1, "title": "Paris", "text": "Sunny, 22 C."},
    {"doc_id": 2, "title": "Lyon", "text": "Rain all day."},
]
# Arguments beyond the messages: retrieval documents, switches and strings that published
# templates read (Qwen3's enable_thinking, Llama 3's date_string and custom_tools, Granite's
# controls), special tokens overridden by the caller, and names no template knows.
EXTRAS = {
    "documents": {"documents": DOCUMENTS},
    "thinking off": {"enable_thinking": False},
    "thinking on": {"enable_thinking": True, "thinking": True},
    "date": {"date_string": "01 Dec 2026"},
    "llama custom tools": {"custom_tools": [WEATHER], "tools_in_user_message": True},
    "controls": {"controls": {"citations": True, "length": "short"}},
    "special tokens": {"bos_token": "<s>", "eos_token": "</s>"},
    "arbitrary": {"anything": ["a", 1, None], "nested": {"x": (1, 2.5)}},
}


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_extra_template_arguments_reach_published_templates_as_in_transformers(backend, path):
    ours, theirs = ours_and_theirs(backend, path.read_text(encoding="utf-8"))
    rendered = 0
    for extra in EXTRAS.values():
        for name in ("system-user", "tool-call-dict"):
            for tools in TOOLS.values():
                kind, _ = compare(
                    ours, theirs, CONVERSATIONS[name], tools, add_generation_prompt=True, **extra
                )
                rendered += kind == "ok"
    assert rendered >= len(EXTRAS)


def test_llama_reads_date_string_and_custom_tools(backend):
    """The published arguments change what a published template writes, here as in
    transformers (the comparison above)."""
    ours, _ = ours_and_theirs(backend, (TEMPLATE_DIR / "llama3.2-tools.jinja").read_text())
    dated = ours.apply_chat_template([USER], date_string="01 Dec 2026")
    assert "Today Date: 01 Dec 2026" in dated
    with_tools = ours.apply_chat_template(
        [USER], custom_tools=[WEATHER], tools_in_user_message=True
    )
    assert "get_weather" in with_tools and "get_weather" not in dated


# What a retrieval-augmented template (as Granite's) reads: documents with ids, a controls dict,
# a thinking switch, a date, and the tools.
RAG_TEMPLATE = """\
{%- set date = date_string if date_string is defined else 'no date' -%}
<system>{{ date }}{% if enable_thinking %} think first{% endif %}\
{% if 'citations' in controls %} cite documents{% endif %}</system>
{%- for tool in tools or [] %}
<tool>{{ tool.function.name }}</tool>
{%- endfor %}
{%- for document in documents or [] %}
<document id="{{ document['doc_id'] | string }}" title="{{ document.title }}">\
{{ document['text'] }}</document>
{%- endfor %}
{%- for message in messages %}
<{{ message.role }}>{{ message.content }}</{{ message.role }}>
{%- endfor %}
{%- if add_generation_prompt %}
<assistant>{% if controls %}{{ controls | tojson }}{% endif %}{% endif %}"""


def test_documents_and_extra_arguments_reach_a_retrieval_template(backend):
    ours, theirs = ours_and_theirs(backend, RAG_TEMPLATE)
    extra = {"controls": {"citations": True}, "enable_thinking": True, "date_string": "Dec 1"}
    flags = {"add_generation_prompt": True, "documents": DOCUMENTS, **extra}
    text = compare(ours, theirs, [USER], [WEATHER], **flags)[1]
    assert text == (
        "<system>Dec 1 think first cite documents</system>"
        "<tool>get_weather</tool>"
        '<document id="1" title="Paris">Sunny, 22 C.</document>'
        '<document id="2" title="Lyon">Rain all day.</document>'
        "<user>What is the weather in Paris?</user>"
        '<assistant>{"citations": true}'
    )
    plain = compare(ours, theirs, [USER], None, add_generation_prompt=False)[1]
    assert plain == "<system>no date</system><user>What is the weather in Paris?</user>"
    # the SFT pieces of a conversation rendered with documents add up to that rendering
    answer = [USER, {"role": "assistant", "content": "Sunny."}]
    pieces = ours.chat_segments(answer, documents=DOCUMENTS, **extra)
    assert "".join(t for t, _ in pieces) == ours.apply_chat_template(
        answer, add_generation_prompt=False, documents=DOCUMENTS, **extra
    )
    assert [t for t, role in pieces if role == "assistant"] == ["Sunny.</assistant>"]


class Level(int, enum.Enum):
    HIGH = 3


@dataclasses.dataclass
class Place:
    city: str
    rank: int


def test_rich_values_reach_the_template_as_plain_data_as_in_transformers(backend):
    """transformers rebuilds what a template sees from plain JSON types (an enum as its value,
    dataclasses as dicts, anything else as a placeholder naming its type): the same here."""
    template = (
        "{{ level }}|{{ pair }}|{{ place.city }}{{ place.rank + 1 }}|{{ count + 1 }}|{{ obj }}|"
        "{{ messages[0].content }}|{{ documents[0].source }}"
    )
    ours, theirs = ours_and_theirs(backend, template)
    values = {
        "level": Level.HIGH,
        "pair": (1, Level.HIGH),
        "place": Place("Paris", 2),
        "count": np.int64(41),
        "obj": object(),
    }
    messages = [{"role": "user", "content": Level.HIGH}]
    documents = [{"source": Place("Lyon", 1), "text": "x"}]
    text = compare(ours, theirs, messages, None, documents=documents, **values)[1]
    assert text == "3|(1, 3)|Paris3|42|<object>|3|{'city': 'Lyon', 'rank': 1}"


def test_documents_must_be_dicts(backend):
    ours, theirs = ours_and_theirs(backend, RAG_TEMPLATE)
    compare(ours, theirs, [USER], None, documents=["just text"])  # both a TypeError
    with pytest.raises(TypeError, match=r"documents\[0\] must be a dict"):
        ours.apply_chat_template([USER], documents=["just text"])


def test_the_templates_cover_the_families():
    names = " ".join(p.stem for p in TEMPLATES)
    for family in ("llama", "mistral", "gemma", "phi", "deepseek", "hermes", "granite", "qwen"):
        assert family in names, family
    sources = (Path(__file__).parent / "chat_templates" / "SOURCES.md").read_text()
    assert all(p.name in sources for p in TEMPLATES)


def test_named_templates_pick_tool_use_when_tools_are_passed(backend):
    hermes = (Path(__file__).parent / "chat_templates" / "hermes-tools.jinja").read_text()
    named = {"default": Tokenizer.train(["a"], vocab_size=260).chat_template, "tool_use": hermes}
    ours, theirs = ours_and_theirs(backend, named)
    for tools in TOOLS.values():
        for messages in (CONVERSATIONS["system-user"], CONVERSATIONS["tool-call-dict"]):
            compare(ours, theirs, messages, tools, add_generation_prompt=True)
    assert "function calling AI model" in ours.apply_chat_template([USER], tools=[WEATHER])
    assert "function calling AI model" not in ours.apply_chat_template([USER])
    ours.chat_template = {"tool_use": hermes}
    with pytest.raises(ValueError, match="default"):
        ours.apply_chat_template([USER])


def test_named_templates_survive_save_and_load(backend, tmp_path):
    named = {"default": "{{ messages[0].content }}", "tool_use": "tools: {{ tools | length }}"}
    ours, _ = ours_and_theirs(backend, named)
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == [
        {"name": "default", "template": named["default"]},
        {"name": "tool_use", "template": named["tool_use"]},
    ]
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.apply_chat_template([USER], tools=[WEATHER]) == "tools: 1"
    assert loaded.apply_chat_template([USER]) == USER["content"]


# ChatML whose assistant turns are marked with transformers' {% generation %} tag.
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_generation_blocks_mark_what_transformers_masks(backend):
    ours, theirs = ours_and_theirs(backend, GENERATION_TEMPLATE)
    for name in ("multi-turn", "assistant-last", "tool-call-dict", "reasoning"):
        messages = CONVERSATIONS[name]
        compare(ours, theirs, messages, None, add_generation_prompt=False)
        text, spans = ours.generation_spans(messages)
        assert text == ours.apply_chat_template(messages, add_generation_prompt=False)
        out = theirs.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
        assert theirs.decode(masked) == "".join(text[s:e] for s, e in spans), name
        # the SFT pieces train exactly the marked text
        pieces = ours.chat_segments(messages)
        assert "".join(t for t, _ in pieces) == text
        trained = "".join(t for t, role in pieces if role == "assistant")
        assert trained == "".join(text[s:e] for s, e in spans)
        assistants = [m["content"] for m in messages if m["role"] == "assistant"]
        assert trained == "".join(c + "<|im_end|>" for c in assistants)
