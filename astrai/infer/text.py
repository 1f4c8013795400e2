"""A sequence's text as its tokens come: detokenized, with text that could still start a stop
string kept unsent, and the stop conditions that end the request."""

from __future__ import annotations

from astrai.infer.constraints import is_finished
from astrai.infer.sequence import Sequence
from astrai.infer.stops import scan_stops


def flush_text(seq: Sequence) -> str:
    """No more tokens will come: release the unsent text and the decoder's last bytes, cut at
    a stop string should those bytes complete one."""
    if seq.decoder is None:
        return ""
    unsent, seq.unsent_text = seq.unsent_text + seq.decoder.flush(), ""
    text, rest, hit = scan_stops(unsent, seq.sampling.stop)
    return text if hit is not None else text + rest


def token_text(seq: Sequence, token: int, tokenizer) -> tuple[str, str | None, str | None]:
    """seq has just taken `token` (its tokens and grammar include it) -> (the text it adds,
    the finish reason or None, the stop string or stop token text that matched). A finished
    grammar stops the request; max_tokens before that gives "length"."""
    finish, matched, text = None, None, ""
    if token in seq.stop_ids:
        finish = "stop"
        if tokenizer is not None:
            matched = tokenizer.decode([token], skip_special_tokens=False)
    elif seq.decoder is not None:
        seq.unsent_text += seq.decoder.push(token)
        text, seq.unsent_text, hit = scan_stops(seq.unsent_text, seq.sampling.stop)
        if hit is not None:
            finish, matched = "stop", hit
    grammar_done = seq.matcher is not None and is_finished(seq.matcher)
    if finish is None and grammar_done:
        finish = "stop"
    if finish is None and len(seq.tokens) >= seq.max_len:
        finish = "length"
    if finish == "length" or token in seq.stop_ids or grammar_done:
        text += flush_text(seq)
    return text, finish, matched
