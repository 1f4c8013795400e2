"""The custom sampling loop in docs/inference.md gives the Engine's tokens; the speculative
example there runs; generate.py works."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from infer_models import BASE, greedy_reference, make_model

import astrai as ai
from astrai.infer import Engine

ROOT = Path(__file__).resolve().parents[2]


def docs_loop():
    text = (ROOT / "docs" / "inference.md").read_text()
    block = re.search(r"## Your own sampling loop.*?```python\n(.*?)```", text, re.S).group(1)
    assert len(block.strip().splitlines()) <= 20
    namespace: dict = {}
    exec(compile(block, "docs/inference.md", "exec"), namespace)
    return namespace["generate"]


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_docs_sampling_loop_equals_engine(kind):
    generate = docs_loop()
    params, cfg = make_model(kind)
    prompt = [5, 17, 42, 7, 99, 3]
    sampling = dict(temperature=0.8, top_p=0.95, ignore_eos=True)
    with Engine(params, cfg, None, max_seq_len=128) as engine:
        for seed in (0, 1):
            ours = generate(params, cfg, prompt, 12, seed)
            theirs = engine.generate([prompt], max_tokens=12, seed=seed, **sampling)[0]
            assert ours == theirs.token_ids
        greedy = engine.generate([prompt], max_tokens=12, seed=0, temperature=0.0, ignore_eos=True)
        assert generate(params, cfg, prompt, 12, 0, temperature=0.0) == greedy[0].token_ids


def test_docs_continuous_batching_loop_equals_recomputation():
    text = (ROOT / "docs" / "inference.md").read_text()
    section = re.search(
        r"## Continuous batching in your own loop.*?```python\n(.*?)```", text, re.S
    )
    block = section.group(1)
    assert len(block.strip().splitlines()) <= 24
    namespace: dict = {}
    exec(compile(block, "docs/inference.md", "exec"), namespace)
    params, cfg, tokens = namespace["params"], namespace["cfg"], namespace["tokens"]
    assert tokens["greedy"] == greedy_reference(params, cfg, [1, 2, 3, 4], 8)
    assert 3 <= len(tokens["hot"]) < 50 and len(tokens["top-k"]) == 4


def run_program(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["generate.py", *args])
    main = runpy.run_path(str(ROOT / "programs" / "generate.py"))["main"]
    return main()


def test_generate_program(tmp_path, monkeypatch, capsys, tokenizer):
    cfg = ai.ModelConfig(**{**BASE, "vocab_size": tokenizer.vocab_size})
    ai.save_pretrained(tmp_path / "model", ai.init_params(cfg), cfg, tokenizer=tokenizer)
    prompts = tmp_path / "in.jsonl"
    lines = [
        {"prompt": "hello world", "id": "a"},
        {"messages": [{"role": "user", "content": "the quick"}], "max_tokens": 3},
        {"prompt": "lazy dog", "temperature": 0.7, "seed": 3},
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    model = str(tmp_path / "model")
    args = ["--model", model, "--input", str(prompts), "--output", str(out)]
    assert run_program(monkeypatch, *args, "--max-tokens", "5", "--temperature", "0") == 0
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert results[0]["id"] == "a"
    assert results[1]["usage"]["completion_tokens"] <= 3
    assert all(r["finish_reason"] in ("stop", "length") for r in results)
    assert "3/3 prompts" in capsys.readouterr().err

    # 8- and 4-bit weights in the dtype the hardware suits: the same kind of output
    for bits in ("int8", "int4"):
        flags = ["--max-tokens", "5", "--temperature", "0", "--quantize", bits, "--dtype", "auto"]
        assert run_program(monkeypatch, *args, *flags) == 0
        quantized = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["index"] for r in quantized] == [0, 1, 2]
        assert all(r["finish_reason"] in ("stop", "length") for r in quantized)
        capsys.readouterr()

    # speculation (the model as its own draft) changes no greedy token
    greedy = [r["text"] for r in results]
    for spec in (["--speculative", "lookup"], ["--speculative", "draft", "--draft-model", model]):
        assert (
            run_program(monkeypatch, *args, "--max-tokens", "5", "--temperature", "0", *spec) == 0
        )
        speculated = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["text"] for r in speculated] == greedy
        capsys.readouterr()
    assert run_program(monkeypatch, *args, "--speculative", "draft") == 1
    assert "needs draft_model" in capsys.readouterr().err

    prompts.write_text('{"prompt": "x"}\n{"promt": "y"}\n')
    assert run_program(monkeypatch, *args) == 1
    assert "line 2" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_info:
        run_program(monkeypatch, "--help")
    assert exit_info.value.code == 0


def test_generate_program_names_a_bad_draft_flag(tmp_path, monkeypatch, capsys, tokenizer):
    cfg = ai.ModelConfig(**{**BASE, "vocab_size": tokenizer.vocab_size})
    ai.save_pretrained(tmp_path / "model", ai.init_params(cfg), cfg, tokenizer=tokenizer)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n')
    model = ["--model", str(tmp_path / "model"), "--input", str(prompts), "--quiet"]
    assert run_program(monkeypatch, *model, "--draft-model", str(tmp_path / "model")) == 1
    assert "only used with speculative" in capsys.readouterr().err
    missing = str(tmp_path / "missing")
    assert run_program(monkeypatch, *model, "--speculative", "draft", "--draft-model", missing) == 1
    assert f"--draft-model {missing}: not a model folder" in capsys.readouterr().err


def test_docs_speculative_example_runs():
    text = (ROOT / "docs" / "inference.md").read_text()
    block = re.search(r"## Speculative decoding.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    with torch.no_grad():
        exec(compile(block, "docs/inference.md", "exec"), namespace)
    assert namespace["spec"] == namespace["plain"] and len(namespace["spec"]) == 16
