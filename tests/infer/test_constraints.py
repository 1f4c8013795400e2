"""Constrained decoding: a random-weight model (garbage when free) writes JSON that validates
against any schema once a grammar masks its tokens; free requests batched with constrained
ones keep their tokens; max_tokens before the structure closes is "length"."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_prefix import assert_follows_schema, assert_json_prefix

import astrai as ai
from astrai.infer import (
    ConstraintError,
    Engine,
    Request,
    SamplingParams,
    accept_token,
    allowed_tokens,
    sample,
    start_constraint,
)
from astrai.infer.constraints import _compiled, choice, json_object, json_schema, regex
from astrai.tokenizer import Tokenizer

TEXT = (
    'The quick brown fox jumps over the lazy dog. {"name": "value", "count": 12}, '
    '[1, 2.5, -3], true, false, null. Numbers 0123456789 and words in "quotes". '
) * 20


@pytest.fixture(scope="module")
def model():
    tok = Tokenizer.train([TEXT], vocab_size=400)
    # a vocabulary wider than the tokenizer's, as models pad theirs
    cfg = ai.ModelConfig(vocab_size=416, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    return ai.init_params(cfg, seed=0), cfg, tok


def run(state, params, requests):
    for request in requests:
        state = ai.add_request(state, request)
    texts, tokens, finish = {}, {}, {}
    while len(finish) < len(requests):
        state, events = ai.engine_step(state, params)
        for e in events:
            texts[e.request_id] = texts.get(e.request_id, "") + e.text
            tokens.setdefault(e.request_id, []).extend(e.token_ids)
            if e.finish_reason is not None:
                assert e.error is None, e.error
                finish[e.request_id] = e.finish_reason
    return texts, tokens, finish


# ---------------------------------------------------------------- hypothesis schemas

names = st.text(alphabet="abcdefgh", min_size=1, max_size=4)
bounded_int = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
    lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
)
bounded_number = st.tuples(st.integers(-5, 5), st.integers(1, 9)).map(
    lambda t: {"type": "number", "minimum": t[0], "exclusiveMaximum": t[0] + t[1] + 0.5}
)
leaves = st.one_of(
    st.just({"type": "string", "maxLength": 6}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    bounded_int,
    bounded_number,
    st.lists(names, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def objects(children):
    def build(props_required):
        props, required = props_required
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        schema["required"] = [k for k, r in zip(props, required) if r]
        return schema

    return st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.tuples(
            st.just(props), st.lists(st.booleans(), min_size=len(props), max_size=len(props))
        ).map(build)
    )


def arrays(children):
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )


schemas = st.recursive(leaves, lambda c: st.one_of(objects(c), arrays(c)), max_leaves=6)
# Room for the longest text these schemas require: an array of two objects of three required
# strings, one of them an object of two more, took all of 96 tokens in every row (a case
# hypothesis found), leaving the sampled rows no room to end.
MAX_TOKENS = 192


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 1000))
def test_random_model_writes_valid_json_for_any_schema(model, schema, seed):
    params, cfg, tok = model
    state = ai.init_engine(params, cfg, tok, max_batch=4, page_size=8)
    constraint = json_schema(schema)
    requests = [
        Request(
            f"r{i}",
            "Write JSON:",
            SamplingParams(
                max_tokens=MAX_TOKENS, seed=seed + i, temperature=t, constraint=constraint
            ),
        )
        for i, t in enumerate([1.0, 0.0, 1.5])
    ]
    texts, tokens, finish = run(state, params, requests)
    # A greedy row may write a number's digits until max_tokens; a sampled one ends it.
    assert "stop" in finish.values(), finish
    for rid, text in texts.items():
        assert_follows_schema(text, schema, finish[rid])
        assert finish[rid] == "stop" or len(tokens[rid]) == MAX_TOKENS


def test_free_model_writes_no_json(model):
    """The premise of the test above: unconstrained, the same model writes garbage."""
    params, cfg, tok = model
    state = ai.init_engine(params, cfg, tok, max_batch=4, page_size=8)
    texts, _, _ = run(
        state, params, [Request("free", "Write JSON:", SamplingParams(max_tokens=24, seed=0))]
    )
    with pytest.raises(ValueError):
        json.loads(texts["free"])


# ---------------------------------------------------------------- batching and limits


def test_free_requests_keep_their_greedy_tokens(model):
    params, cfg, tok = model
    free = [
        Request(f"free{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(["The quick", "Numbers 01", "words in"])
    ]
    constrained = Request(
        "json", "Write JSON:", SamplingParams(max_tokens=40, seed=3, constraint=json_object())
    )
    alone = run(ai.init_engine(params, cfg, tok, max_batch=8, page_size=8), params, free)[1]
    mixed = run(
        ai.init_engine(params, cfg, tok, max_batch=8, page_size=8),
        params,
        [free[0], constrained, *free[1:]],
    )[1]
    for r in free:
        assert mixed[r.id] == alone[r.id]
    # the Engine thread, too: free and constrained requests submitted side by side
    engine = Engine(params, cfg, tok, max_batch=8, page_size=8)
    try:
        greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
        ids = [engine.submit(free[0].prompt, **greedy)]
        ids.append(engine.submit("Write JSON:", max_tokens=40, seed=3, constraint=json_object()))
        ids += [engine.submit(r.prompt, **greedy) for r in free[1:]]
        results = [engine.result(i) for i in ids]
        assert [results[0].token_ids, *(r.token_ids for r in results[2:])] == [
            alone[r.id] for r in free
        ]
        assert_follows_schema(results[1].text, {"type": "object"}, results[1].finish_reason)
    finally:
        engine.close()


def test_max_tokens_before_the_structure_closes_is_length(model):
    params, cfg, tok = model
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 40}},
        "required": ["s"],
    }
    state = ai.init_engine(params, cfg, tok, max_batch=2, page_size=8)
    req = Request("r", "x", SamplingParams(max_tokens=5, seed=0, constraint=json_schema(schema)))
    texts, tokens, finish = run(state, params, [req])
    assert finish["r"] == "length" and len(tokens["r"]) == 5
    assert texts["r"].startswith('{"s": "')
    assert_json_prefix(texts["r"], schema)


def test_regex_and_choice(model):
    params, cfg, tok = model
    state = ai.init_engine(params, cfg, tok, max_batch=4, page_size=8)
    reqs = [
        Request(
            "re", "x", SamplingParams(max_tokens=20, seed=1, constraint=regex(r"[A-C]{2}-[0-9]{3}"))
        ),
        Request(
            "ch",
            "x",
            SamplingParams(max_tokens=20, seed=2, constraint=choice(["yes", "no", "maybe"])),
        ),
    ]
    texts, _, finish = run(state, params, reqs)
    assert finish == {"re": "stop", "ch": "stop"}
    import re as re_module

    assert re_module.fullmatch(r"[A-C]{2}-[0-9]{3}", texts["re"])
    assert texts["ch"] in {"yes", "no", "maybe"}


def test_unsupported_schema_names_the_keyword(model):
    params, cfg, tok = model
    state = ai.init_engine(params, cfg, tok, max_batch=2, page_size=8)
    bad = json_schema({"type": "array", "uniqueItems": True})
    with pytest.raises(ConstraintError, match="uniqueItems"):
        ai.add_request(state, Request("r", "x", SamplingParams(constraint=bad)))
    with pytest.raises(ConstraintError):
        regex("(unclosed")
        start_constraint(regex("(unclosed"), tok)


def test_compiled_once_per_schema_and_tokenizer(model):
    _, cfg, tok = model
    constraint = json_schema({"type": "object", "properties": {"only": {"type": "integer"}}})
    before = _compiled.cache_info()
    first = start_constraint(constraint, tok, cfg.vocab_size)
    second = start_constraint(
        json_schema({"type": "object", "properties": {"only": {"type": "integer"}}}),
        tok,
        cfg.vocab_size,
    )
    after = _compiled.cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 1
    assert first is not second  # each request its own state


def test_mask_in_a_hand_written_loop(model):
    """allowed_tokens + sample + accept_token outside the engine; free rows untouched."""
    _, cfg, tok = model
    matcher = start_constraint(choice(["true", "false"]), tok, cfg.vocab_size)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, cfg.vocab_size, generator=g)
    mask = allowed_tokens([matcher, None], cfg.vocab_size)
    assert mask[1].all() and 0 < mask[0].sum() < cfg.vocab_size
    assert not mask[0, tok.vocab_size :].any()  # padding rows of the vocabulary
    free_before = sample(logits[1:], temperature=0.0)
    out = sample(logits, temperature=0.0, allowed=mask)
    assert out[1] == free_before[0] and mask[0, out[0]]
    accept_token(matcher, int(out[0]))
    with pytest.raises(ConstraintError):
        accept_token(matcher, tok.encode("zzz")[0])


# ---------------------------------------------------------------- just generate


def run_generate(monkeypatch, *args):
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setattr(sys, "argv", ["generate.py", *args])
    return runpy.run_path(str(root / "programs" / "generate.py"))["main"]()


def test_generate_program_with_schemas(model, tmp_path, monkeypatch, capsys):
    params, cfg, tok = model
    ai.save_pretrained(tmp_path / "model", params, cfg, tokenizer=tok)
    whole = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}}, "required": ["n"],
             "additionalProperties": False}  # fmt: skip
    line_schema = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}
    (tmp_path / "schema.json").write_text(json.dumps(whole))
    lines = [
        {"prompt": "one"},
        {"prompt": "two", "json_schema": line_schema},
        {"prompt": "three", "choice": ["red", "green"]},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = ["--model", str(tmp_path / "model"), "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"), "--max-tokens", "40", "--seed", "1",
            "--quiet"]  # fmt: skip
    assert run_generate(monkeypatch, *args, "--json-schema", str(tmp_path / "schema.json")) == 0
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert all(r["finish_reason"] == "stop" for r in out), out
    jsonschema.validate(json.loads(out[0]["text"]), whole)
    jsonschema.validate(json.loads(out[1]["text"]), line_schema)
    assert out[2]["text"] in ("red", "green")

    (tmp_path / "in.jsonl").write_text(
        '{"prompt": "x"}\n{"prompt": "y", "json_schema": {"not": {}}}\n'
    )
    assert run_generate(monkeypatch, *args) == 1
    err = capsys.readouterr().err
    assert "line 2" in err and "not" in err
