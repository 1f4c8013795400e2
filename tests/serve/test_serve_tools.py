"""Tool-call parsing: whole text and any split into deltas give the same content and calls."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.serve import tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(chunks: list[str]) -> tuple[str, list[tools.ParsedCall]]:
    pending, text, calls = "", "", []
    for chunk in chunks:
        step = tools.feed(pending, chunk)
        pending, text, calls = step.pending, text + step.text, calls + list(step.calls)
    last = tools.finish(pending)
    return text + last.text, calls + list(last.calls)


def test_parse_call_and_content():
    text, calls = tools.parse("Let me check.\n" + CALL)
    assert text == "Let me check.\n"
    assert calls == [tools.ParsedCall("get_weather", '{"city": "Paris"}')]


def test_parallel_calls_and_string_arguments():
    second = '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert tools.parse(CALL + "\n" + second) == (
        "\n",
        [tools.ParsedCall("get_weather", '{"city": "Paris"}'), tools.ParsedCall("b", '{"x": 1}')],
    )


def test_not_a_call_stays_text():
    for raw in ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']:
        assert tools.parse(raw) == (raw, [])
    assert tools.parse("a < b and <tool") == ("a < b and <tool", [])


def test_unclosed_call_counts_when_whole():
    whole = tools.ParsedCall("get_weather", '{"city": "Paris"}')
    assert tools.parse("Sure. " + CALL.removesuffix("</tool_call>")) == ("Sure. ", [whole])
    half = CALL[:30]
    assert tools.parse(half) == (half, [])


pieces = st.lists(
    st.sampled_from([CALL, "<tool_call>", "</tool_call>", "<tool", "_call>", "hi ", "<", "{", "\n"])
    | st.text(max_size=8),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(pieces, st.data())
def test_any_split_gives_the_same_result(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(chunks) == tools.parse(text)


# Outputs built from known parts: content runs (any text without an opening tag, including
# stray "<", closing tags and tag fragments) and calls in every form models write them.
contents = (
    st.lists(
        st.sampled_from(["hi", " ", "<", "<tool", "_call>", "</tool_call>", "{", "}", "\n"])
        | st.text(max_size=8),
        max_size=4,
    )
    .map("".join)
    .filter(lambda text: "<tool_call>" not in text)
)
values = st.one_of(
    st.integers(-9, 99),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.sampled_from(["<tool_call>", "</tool_call>", "{", "é"]),
)


@st.composite
def calls(draw) -> tuple[str, tools.ParsedCall]:
    """(the call as a model writes it without its closing tag, the call it must parse to)."""
    name = draw(st.text(alphabet="abc_xyz", min_size=1, max_size=6))
    arguments = draw(st.dictionaries(st.text(max_size=4), values, max_size=3))
    form = draw(st.sampled_from(["arguments", "arguments as a string", "parameters"]))
    value = json.dumps(arguments) if form == "arguments as a string" else arguments
    body = {"name": name, form.split()[0]: value}
    pad = draw(st.sampled_from(["", "\n"]))
    written = f"<tool_call>{pad}{json.dumps(body, ensure_ascii=draw(st.booleans()))}{pad}"
    return written, tools.ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(contents, calls()), max_size=4), contents, st.booleans(), st.data())
def test_content_and_every_call_come_back(parts, tail, unclosed, data):
    """Whatever the split into deltas: the content is exactly the text between the calls, and
    the calls are exactly those written, in order (the last may lack its closing tag when
    nothing follows it)."""
    unclosed = unclosed and bool(parts)
    closes = ["</tool_call>"] * len(parts)
    if unclosed:
        closes[-1], tail = "", ""
    text = "".join(run + call + close for (run, (call, _)), close in zip(parts, closes)) + tail
    expected = ("".join(run for run, _ in parts) + tail, [call for _, (_, call) in parts])
    assert tools.parse(text) == expected
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(chunks) == expected
