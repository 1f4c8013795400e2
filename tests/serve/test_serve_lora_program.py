"""`just serve --lora NAME=PATH`: the flag's checks, a PEFT adapter served as PEFT runs it, and
the hand-over from a `just train` LoRA run to the server and to PEFT."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import openai
import pytest
import torch
from numerics import assert_close, forward_roundings

import astrai
from astrai.config import ServeConfig
from astrai.model.lora_folder import save_lora
from astrai.serve.app import make_app
from astrai.serve.background import serve_in_background
from astrai.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "serve.py"
TEXT = ["the cat sat on the mat", "a dog ran in the park", "one two three four five"] * 4
PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def program():
    spec = importlib.util.spec_from_file_location("serve_program_lora", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """(folder, tokenizer): a tiny random transformers Llama with our tokenizer beside it;
    weights wider than the default init, so that greedy choices are far from ties."""
    folder = tmp_path_factory.mktemp("hf_base")
    tok = Tokenizer.train(TEXT, vocab_size=280, special_tokens=["<|endoftext|>"])
    shape = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, tok


def hf_model(folder: Path):
    """A fresh copy each time: PEFT changes the model it wraps."""
    return transformers.LlamaForCausalLM.from_pretrained(folder).eval()


def serve_program(program, folder: Path, lora: list[str]):
    """The server `just serve --model folder --lora ...` runs, as (engine, app)."""
    args = program.parse_args(["--model", str(folder), *(f"--lora={v}" for v in lora)])
    engine = program.start_engine(args, folder, program.serve_config(args, environ={}), "base")
    return engine, make_app(engine, "base", ServeConfig())


def test_lora_flags_are_checked_and_named(program, tmp_path, capsys):
    cases = [("sql", "NAME=PATH"), ("a:b=x", "adapter name"), ("base=x", "base model's name")]
    for value, words in cases:
        with pytest.raises(program.LoraFlagError, match=words) as err:
            program.adapter_flags([value], "base")
        assert f"--lora {value}" in str(err.value)
    with pytest.raises(program.LoraFlagError, match="twice"):
        program.adapter_flags(["a=x", "a=y"], "base")
    folder = program.make_random_tiny(tmp_path / "tiny")
    params, cfg = astrai.load_pretrained(folder)
    narrow = astrai.init_lora(params, cfg, rank=2, targets=("q_proj",))
    narrow["weights"] = {k.replace("layers.0", "layers.7"): v for k, v in narrow["weights"].items()}
    save_lora(tmp_path / "deep", narrow, cfg)
    bad = [("x", tmp_path / "missing", "adapter_config.json"), ("y", tmp_path / "deep", "layers.7")]
    for name, path, words in bad:
        assert program.main(["--model", str(folder), "--lora", f"{name}={path}"]) == 2
        err = capsys.readouterr().err
        assert f"--lora {name}={path}" in err and words in err


def test_the_adapter_stack_has_room_for_every_lora_flag(program, tmp_path):
    """The engine sizes its stack for the first adapter unless told; the program tells it the
    highest rank and every module of the --lora adapters, and keeps what the flags set."""
    folder = program.make_random_tiny(tmp_path / "tiny")
    params, cfg = astrai.load_pretrained(folder)
    for name, rank, targets in [("small", 2, ("q_proj",)), ("big", 4, ("q_proj", "down_proj"))]:
        save_lora(tmp_path / name, astrai.init_lora(params, cfg, rank=rank, targets=targets), cfg)
    flags = ["--model", str(folder), "--lora", f"small={tmp_path / 'small'}"]
    flags += ["--lora", f"big={tmp_path / 'big'}"]
    args = program.parse_args(flags)
    engine = program.start_engine(args, folder, program.serve_config(args, environ={}), "tiny")
    try:
        assert [(a.name, a.rank) for a in engine.adapters()] == [("small", 2), ("big", 4)]
    finally:
        engine.close()
    args = program.parse_args([*flags, "--max-adapter-rank", "2", "--adapter-targets", "q_proj"])
    assert program.serve_config(args, environ={}).adapter_targets == ("q_proj",)
    with pytest.raises(program.LoraFlagError, match="--lora big="):
        program.start_engine(args, folder, program.serve_config(args, environ={}), "tiny")


def greedy_ids(model, prompt: list[int], steps: int, banned: int) -> list[int]:
    """transformers' greedy tokens, each chosen by a clear margin (a near tie could go either
    way under another order of sums, and would make the comparison a coin toss)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
        bad_words_ids=[[banned]], output_scores=True, return_dict_in_generate=True,
        pad_token_id=banned,
    )  # fmt: skip
    for scores in out.scores:
        top = scores[0].topk(2).values
        assert top[0] - top[1] > 1e-3, "a near tie: choose other weights"
    return out.sequences[0, len(prompt) :].tolist()


def served_greedy(program, folder: Path, lora: str, tok, models: list[str]) -> dict:
    """{model: its 6 greedy token texts after PROMPT} from the server `just serve --model folder
    --lora lora` runs, the end-of-text token banned as in greedy_ids."""
    engine, app = serve_program(program, folder, [lora])
    try:
        with serve_in_background(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            ask = dict(prompt=tok.encode(PROMPT), max_tokens=6, temperature=0, logprobs=1,
                       logit_bias={str(tok.eos_id): -100}, extra_body={"ignore_eos": True})  # fmt: skip
            answers = {m: client.completions.create(model=m, **ask) for m in models}
            return {m: a.choices[0].logprobs.tokens for m, a in answers.items()}
    finally:
        engine.close()


def token_texts(tok, ids: list[int]) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def test_a_peft_adapter_serves_as_peft_merged_model(program, hf_base, tmp_path):
    folder, tok = hf_base
    prompt = tok.encode(PROMPT)
    with torch.no_grad():
        plain = greedy_ids(hf_model(folder), prompt, 6, tok.eos_id)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])  # fmt: skip
    peft_model = peft.get_peft_model(hf_model(folder), config).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        expected = greedy_ids(peft_model.merge_and_unload(), prompt, 6, tok.eos_id)
    assert expected != plain  # the adapter changes the answer: the comparison can fail
    answers = served_greedy(program, folder, f"peft={tmp_path / 'peft'}", tok, ["peft", "base"])
    assert answers == {"peft": token_texts(tok, expected), "base": token_texts(tok, plain)}


def test_a_lora_run_hands_its_adapter_to_the_server_and_to_peft(program, hf_base, tmp_path):
    """`just train` with [lora] over a base folder writes run/adapter: PEFT reads it and runs
    it as our forward does, and `just serve --lora` answers with it as PEFT does."""
    from astrai.config import train_config
    from astrai.model.lora_folder import load_lora
    from astrai.train import train

    folder, tok = hf_base
    run = tmp_path / "run"
    settings = {
        "kind": "seq", "init_from": str(folder), "out_dir": str(run), "max_steps": 4,
        "batch_size": 2, "progress": False, "optimizer": {"lr": 3e-2, "weight_decay": 0.0},
        "schedule": {"name": "constant"}, "data": {"source": "synthetic", "seq_len": 16},
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]},
    }  # fmt: skip
    train(train_config(settings, "test"))
    assert {p.name for p in (run / "adapter").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    peft_model = peft.PeftModel.from_pretrained(hf_model(folder), run / "adapter").eval()
    params, cfg = astrai.load_pretrained(folder)
    lora, _ = load_lora(run, cfg)
    tokens = torch.tensor([tok.encode(PROMPT + " on the mat")])
    with torch.no_grad():
        theirs = peft_model(tokens).logits
    ours = astrai.forward(params, cfg, tokens, lora=lora)
    assert not torch.allclose(ours, astrai.forward(params, cfg, tokens))  # it was trained
    assert_close(ours, theirs, forward_roundings(cfg, tokens.shape[1]) + 4)
    with torch.no_grad():
        expected = greedy_ids(peft_model, tok.encode(PROMPT), 6, tok.eos_id)
    answers = served_greedy(program, folder, f"tuned={run}", tok, ["tuned"])
    assert answers["tuned"] == token_texts(tok, expected)
