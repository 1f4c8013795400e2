import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.tokenizer import DEFAULT_CHAT_TEMPLATE, StreamDecoder, Tokenizer

WORDS = [
    "the",
    "a",
    "model",
    "learns",
    "to",
    "write",
    "text",
    "one",
    "token",
    "at",
    "time",
    "stops",
]
CHINESE = ["我们", "训练", "一个", "小型", "语言", "模型", "今天", "天气", "很好", "你好", "世界"]
EMOJI = ["😀", "🚀", "🌍", "👍🏽", "❤️", "👨‍👩‍👧"]


def corpus(n=400, seed=0):
    rng = random.Random(seed)
    pool = WORDS * 3 + CHINESE * 2 + EMOJI
    for _ in range(n):
        yield " ".join(rng.choice(pool) for _ in range(rng.randint(3, 12)))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(corpus(), vocab_size=600)


# hypothesis cannot take function-scoped fixtures; one trained tokenizer serves every example
TOK = Tokenizer.train(corpus(), vocab_size=600)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "天气?"},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
        ],
    },
    {"role": "tool", "content": "18°C"},
    {"role": "tool", "content": "20°C"},
    {"role": "assistant", "content": "Paris 18°C, Lyon 20°C."},
]


# ------------------------------------------------------------------ training, encode, decode


def test_train_specials(tok):
    eot = tok.token_to_id("<|endoftext|>")
    assert [tok.token_to_id(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]] == [
        0,
        1,
        2,
    ]
    assert tok.bos_id == tok.eos_id == tok.pad_id == eot
    assert 256 + 3 < tok.vocab_size <= 600
    assert tok.token_to_id("no such token") is None
    # merges were learned: a frequent word is one token, a frequent Chinese word fewer than bytes
    assert len(tok.encode("model")) == 1
    assert len(tok.encode("模型")) < len("模型".encode())


def test_split_digits_gives_one_token_per_digit():
    texts = ["12 + 345 = 357", "1000 - 1 = 999"] * 200
    split = Tokenizer.train(texts, vocab_size=300, split_digits=True)
    assert [split.decode([i]) for i in split.encode("1234")] == ["1", "2", "3", "4"]
    assert split.decode(split.encode("x 12+3 = 15 😀")) == "x 12+3 = 15 😀"
    assert len(Tokenizer.train(texts, vocab_size=300).encode("1234")) < 4


def test_train_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(["abc"], vocab_size=100)


@pytest.mark.parametrize("text", ["", "the model", " two  spaces\n\ttab", "你好世界 😀👍🏽 mixed"])
def test_round_trip_examples(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
    # special-token text in the input becomes the special token, which decode skips by default
    assert TOK.decode(TOK.encode(text), skip_special_tokens=False) == text
    if not any(s in text for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert TOK.decode(TOK.encode(text)) == text


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_encode_batch(tok):
    texts = ["the model", "你好 😀", ""]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_stop_ids(tok):
    assert tok.eos_id in tok.stop_ids
    assert tok.token_to_id("<|im_end|>") in tok.stop_ids
    assert tok.token_to_id("<|im_start|>") not in tok.stop_ids


# ------------------------------------------------------------------ streaming


def stream(tok, ids):
    decoder = tok.stream_decoder()
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize(
    "text", ["我们训练一个小型语言模型，机器学习很有趣", "emoji 👨‍👩‍👧 and 👍🏽❤️ 🦜🦜"]
)
def test_stream_examples(tok, text):
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # the text holds characters spread over several tokens, so something was held back
    assert "" in deltas[:-1]


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\ufffd", blacklist_categories=["Cs"])))
def test_stream_any_text(text):
    ids = TOK.encode(text)
    deltas = stream(TOK, ids)
    assert "".join(deltas) == TOK.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_stream_skips_specials_and_resets(tok):
    ids = tok.encode("<|im_start|>assistant\n你好 😀<|im_end|>")
    decoder = tok.stream_decoder()
    text = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert text == "assistant\n你好 😀"
    assert decoder.push(tok.encode("the")[0]) + decoder.flush() == "the"


def test_stream_decodes_a_bounded_window(tok):
    seen = []

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(" ".join(corpus(100, seed=1)))
    decoder = StreamDecoder(Spy())
    text = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert text == tok.decode(ids)
    assert len(ids) > 500 and max(seen) <= 16


def test_broken_utf8_is_flushed(tok):
    first_byte = tok.encode("🦜")[:1]  # one byte of a four-byte character
    decoder = tok.stream_decoder()
    assert decoder.push(first_byte[0]) == ""
    assert decoder.flush() == "\ufffd"


# ------------------------------------------------------------------ files


def test_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nthe model 你好 😀<|im_end|>"
    assert loaded.encode(text) == tok.encode(text)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert loaded.stop_ids == tok.stop_ids
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.chat_template == tok.chat_template == DEFAULT_CHAT_TEMPLATE


def test_transformers_loads_saved_folder(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["the model 你好 😀", "<|im_start|>user\nhi<|im_end|>\n", " lead  space"]:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert hf(text)["input_ids"] == tok.encode(text, add_special_tokens=True)
    assert hf.eos_token_id == tok.eos_id and hf.pad_token_id == tok.pad_id
    for messages, tools in [(CONVERSATION, None), (TOOL_CONVERSATION, TOOLS)]:
        ours = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        theirs = hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert theirs == ours


def test_hugging_face_folder(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": None,
        "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.bos_id == tok.token_to_id("<|im_start|>")
    assert loaded.eos_id == tok.token_to_id("<|im_end|>")
    assert loaded.pad_id is None
    assert loaded.stop_ids >= {0, 2}
    assert loaded.apply_chat_template(CONVERSATION[:2]) == "[system] You are terse.\n[user] Hi\n"

    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(CONVERSATION) == "4"


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


# ------------------------------------------------------------------ chat templates


def test_chatml(tok):
    assert tok.apply_chat_template(CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n天气?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert closed == tok.apply_chat_template(CONVERSATION).removesuffix("<|im_start|>assistant\n")


def test_content_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=False) == (
        "<|im_start|>user\na\nb<|im_end|>\n"
    )


def test_tools(tok):
    text = tok.apply_chat_template(CONVERSATION[:2], tools=TOOLS)
    schema = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert f"<tools>\n{schema}\n</tools>" in text  # plain JSON, not HTML-escaped
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in text
    assert text.count("<|im_start|>system") == 1
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    calls = tok.apply_chat_template(TOOL_CONVERSATION, add_generation_prompt=False, tools=TOOLS)
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n18°C\n</tool_response><|im_end|>\n"
    ) in calls


def test_template_errors_are_raised(tok):
    tok = Tokenizer(tok.backend, chat_template="{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(Exception, match="no user"):
        tok.apply_chat_template(CONVERSATION[1:])


# ------------------------------------------------------------------ chat segments


def check_segments(tok, messages, tools=None):
    segments = tok.chat_segments(messages, tools=tools)
    full = tok.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
    assert "".join(text for text, _ in segments) == full
    assistant = [text for text, role in segments if role == "assistant"]
    assert len(assistant) == sum(m["role"] == "assistant" for m in messages)
    return segments, assistant


def test_chat_segments(tok):
    messages = [*CONVERSATION, {"role": "assistant", "content": "晴 ☀️"}]
    segments, assistant = check_segments(tok, messages)
    assert assistant == ["Hello!<|im_end|>", "晴 ☀️<|im_end|>"]
    assert segments[:3] == [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n", "system"),
        ("<|im_start|>user\nHi<|im_end|>\n", "user"),
        ("<|im_start|>assistant\n", "template"),
    ]
    assert segments[-1] == ("\n", "template")

    _, assistant = check_segments(tok, TOOL_CONVERSATION, TOOLS)
    assert assistant[0].startswith('<tool_call>\n{"name": "get_weather"')
    assert assistant[1] == "Paris 18°C, Lyon 20°C.<|im_end|>"


def test_chat_segments_template_that_rewrites_history(tok):
    # closes a run of tool messages only after its last one: a longer conversation does not
    # extend the rendering of a shorter one, yet the pieces must still add up
    template = (
        "{% for m in messages %}"
        "{% if m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
        "<|im_start|>user{% endif %}\n<r>{{ m.content }}</r>"
        "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    custom = Tokenizer(tok.backend, eos_token="<|endoftext|>", chat_template=template)
    _, assistant = check_segments(custom, TOOL_CONVERSATION)
    assert assistant[1] == "Paris 18°C, Lyon 20°C.<|im_end|>"


message_strategy = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.text()}
)


@settings(max_examples=100, deadline=None)
@given(st.lists(message_strategy, min_size=1, max_size=6), st.booleans())
def test_chat_segments_any_conversation(messages, with_tools):
    tools = TOOLS if with_tools else None
    _, assistant = check_segments(TOK, messages, tools)
    contents = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert assistant == contents
