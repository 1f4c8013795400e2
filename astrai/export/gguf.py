"""A model as one GGUF file for llama.cpp and Ollama, written with llama.cpp's own `gguf` package.

Our layout is Hugging Face's, so the export is a renaming (docs/export.md lists the names and
metadata keys) plus one change to the numbers: llama.cpp's `llama` architecture rotates
*adjacent* pairs of a head (x0, x1), (x2, x3), ... while we rotate the two *halves* (x_i,
x_{i+D/2}) as Hugging Face does, so the rows of the q and k projections are permuted to match
(the same permutation as llama.cpp's convert_hf_to_gguf.py). Models with QK-norm go out as
`qwen3`, which rotates halves like we do and needs no permutation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from astrai.config import ModelConfig
from astrai.export.gguf_vocab import gguf_vocab, write_vocab
from astrai.files import write_atomically
from astrai.model.rope import inv_frequencies

try:  # the optional `export` extra
    import gguf
except ImportError:  # pragma: no cover - exercised only without the extra
    gguf = None

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

# our key suffix (inside model.layers.{i}.) -> llama.cpp's tensor name (inside blk.{i}.)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


class GGUFExportError(ValueError):
    """The model uses something llama.cpp's GGUF architectures cannot express."""


def _require_gguf():
    if gguf is None:
        raise ImportError('GGUF export needs the gguf package: pip install -e ".[export]"')
    return gguf


def gguf_arch(cfg: ModelConfig) -> str:
    """The llama.cpp architecture that computes exactly what `forward` computes for cfg:
    "llama", or "qwen3" when the model normalises q and k; GGUFExportError names what no
    architecture here can express."""
    rs = cfg.rope_scaling
    rope_type = "default" if rs is None else rs.rope_type
    problems = [
        text
        for bad, text in (
            (
                cfg.model_type != "decoder",
                f"model_type={cfg.model_type!r} (llama.cpp's llama and qwen3 are causal decoders)",
            ),
            (cfg.attn_type == "mla", "multi-latent attention (attn_type='mla')"),
            (cfg.ffn_type == "moe", "our mixture-of-experts layout (ffn_type='moe')"),
            (cfg.use_gated_attention, "gated attention (use_gated_attention=true)"),
            *((True, feature) for feature in cfg.beyond_llama()),
            (
                rope_type == "dynamic",
                "rope_scaling.rope_type='dynamic' (llama.cpp has no dynamic NTK scaling)",
            ),
            (
                rope_type == "yarn" and (rs.attention_factor is not None or bool(rs.mscale)),
                "YaRN with an explicit attention_factor or mscale",
            ),
            (
                rope_type == "llama3" and cfg.use_qk_norm,
                "llama3 RoPE scaling together with QK-norm (llama.cpp's qwen3 reads no rope_freqs)",
            ),
        )
        if bad
    ]
    if problems:
        raise GGUFExportError("GGUF cannot express: " + "; ".join(problems))
    return "qwen3" if cfg.use_qk_norm else "llama"


def rotary_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias) from half-split to adjacent-pair rotary order: within
    each head, row j of the first half and row j of the second half become rows 2j and 2j+1."""
    D = w.shape[0] // heads
    return w.reshape(heads, 2, D // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our params -> {llama.cpp tensor name: float32 tensor in our [out, in] layout}, q/k rows
    permuted for the llama architecture, plus rope_freqs for llama3 RoPE scaling."""
    arch = gguf_arch(cfg)
    out = {}
    for key, tensor in params.items():
        t = tensor.detach().float().cpu()
        if key in _TOP_NAMES:
            out[_TOP_NAMES[key]] = t
            continue
        _, _, layer, rest = key.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.kv_heads
            t = rotary_permute(t, heads)
        out[f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"] = t
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "llama3":
        # llama.cpp divides each pair's angle by this factor; ours is folded into inv_freq
        D = cfg.dim_per_head
        default = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        out["rope_freqs.weight"] = (default / inv_frequencies(cfg, 1)[0]).float()
    return out


def _encode(tensor: torch.Tensor, type: str) -> tuple[np.ndarray, object]:
    """One tensor as the bytes and ggml type GGUF stores. Vectors (norms, biases, rope factors)
    stay float32 as llama.cpp's converter keeps them; q8_0 and q4_0 need rows in blocks of 32
    and fall back to f16 otherwise, as the converter and llama.cpp's quantizer do."""
    g = _require_gguf()
    data = tensor.numpy()
    qtype = {
        "f32": g.GGMLQuantizationType.F32,
        "f16": g.GGMLQuantizationType.F16,
        "bf16": g.GGMLQuantizationType.BF16,
        "q8_0": g.GGMLQuantizationType.Q8_0,
        "q4_0": g.GGMLQuantizationType.Q4_0,
    }[type]
    blocks = (g.GGMLQuantizationType.Q8_0, g.GGMLQuantizationType.Q4_0)
    if data.ndim == 1:
        qtype = g.GGMLQuantizationType.F32
    elif qtype in blocks and data.shape[-1] % g.GGML_QUANT_SIZES[qtype][0]:
        qtype = g.GGMLQuantizationType.F16
    return g.quants.quantize(data, qtype), qtype


def _write_hparams(writer, cfg: ModelConfig, type: str) -> None:
    g = _require_gguf()
    writer.add_file_type(
        {
            "f32": g.LlamaFileType.ALL_F32,
            "f16": g.LlamaFileType.MOSTLY_F16,
            "bf16": g.LlamaFileType.MOSTLY_BF16,
            "q8_0": g.LlamaFileType.MOSTLY_Q8_0,
            "q4_0": g.LlamaFileType.MOSTLY_Q4_0,
        }[type]
    )
    writer.add_quantization_version(g.GGML_QUANT_VERSION)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_key_length(cfg.dim_per_head)
    writer.add_value_length(cfg.dim_per_head)
    writer.add_rope_dimension_count(cfg.dim_per_head)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rs = cfg.rope_scaling
    if rs is None or rs.rope_type in ("default", "llama3"):  # llama3 travels as rope_freqs
        return
    original = rs.original_max_position_embeddings or cfg.max_position_embeddings
    if rs.rope_type == "linear":
        writer.add_rope_scaling_type(g.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rs.factor)
    else:  # yarn
        writer.add_rope_scaling_type(g.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rs.factor)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_yarn_beta_fast(rs.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(rs.beta_slow)


def save_gguf(
    path,
    params: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tokenizer=None,
    type: str = "f32",
    name: str = "astrai",
) -> None:
    """Write one GGUF file llama.cpp and Ollama load: hyperparameters, tensors in `type` (one of
    f32, f16, bf16, q8_0, q4_0) and the tokenizer with its chat template.

    Without a tokenizer the file has llama.cpp's "none" vocabulary: it maps token ids to token
    ids only, which is what a benchmark needs and nothing else. The file is written to a
    temporary name and renamed, so a failed export leaves no torn file.
    """
    g = _require_gguf()
    if type not in GGUF_TYPES:
        raise ValueError(f"type must be one of {', '.join(GGUF_TYPES)}, got {type!r}")
    arch = gguf_arch(cfg)
    tensors = gguf_tensors(params, cfg)
    vocab = gguf_vocab(tokenizer, cfg.vocab_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: _write_file(g, tmp, arch, name, cfg, type, vocab, tensors))


def _write_file(g, tmp: str, arch: str, name: str, cfg: ModelConfig, type: str, vocab, tensors):
    writer = g.GGUFWriter(tmp, arch)
    writer.add_name(name)
    _write_hparams(writer, cfg, type)
    write_vocab(writer, vocab)
    for tensor_name, tensor in tensors.items():
        data, qtype = _encode(tensor, type)
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
