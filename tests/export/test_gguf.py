"""GGUF export read back with gguf's own reader: the tensors are our weights (q/k permuted for
llama.cpp's rotary order), the metadata says what the config says, and what GGUF cannot
express is refused by name. Running the file in llama.cpp is tests/peer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import astrai as ai
from astrai.config import RopeScaling
from astrai.export import GGUFExportError, save_gguf
from astrai.export.gguf import rotary_permute
from astrai.export.gguf_vocab import CONTROL, NORMAL, UNUSED, USER_DEFINED
from astrai.tokenizer import CHATML_SPECIALS

gguf = pytest.importorskip("gguf", reason='GGUF export needs the gguf package (".[export]")')

ROOT = Path(__file__).resolve().parents[2]
CFG = ai.ModelConfig(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    attention_bias=True,
    tie_word_embeddings=False,
)
TEXTS = ["hello world, 123 + 45 = 168", "the quick brown fox jumps over the lazy dog"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return ai.Tokenizer.train(TEXTS, vocab_size=300, split_digits=True)


def read(path):
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    return fields, {t.name: t for t in reader.tensors}


def as_torch(t) -> torch.Tensor:
    """A GGUF tensor back in our [out, in] layout, dequantized to float32."""
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(data.copy()).float().reshape(tuple(reversed(t.shape.tolist())))


def test_f32_tensors_are_our_weights_with_q_and_k_rows_permuted(tmp_path, tokenizer):
    params = ai.init_params(CFG, seed=1)
    save_gguf(tmp_path / "m.gguf", params, CFG, tokenizer, type="f32")
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "llama"
    assert len(tensors) == len(params)  # lm_head is output.weight: untied goes out untied
    for i in range(CFG.num_hidden_layers):
        p = f"model.layers.{i}.self_attn"
        for ours, theirs, heads in (("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)):
            for kind in ("weight", "bias"):
                got = as_torch(tensors[f"blk.{i}.{theirs}.{kind}"])
                assert torch.equal(got, rotary_permute(params[f"{p}.{ours}.{kind}"], heads))
        assert torch.equal(as_torch(tensors[f"blk.{i}.attn_v.bias"]), params[f"{p}.v_proj.bias"])
        assert torch.equal(
            as_torch(tensors[f"blk.{i}.ffn_down.weight"]),
            params[f"model.layers.{i}.mlp.down_proj.weight"],
        )
    assert torch.equal(as_torch(tensors["output.weight"]), params["lm_head.weight"])


def test_rotary_permutation_turns_half_split_rotation_into_adjacent_pairs():
    """llama.cpp rotates (x0, x1), (x2, x3), ...; we rotate (x_j, x_{j+D/2}). Rotating the
    permuted projection adjacent-pair-wise must give the permuted result of ours."""
    heads, D = 3, 8
    w = torch.randn(heads * D, 16, dtype=torch.float64)
    x = torch.randn(16, dtype=torch.float64)
    angle = torch.rand(D // 2, dtype=torch.float64) * 6
    cos, sin = angle.cos(), angle.sin()

    def ours(q):  # per head: half-split pairs
        a, b = q[: D // 2], q[D // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin])

    def llama_cpp(q):  # per head: adjacent pairs
        a, b = q[0::2], q[1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).reshape(D)

    mine = torch.cat([ours(h) for h in (w @ x).view(heads, D)])
    theirs = torch.cat([llama_cpp(h) for h in (rotary_permute(w, heads) @ x).view(heads, D)])
    assert torch.allclose(theirs, rotary_permute(mine, heads), atol=1e-12)


@pytest.mark.parametrize("type", ["f16", "bf16", "q8_0", "q4_0"])
def test_smaller_types_round_within_their_precision(tmp_path, tokenizer, type):
    params = ai.init_params(CFG, seed=2)
    save_gguf(tmp_path / "m.gguf", params, CFG, tokenizer, type=type)
    _, tensors = read(tmp_path / "m.gguf")
    # f16/bf16: half an ulp of the value (f16's subnormals below 2^-14: half of 2^-24);
    # q8_0: half a step of 1/127 of the 32-wide block's largest magnitude, plus the rounding of
    # that step to f16 multiplied by up to 127 steps; q4_0: the step is 1/8 of the block's
    # largest magnitude, its 16 levels from -8 to 7 steps leave a whole step at the other
    # end of the block, plus the step's f16 rounding multiplied by up to 8 steps
    rel = {
        "f16": 2.0**-11,
        "bf16": 2.0**-8,
        "q8_0": (0.5 + 127 * 2.0**-11) / 127,
        "q4_0": (1 + 8 * 2.0**-11) / 8,
    }[type]
    floor = 2.0**-25 if type == "f16" else 0.0
    w = params["model.layers.0.mlp.up_proj.weight"]
    t = tensors["blk.0.ffn_up.weight"]
    assert t.tensor_type.name == type.upper()
    got = as_torch(t)
    if type in ("q8_0", "q4_0"):
        bound = w.abs().view(w.shape[0], -1, 32).amax(-1, keepdim=True) * rel * 1.01
        assert ((got - w).abs().view_as(bound.expand(-1, -1, 32)) <= bound).all()
    else:
        assert ((got - w).abs() <= w.abs() * rel * 1.01 + floor).all()
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # vectors stay exact


def test_metadata_and_vocabulary(tmp_path):
    cfg = ai.ModelConfig(**{**_fields(CFG), "rope_scaling": RopeScaling("linear", 2.0)})
    tokenizer = ai.Tokenizer.train(TEXTS, vocab_size=300, split_digits=True)
    tokenizer.backend.add_tokens(["<note>"])  # added, not special: llama.cpp's user-defined
    save_gguf(tmp_path / "m.gguf", ai.init_params(cfg), cfg, tokenizer)
    fields, _ = read(tmp_path / "m.gguf")
    assert fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 16
    assert fields["llama.rope.scaling.type"] == "linear"
    assert fields["llama.rope.scaling.factor"] == 2.0
    assert fields["tokenizer.ggml.pre"] == "smollm"  # digits split singly, then GPT-2's regex
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == CFG.vocab_size
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    assert all(tokens[i] == t for t, i in vocab.items())
    specials = [tokenizer.token_to_id(t) for t in CHATML_SPECIALS]
    assert [types[i] for i in specials] == [CONTROL] * len(CHATML_SPECIALS)
    assert types[tokenizer.token_to_id("<note>")] == USER_DEFINED
    hello = tokenizer.encode("hello world")  # ids the vocabulary holds, whatever BPE merged
    assert hello and all(types[i] == NORMAL for i in hello)
    assert types.count(NORMAL) == len(vocab) - len(CHATML_SPECIALS) - 1  # all the others
    assert types[CFG.vocab_size - 1] == UNUSED  # embedding rows beyond the tokenizer
    assert fields["tokenizer.ggml.eot_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template
    merges = fields["tokenizer.ggml.merges"]
    assert merges and all(len(m.split(" ")) == 2 for m in merges)


def test_qk_norm_goes_out_as_qwen3_without_permutation(tmp_path, tokenizer):
    cfg = ai.ModelConfig(**{**_fields(CFG), "use_qk_norm": True, "attention_bias": False})
    params = ai.init_params(cfg, seed=3)
    save_gguf(tmp_path / "m.gguf", params, cfg, tokenizer)
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "qwen3"
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(as_torch(tensors["blk.0.attn_q.weight"]), q)
    assert "blk.0.attn_k_norm.weight" in tensors


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"attn_type": "mla"}, "multi-latent attention"),
        ({"ffn_type": "moe"}, "mixture-of-experts"),
        ({"use_gated_attention": True}, "gated attention"),
        ({"model_type": "encoder"}, "model_type='encoder'"),
        ({"rope_scaling": RopeScaling("dynamic", 2.0)}, "dynamic"),
        ({"sliding_window": 4}, "sliding-window attention"),
        (
            {"hidden_act": "gelu_pytorch_tanh", "rms_norm_unit_offset": True},
            "hidden_act='gelu_pytorch_tanh'; rms_norm_unit_offset=True",
        ),
    ],
)
def test_what_gguf_cannot_express_is_refused_by_name(tmp_path, change, named):
    cfg = ai.ModelConfig(**{**_fields(CFG), **change})
    with pytest.raises(GGUFExportError, match=named):
        save_gguf(tmp_path / "m.gguf", ai.init_params(cfg), cfg)
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind


def test_export_command_writes_a_file_and_names_a_missing_tokenizer(tmp_path, tokenizer):
    model = tmp_path / "model"
    ai.save_pretrained(model, ai.init_params(CFG), CFG, tokenizer=tokenizer)
    run = [sys.executable, str(ROOT / "programs/export.py"), "--model", str(model), "--format", "gguf"]  # fmt: skip
    done = subprocess.run([*run, "--out", str(tmp_path / "m.gguf"), "--type", "q8_0"], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    fields, tensors = read(tmp_path / "m.gguf")
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert fields["general.name"] == "model"
    (model / "tokenizer.json").unlink()
    done = subprocess.run([*run, "--out", str(tmp_path / "n.gguf")], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2
    assert "no tokenizer.json" in done.stderr and not (tmp_path / "n.gguf").exists()


def _fields(cfg) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__struct_fields__}


def test_tokenizers_llama_cpp_would_split_differently_are_refused(tmp_path, tokenizer):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    word_level = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    metaspace = ai.Tokenizer.train(TEXTS, vocab_size=300)
    metaspace.backend.pre_tokenizer = pre_tokenizers.Metaspace()
    for tok, named in ((ai.Tokenizer(word_level), "BPE"), (metaspace, "Metaspace")):
        with pytest.raises(ValueError, match=named):
            save_gguf(tmp_path / "m.gguf", ai.init_params(CFG), CFG, tok)
    small = ai.ModelConfig(**{**_fields(CFG), "vocab_size": 256})
    with pytest.raises(ValueError, match="vocab_size is 256"):
        save_gguf(tmp_path / "m.gguf", ai.init_params(small), small, tokenizer)
    assert not list(tmp_path.iterdir())
