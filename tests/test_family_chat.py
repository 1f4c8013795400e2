"""Each Hugging Face family's chat format through `just serve`: a folder as the family's
checkpoints come (transformers' config.json and weights, a tokenizer with the family's special
tokens and published chat template, generation_config.json's stop ids), loaded the way
programs/serve.py loads it and asked over HTTP. The prompt the server renders is the one
transformers renders, generation prompt included; every stop id of the family ends a reply, and
another special token does not.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest
import torch

from astrai.config import ServeConfig
from astrai.serve.app import make_app
from astrai.serve.background import serve_in_background
from astrai.tokenizer import CHATML_SPECIALS, Tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "chat_templates"
PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "serve.py"
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|end_of_text|>"]  # fmt: skip
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
GEMMA = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
PHI = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
GRANITE = ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"]
OLMO = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
# OLMo 2's turn markers (no published template of it is stored in tests/chat_templates)
OLMO_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# family: (chat template, special tokens, bos, eos, generation_config.json's stop tokens, what
# the rendered prompt ends with, a special token that must not stop a reply)
CHATS = {
    "llama": ("llama3.2-tools", LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
              ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
              "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|start_header_id|>"),
    "mistral": ("mistral-small-3.1", MISTRAL, "<s>", "</s>", ["</s>"], "[/INST]", "[INST]"),
    "mixtral": ("mistral-small-3.1", MISTRAL, "<s>", "</s>", ["</s>"], "[/INST]", "[INST]"),
    "qwen2": ("hermes-tools", CHATML_SPECIALS, None, "<|im_end|>",
              ["<|im_end|>", "<|endoftext|>"], "<|im_start|>assistant\n", "<|im_start|>"),
    "qwen3": ("qwen3-coder", CHATML_SPECIALS, None, "<|im_end|>",
              ["<|im_end|>", "<|endoftext|>"], "<|im_start|>assistant\n", "<|im_start|>"),
    "qwen3_moe": ("qwen3-coder", CHATML_SPECIALS, None, "<|im_end|>",
                  ["<|im_end|>", "<|endoftext|>"], "<|im_start|>assistant\n", "<|im_start|>"),
    "smollm3": ("hermes-tools", CHATML_SPECIALS, None, "<|im_end|>", ["<|im_end|>"],
                "<|im_start|>assistant\n", "<|im_start|>"),
    "gemma2": ("gemma3-tools", GEMMA, "<bos>", "<eos>", ["<eos>", "<end_of_turn>"],
               "<start_of_turn>model\n", "<start_of_turn>"),
    "gemma3_text": ("gemma3-tools", GEMMA, "<bos>", "<eos>", ["<eos>", "<end_of_turn>"],
                    "<start_of_turn>model\n", "<start_of_turn>"),
    "phi3": ("phi4-mini-tools", PHI, None, "<|endoftext|>", ["<|end|>", "<|endoftext|>"],
             "<|assistant|>", "<|user|>"),
    "granite": ("granite-tools", GRANITE, "<|end_of_text|>", "<|end_of_text|>",
                ["<|end_of_text|>"], "ASSISTANT:\n ", "<|start_of_role|>"),
    "olmo2": (OLMO_TEMPLATE, OLMO, None, "<|endoftext|>", ["<|endoftext|>"], "<|assistant|>\n",
              "<|user|>"),
}  # fmt: skip
# the model of each family, small
MODELS = {
    "llama": ("LlamaConfig", {}), "mistral": ("MistralConfig", {}), "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 2, "num_experts_per_tok": 1,
                                      "moe_intermediate_size": 16}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 2, "num_experts_per_tok": 1}),
    "smollm3": ("SmolLM3Config", {}), "gemma2": ("Gemma2Config", {"head_dim": 8}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 8}), "phi3": ("Phi3Config", {}),
    "granite": ("GraniteConfig", {}), "olmo2": ("Olmo2Config", {}),
}  # fmt: skip
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def family_folder(path: Path, family: str) -> Path:
    template, specials, bos, eos, stops, _, _ = CHATS[family]
    text = "What is the weather in Paris? It is sunny, and the sky is blue."
    tok = Tokenizer.train([text] * 4, vocab_size=300, special_tokens=specials)
    tok.bos_token, tok.eos_token, tok.pad_token = bos, eos, None
    template_file = TEMPLATES / f"{template}.jinja"
    tok.chat_template = template_file.read_text() if template_file.is_file() else template
    tok.save_pretrained(path)
    stop_ids = [tok.token_to_id(t) for t in stops]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_ids}))
    config_cls, settings = MODELS[family]
    config = getattr(transformers, config_cls)(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=stop_ids, pad_token_id=None, **settings,
    )  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, config_cls.replace("Config", "ForCausalLM").replace("TextFor", "For"))(
        config
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def serve_program():
    spec = importlib.util.spec_from_file_location("serve_program", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reply(url: str, **request) -> dict:
    body = {"model": "m", "messages": MESSAGES, "temperature": 0.0, **request}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("family", list(CHATS))
def test_the_family_chats_through_serve(family, serve_program, tmp_path):
    _, _, _, eos, stops, prompt_end, not_a_stop = CHATS[family]
    folder = family_folder(tmp_path, family)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    rendered = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith(prompt_end)
    serve_cfg = ServeConfig(max_batch=2, page_size=8)
    engine = serve_program.load_engine(folder, serve_cfg)
    try:
        assert engine.cfg.family == family
        with serve_in_background(make_app(engine, "m", serve_cfg)) as url:
            usage = reply(url, max_tokens=1)["usage"]
            assert usage["prompt_tokens"] == len(theirs.encode(rendered, add_special_tokens=False))
            for token in {eos, *stops}:
                answer = reply(
                    url, max_tokens=3, logit_bias={theirs.convert_tokens_to_ids(token): 100}
                )
                choice = answer["choices"][0]
                assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", ""), (
                    token
                )
            other = theirs.convert_tokens_to_ids(not_a_stop)
            answer = reply(url, max_tokens=2, logit_bias={other: 100})
            assert answer["choices"][0]["finish_reason"] == "length"
    finally:
        engine.close()


def test_without_generation_config_json_the_stop_ids_come_from_config_json(tmp_path):
    folder = family_folder(tmp_path, "llama")
    (folder / "generation_config.json").unlink()
    tok = Tokenizer.from_pretrained(folder)
    assert tok.token_to_id("<|eom_id|>") in tok.stop_ids  # neither eos nor an end of turn


def test_phi_end_of_turn_stops_whatever_the_files_declare(tmp_path):
    folder = family_folder(tmp_path, "phi3")
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    tok = Tokenizer.from_pretrained(folder)
    config["eos_token_id"] = tok.eos_id
    (folder / "config.json").write_text(json.dumps(config))
    assert tok.token_to_id("<|end|>") in Tokenizer.from_pretrained(folder).stop_ids
