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
    text, calls = tools.parse(CALL + "\n" + second)
    assert [c.name for c in calls] == ["get_weather", "b"]
    assert json.loads(calls[1].arguments) == {"x": 1}
    assert text == "\n"


def test_not_a_call_stays_text():
    for raw in ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']:
        assert tools.parse(raw) == (raw, [])
    assert tools.parse("a < b and <tool") == ("a < b and <tool", [])


def test_unclosed_call_counts_when_whole():
    assert tools.parse(CALL.removesuffix("</tool_call>"))[1][0].name == "get_weather"
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


@settings(max_examples=200, deadline=None)
@given(pieces)
def test_nothing_is_lost(parts):
    """Content plus re-written calls holds every character that was not part of a call."""
    text = "".join(parts)
    content, calls = tools.parse(text)
    if not calls:
        assert content == text
