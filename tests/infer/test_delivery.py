"""The Engine thread's decisions as pure functions: when events reach their readers, whether a
request may wait, when the stats snapshot is taken, tokens per second."""

from __future__ import annotations

import pytest

from astrai.infer import Overloaded, StreamEvent
from astrai.infer.delivery import Pending, Sink, deliver, hand_over, is_due
from astrai.infer.pacing import check_room, stats_due, tokens_per_s


def token(rid, t=1):
    return StreamEvent(rid, token_ids=[t])


def final(rid):
    return StreamEvent(rid, finish_reason="stop")


def test_first_events_and_ends_go_at_once_the_others_after_the_interval():
    assert not is_due(Pending(None), 0.0, 0.02)  # nothing to hand over
    assert is_due(Pending(None, (token("a"),)), 0.0, 0.02)  # never sent: at once
    assert not is_due(Pending(None, (token("a"),), sent_at=1.0), 1.01, 0.02)
    assert is_due(Pending(None, (token("a"),), sent_at=1.0), 1.02, 0.02)
    assert is_due(Pending(None, (token("a"), final("a")), sent_at=1.0), 1.001, 0.02)


def test_hand_over_holds_events_until_due_and_forgets_finished_requests():
    pending = {"a": Pending(None), "b": Pending(None)}
    pending, due = hand_over(pending, [token("a"), token("b")], 0.0, 0.02)
    assert [(rid, len(events)) for rid, events in due] == [("a", 1), ("b", 1)]
    assert pending["a"] == Pending(None, (), 0.0)
    later = [token("a", 2), token("b", 3)]
    pending, due = hand_over(pending, later, 0.01, 0.02)
    assert due == [] and pending["a"].events == (later[0],)
    pending, due = hand_over(pending, [final("b")], 0.015, 0.02)
    assert due == [("b", (later[1], StreamEvent("b", finish_reason="stop")))]
    assert set(pending) == {"a"}
    pending, due = hand_over(pending, [token("gone")], 0.03, 0.02)  # its reader left
    assert due == [("a", (later[0],))] and set(pending) == {"a"}


def test_a_group_woken_anyway_takes_every_event_held_for_it():
    loop, other = object(), object()
    pending = {
        "a": Pending(loop, (token("a"),), 0.0),
        "b": Pending(loop, (token("b"),), 0.0),
        "c": Pending(other, (token("c"),), 0.0),
        "d": Pending(None, (token("d"),), 0.0),
    }
    pending, due = hand_over(pending, [final("a")], 0.005, 0.02)
    assert [rid for rid, _ in due] == ["a", "b"]  # c and d wait for their interval
    assert pending["c"].events and pending["d"].events and "a" not in pending


def test_deliver_puts_in_order_and_drops_ended_sinks():
    got = []
    sinks = {"a": Sink(got.append), "b": Sink(got.append)}
    events = (token("a"), final("a"))
    deliver(sinks, [("a", events), ("b", (token("b"),))])
    assert got == [*events, token("b")] and set(sinks) == {"b"}


def test_check_room():
    check_room(3, 0)  # no limit
    check_room(3, 4)
    with pytest.raises(Overloaded, match="4 requests are already waiting"):
        check_room(4, 4)


def test_stats_due():
    assert not stats_due(False, False, False, now=1.04, taken_at=1.0, interval=0.05)
    assert stats_due(False, False, False, now=1.06, taken_at=1.0, interval=0.05)
    for reason in range(3):
        flags = [i == reason for i in range(3)]
        assert stats_due(*flags, now=1.0, taken_at=1.0, interval=0.05)


def test_tokens_per_s_over_the_recent_window():
    assert tokens_per_s([], 5.0) == 0.0
    assert tokens_per_s([(1.0, 4)], 1.0) == 0.0  # one step: no span yet
    assert tokens_per_s([(1.0, 4), (2.0, 6), (3.0, 6)], 3.0) == pytest.approx(6.0)
    # steps older than the window are left out
    assert tokens_per_s([(0.0, 100), (20.0, 1), (22.0, 4)], 22.0) == pytest.approx(2.0)
