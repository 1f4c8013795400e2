"""The float32 products' choice kept per machine (astrai/train/product_choice.py): a second
process takes the first one's choice rather than timing again, so a resumed run multiplies as
the run it resumes did."""

from __future__ import annotations

import json

import pytest
from tiny_run import TINY, tiny_train_config

from astrai.model import products
from astrai.train import train
from astrai.train.product_choice import choices_path, choose_products, read_choices

FIRST = {"forward": True, "input": True, "weight": False}


@pytest.fixture
def fresh_process(tmp_path, monkeypatch):
    """No choice in this process yet, and a cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(products, "ONEDNN", {})


def timed_as(monkeypatch, choice):
    """products.choose as a timing that comes out as `choice`, counting its calls."""
    calls = []

    def choose(rows, inputs, outputs):
        calls.append((rows, inputs, outputs))
        products.ONEDNN.update(choice)
        return products.ONEDNN

    monkeypatch.setattr(products, "choose", choose)
    return calls


def test_a_second_process_takes_the_first_ones_choice(fresh_process, monkeypatch):
    calls = timed_as(monkeypatch, FIRST)
    assert choose_products(2048, 64, 256) == FIRST and len(calls) == 1
    assert list(read_choices(choices_path()).values()) == [FIRST]
    monkeypatch.setattr(products, "ONEDNN", {})  # the next process, whose timing would differ
    calls = timed_as(monkeypatch, dict.fromkeys(products.KINDS, False))
    assert choose_products(2048, 64, 256) == FIRST and calls == []
    # other shapes are timed (and kept) apart
    monkeypatch.setattr(products, "ONEDNN", {})
    assert choose_products(2048, 64, 512) == dict.fromkeys(products.KINDS, False)
    assert len(read_choices(choices_path())) == 2


def test_rows_past_what_the_timing_multiplies_share_a_record(fresh_process, monkeypatch):
    calls = timed_as(monkeypatch, FIRST)
    choose_products(10 * products.ROWS, 64, 256)
    monkeypatch.setattr(products, "ONEDNN", {})
    choose_products(20 * products.ROWS, 64, 256)
    assert calls == [(products.ROWS, 64, 256)]


def test_an_unreadable_or_foreign_record_is_no_record(fresh_process, monkeypatch):
    choices_path().parent.mkdir(parents=True)
    choices_path().write_text("{not json")
    assert read_choices(choices_path()) == {}
    choices_path().write_text(json.dumps({"a": {"forward": 1}, "b": FIRST, "c": [True]}))
    assert read_choices(choices_path()) == {"b": FIRST}
    calls = timed_as(monkeypatch, FIRST)
    choose_products(100, 8, 16)
    assert len(calls) == 1  # timed, and the good entry kept beside the new one
    assert set(read_choices(choices_path())) >= {"b"}


def test_a_float32_runs_first_step_records_its_choice(fresh_process, tmp_path):
    train(tiny_train_config(max_steps=1, out_dir=str(tmp_path / "run")))
    (key,) = read_choices(choices_path())
    # the micro-batch's tokens (8 rows of 24) and the tiny model's hidden x intermediate
    assert key.endswith(f", 192 x {TINY.hidden_size} x {TINY.intermediate_size}")
    assert read_choices(choices_path())[key] == products.ONEDNN
