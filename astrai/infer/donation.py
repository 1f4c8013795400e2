"""Donation, checked: a function that updates a state in place and returns it marks the state
it was given as used, and a second use raises DonatedError naming where it went (as JAX refuses
a donated buffer). The caller goes on with what the function returned."""

from __future__ import annotations

import copy
import functools


class DonatedError(RuntimeError):
    """A state (an engine state, a page pool) was used again after it was donated."""


def donated_error(what: str, to: str, by: str | None = None) -> DonatedError:
    used = f"{by} was given {what}" if by else f"this {what} was used"
    return DonatedError(f"{used} after it was donated to {to}; use the {what} that {to} returned")


def donates(fn):
    """Decorate fn(state, ...) -> state or (state, ...), where state has a `donated_to`
    attribute: a state already donated is refused, and on return the state given is marked
    donated to fn and a fresh object holding the returned state's contents comes back. A call
    that raises donates nothing: the caller may still end the requests of a state that
    failed."""
    name = fn.__name__

    @functools.wraps(fn)
    def donating(state, *args, **kwargs):
        if state.donated_to is not None:
            raise donated_error("engine state", state.donated_to, name)
        out = fn(state, *args, **kwargs)
        returned = out[0] if isinstance(out, tuple) else out
        fresh = copy.copy(returned)
        fresh.donated_to = None
        state.donated_to = returned.donated_to = name
        return (fresh, *out[1:]) if isinstance(out, tuple) else fresh

    return donating


def check_live(state, by: str) -> None:
    """Raise DonatedError when `state` was donated; for functions that only read it."""
    if state.donated_to is not None:
        raise donated_error("engine state", state.donated_to, by)
