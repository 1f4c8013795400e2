"""LoRA adapter folders in PEFT's format: PEFT's adapters run here as in PEFT, ours run in PEFT,
and what does not fit the base model is refused by name."""

import json

import pytest
import torch
from numerics import assert_close, forward_roundings
from safetensors.torch import load_file, save_file

from astrai import forward, init_lora, load_pretrained
from astrai.model.lora_folder import AdapterError, load_lora, save_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_llama(path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    model.save_pretrained(path)
    return model


def peft_adapter(base, folder, targets=TARGETS, save_embedding_layers="auto", **options):
    """A PEFT adapter with random A and B (init_lora_weights=False), written to folder."""
    torch.manual_seed(3)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **options
    )
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(folder, save_embedding_layers=save_embedding_layers)
    return model


def roundings(cfg, rank):
    # merging sums W + s * B @ A (rank terms) before the products instead of after them
    return forward_roundings(cfg, TOKENS.shape[1]) + rank


@pytest.mark.parametrize("options", [{}, {"use_rslora": True}])
def test_a_peft_adapter_runs_as_peft_merged_model(tmp_path, options):
    base = hf_llama(tmp_path / "base")
    peft_model = peft_adapter(base, tmp_path / "adapter", **options)
    params, cfg = load_pretrained(tmp_path / "base")
    lora, lora_cfg = load_lora(tmp_path / "adapter", cfg)
    assert lora_cfg.rank == 4 and set(lora_cfg.targets) == set(TARGETS)
    with torch.no_grad():
        expected = peft_model.merge_and_unload()(TOKENS).logits
    ours = forward(params, cfg, TOKENS, lora=lora)
    assert not torch.allclose(ours, forward(params, cfg, TOKENS))  # the adapter does something
    assert_close(ours, expected, roundings(cfg, 4))


def test_our_adapter_runs_in_peft(tmp_path):
    base = hf_llama(tmp_path / "base")
    params, cfg = load_pretrained(tmp_path / "base")
    lora = init_lora(params, cfg, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    for pair in lora["weights"].values():
        pair["B"] = torch.randn_like(pair["B"]) * 0.1
    save_lora(tmp_path / "ours", lora, cfg, base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    with torch.no_grad():
        expected = peft_model(TOKENS).logits
    assert_close(forward(params, cfg, TOKENS, lora=lora), expected, roundings(cfg, 4))
    again, _ = load_lora(tmp_path / "ours", cfg)  # and reads back exactly
    for key, pair in lora["weights"].items():
        assert torch.equal(again["weights"][key]["B"], pair["B"])


def test_a_run_folder_is_read_through_its_adapter_subfolder(tmp_path):
    hf_llama(tmp_path / "base")
    params, cfg = load_pretrained(tmp_path / "base")
    save_lora(tmp_path / "run" / "adapter", init_lora(params, cfg, rank=2), cfg)
    lora, lora_cfg = load_lora(tmp_path / "run", cfg)
    assert lora_cfg.rank == 2 and lora["weights"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 8}, "r=8"),
        ({"r": 0}, "r must be"),
    ],
)
def test_options_that_change_the_arithmetic_are_refused_by_name(tmp_path, change, named):
    base = hf_llama(tmp_path / "base")
    peft_adapter(base, tmp_path / "adapter")
    _, cfg = load_pretrained(tmp_path / "base")
    where = tmp_path / "adapter" / "adapter_config.json"
    where.write_text(json.dumps(json.loads(where.read_text()) | change))
    with pytest.raises(AdapterError, match=named):
        load_lora(tmp_path / "adapter", cfg)


def test_modules_and_shapes_that_do_not_fit_are_refused_by_name(tmp_path):
    base = hf_llama(tmp_path / "base")
    peft_adapter(base, tmp_path / "head", ["q_proj", "lm_head"], save_embedding_layers=False)
    _, cfg = load_pretrained(tmp_path / "base")
    with pytest.raises(AdapterError, match="module lm_head is not adapted"):
        load_lora(tmp_path / "head", cfg)
    peft_adapter(hf_llama(tmp_path / "base1"), tmp_path / "saved", ["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match=r"lm_head\.base_layer\.weight. is not a LoRA"):
        load_lora(tmp_path / "saved", cfg)  # PEFT saved the whole (tied) embedding too
    SHAPE["hidden_size"], hidden = 32, SHAPE["hidden_size"]
    try:
        hf_llama(tmp_path / "small")
    finally:
        SHAPE["hidden_size"] = hidden
    _, small = load_pretrained(tmp_path / "small")
    peft_adapter(hf_llama(tmp_path / "base2"), tmp_path / "wide", targets=["q_proj"])
    with pytest.raises(AdapterError, match=r"q_proj.lora_A is \(4, 64\).*needs \(4, 32\)"):
        load_lora(tmp_path / "wide", small)


def test_files_that_are_not_adapters_are_refused_by_name(tmp_path):
    base = hf_llama(tmp_path / "base")
    _, cfg = load_pretrained(tmp_path / "base")
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        load_lora(tmp_path / "base", cfg)
    peft_adapter(base, tmp_path / "adapter", targets=["q_proj"])
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors.pop(next(k for k in tensors if k.endswith("lora_B.weight")))
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match="but not both A and B"):
        load_lora(tmp_path / "adapter", cfg)
