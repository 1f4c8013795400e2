"""Stop strings: caught across tokens, never leaked, and text held back only while needed."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from astrai.infer.stops import scan_stops

text = st.text(alphabet="abST", max_size=30)


def stream(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    emitted, held = "", ""
    for piece in pieces:
        out, held, matched = scan_stops(held + piece, stops)
        emitted += out
        if matched is not None:
            return emitted, matched
    return emitted + held, None


@given(
    pieces=st.lists(text, max_size=8),
    stops=st.lists(st.text("abST", min_size=1, max_size=4), max_size=3),
)
def test_streaming_equals_cutting_the_whole_text(pieces, stops):
    full = "".join(pieces)
    emitted, matched = stream(pieces, stops)
    # what a character-by-character check would see: the stop string complete first
    hits = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    if hits:
        end, first = min(hits)
        assert emitted == full[:first] and matched == full[first:end]
    else:
        assert matched is None and emitted == full


@given(held=text, stops=st.lists(st.text("abST", min_size=1, max_size=4), min_size=1, max_size=3))
def test_only_a_possible_stop_start_is_held(held, stops):
    out, kept, matched = scan_stops(held, stops)
    if matched is None:
        assert out + kept == held
        assert kept == "" or any(s.startswith(kept) and s != kept for s in stops)
    else:  # what precedes the stop string is emitted, nothing after it is kept
        assert matched in stops and held.startswith(out + matched) and kept == ""


def test_split_stop_string():
    assert stream(["Hello ST", "OP now"], ["STOP"]) == ("Hello ", "STOP")
