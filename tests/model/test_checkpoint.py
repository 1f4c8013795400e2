"""Checkpoints: exact round trips, and Hugging Face folders written by transformers."""

import json

import pytest
import torch

from astrai import (
    CheckpointError,
    ModelConfig,
    forward,
    forward_cached,
    init_cache,
    init_params,
    load_pretrained,
    save_pretrained,
)

transformers = pytest.importorskip("transformers")


def test_save_load_round_trip_is_exact(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, attn_type="mla", ffn_type="moe", n_routed_experts=4,
                      tie_word_embeddings=False)  # fmt: skip
    params = init_params(cfg, seed=5)
    save_pretrained(tmp_path, params, cfg)
    loaded, loaded_cfg = load_pretrained(tmp_path)
    assert loaded_cfg == cfg
    assert loaded.keys() == params.keys()
    for k in params:
        assert torch.equal(loaded[k], params[k]), k
    half, _ = load_pretrained(tmp_path, dtype="bfloat16")
    assert all(v.dtype == torch.bfloat16 for v in half.values())


def test_missing_unexpected_and_misshaped_tensors_are_listed(tmp_path):
    from safetensors.torch import save_file

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=48)  # fmt: skip
    params = init_params(cfg)
    save_pretrained(tmp_path, params, cfg)
    del params["model.norm.weight"]
    params["extra.weight"] = torch.zeros(1)
    params["model.embed_tokens.weight"] = torch.zeros(3, 3)
    save_file(params, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_pretrained(tmp_path)
    message = str(err.value)
    assert "missing (1): model.norm.weight" in message
    assert "unexpected (1): extra.weight" in message
    assert "model.embed_tokens.weight: (3, 3) != (64, 32)" in message


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_pretrained(tmp_path)


HF_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def write_hf_model(path, family, tied, sharded, rope_scaling=None):
    config_cls, model_cls, extra = HF_MODELS[family]
    config = getattr(transformers, config_cls)(
        **SHAPE, **extra, tie_word_embeddings=tied, rope_scaling=rope_scaling
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases, so Qwen2's q/k/v biases are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    return model


@pytest.mark.parametrize(
    ("family", "tied", "sharded"),
    [("llama", True, False), ("llama", False, True), ("qwen2", False, False),
     ("qwen2", True, True), ("mistral", False, False)],
)  # fmt: skip
def test_logits_match_transformers(tmp_path, family, tied, sharded):
    model = write_hf_model(tmp_path, family, tied, sharded)
    assert sharded == (tmp_path / "model.safetensors.index.json").exists()
    params, cfg = load_pretrained(tmp_path)
    assert ("lm_head.weight" in params) != tied
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
    assert (forward(params, cfg, tokens) - expected).abs().max() < 1e-4


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ],
)  # fmt: skip
def test_rope_scaling_matches_transformers(tmp_path, rope_scaling):
    model = write_hf_model(tmp_path, "llama", True, False, rope_scaling=rope_scaling)
    params, cfg = load_pretrained(tmp_path)
    assert cfg.rope_scaling.rope_type == rope_scaling["rope_type"]
    tokens = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens).logits
    assert (forward(params, cfg, tokens) - expected).abs().max() < 1e-4


def test_greedy_generation_matches_transformers(tmp_path):
    model = write_hf_model(tmp_path, "qwen2", False, False)
    params, cfg = load_pretrained(tmp_path)
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True,
                                  pad_token_id=0)[0, 8:].tolist()  # fmt: skip
    cache = init_cache(cfg, batch=1, max_len=28)
    logits, cache = forward_cached(params, cfg, prompt, cache, start=0)
    ours = []
    for t in range(8, 28):
        ours.append(int(logits[0, -1].argmax()))
        logits, cache = forward_cached(params, cfg, torch.tensor([[ours[-1]]]), cache, start=t)
    assert ours == expected


def test_config_json_of_hf_folder_is_read(tmp_path):
    write_hf_model(tmp_path, "qwen2", True, False)
    data = json.loads((tmp_path / "config.json").read_text())
    _, cfg = load_pretrained(tmp_path)
    assert cfg.attention_bias and cfg.tie_word_embeddings
    assert cfg.num_key_value_heads == data["num_key_value_heads"]


@pytest.mark.parametrize(
    ("family", "windows"),
    [
        ("mistral", {"sliding_window": 5}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 5, "max_window_layers": 1}),
    ],
)
def test_sliding_windows_match_transformers(tmp_path, family, windows):
    config_cls, model_cls, _ = HF_MODELS[family]
    config = getattr(transformers, config_cls)(**SHAPE, **windows)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(tmp_path)
    params, cfg = load_pretrained(tmp_path)
    slides = [cfg.is_sliding_layer(i) for i in range(cfg.num_hidden_layers)]
    types = getattr(config, "layer_types", ["sliding_attention"] * 2)  # Mistral: every layer
    assert slides == [t == "sliding_attention" for t in types]
    tokens = torch.randint(0, 128, (2, 3 * 5 + 1), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens).logits
    assert (forward(params, cfg, tokens) - expected).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("llama", {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu_pytorch_tanh"}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
        ("mistral", {"sliding_window": 6, "tie_word_embeddings": True}),
    ],
)
def test_an_imported_model_saved_again_is_read_by_transformers(tmp_path, family, extra):
    config_cls, model_cls, _ = HF_MODELS[family]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases and norms, so a dropped one would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "hf")
    params, cfg = load_pretrained(tmp_path / "hf")
    save_pretrained(tmp_path / "ours", params, cfg)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is type(model)
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(tokens).logits
        assert torch.equal(again(tokens).logits, expected)
    assert (forward(params, cfg, tokens) - expected).abs().max() < 1e-4
    assert load_pretrained(tmp_path / "ours")[1] == cfg


def test_a_family_that_cannot_hold_the_model_is_refused_before_writing(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, family="mistral", use_qk_norm=True)  # fmt: skip
    with pytest.raises(ValueError, match="cannot hold use_qk_norm"):
        save_pretrained(tmp_path, init_params(cfg), cfg)
    assert not list(tmp_path.iterdir())
