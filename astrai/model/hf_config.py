"""config.json of the Hugging Face families, read into a ModelConfig and written back.

Reading is strict. Each key of a family's config.json is read into ModelConfig, accepted at the
values we compute with only (`neutral`), or on IGNORED (keys about how transformers runs, not
what it computes); anything else is a ConfigError naming the key and its value, so a model
whose numbers we would get wrong never loads. Writing (for `save_pretrained` of an imported
model) gives the family's keys as transformers writes them, and checks itself by reading back.
docs/models.md lists the families and what each maps to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, get_args, get_type_hints

from astrai.config import ConfigError, HFFamily, ModelConfig, RopeScaling, from_dict

# Keys that say nothing about what a forward pass computes. Reviewed: a key belongs here only
# when no value of it changes a logit.
IGNORED = {
    # where the file came from
    "_name_or_path", "architectures", "auto_map", "transformers_version",
    # how transformers runs the model: the weights' dtype, caching, what it returns, and
    # pretraining_tp (the same products split in slices; transformers 5 no longer reads it)
    "torch_dtype", "dtype", "use_cache", "cache_implementation", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "pretraining_tp",
    # the labels of classification heads, which a causal language model does not have
    "id2label", "label2id", "problem_type",
    # regularisation transformers applies while training only; our trainer has its own
    "attention_dropout", "embd_pdrop", "resid_pdrop", "router_jitter_noise",
    # what transformers' forward returns besides the logits
    "output_router_logits",
}  # fmt: skip

# Keys every family writes, read below, and keys of older files (transformers 5 moved them
# into rope_parameters), read and never written.
COMMON = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "initializer_range", "bos_token_id",
    "eos_token_id", "pad_token_id", "rope_parameters",
}  # fmt: skip
COMMON_OLDER = {"rope_theta", "rope_scaling"}
# Keys of every family at the values a decoder-only language model has.
NEUTRAL = {"is_encoder_decoder": (False,)}

# Copied as they are.
SHAPE = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
ACTIVATIONS = get_args(get_type_hints(ModelConfig)["hidden_act"])
ROPE_TYPES = get_args(get_type_hints(RopeScaling)["rope_type"])


class Family(NamedTuple):
    """What sets one Hugging Face family apart: its class name; the keys it writes besides
    COMMON, and those only older files have; the ModelConfig fields it implies; keys accepted
    at the listed values only (a value transformers ignores for this family, or the one we
    compute); the values transformers assumes for keys a file leaves out."""

    architecture: str
    keys: frozenset[str]
    older: frozenset[str]
    fixed: dict[str, Any]
    neutral: dict[str, tuple]
    defaults: dict[str, Any]


def family(architecture: str, keys, older=(), fixed=None, neutral=None, defaults=None) -> Family:
    return Family(
        architecture, frozenset(keys), frozenset(older), fixed or {}, neutral or {}, defaults or {}
    )


WINDOWS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
GEMMA = {
    "attention_bias", "hidden_activation", "query_pre_attn_scalar", "sliding_window",
    "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
}  # fmt: skip
GEMMA_FIXED = {"norm_placement": "sandwich", "rms_norm_unit_offset": True}
GEMMA_DEFAULTS = {
    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
}  # fmt: skip
UNTIED = {"tie_word_embeddings": False}
GRANITE = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
MOE_DEFAULTS = {"router_aux_loss_coef": 0.001}
# Mixtral and Qwen3-MoE: routed experts only, no expert every token goes through
ROUTED_ONLY = {
    "ffn_type": "moe",
    "n_shared_experts": 0,
    "first_k_dense_replace": 0,
    "decoder_sparse_step": 1,
}

FAMILIES: dict[str, Family] = {
    "llama": family("LlamaForCausalLM", {"hidden_act", "attention_bias", "mlp_bias"}, defaults=UNTIED),
    "mistral": family(
        "MistralForCausalLM", {"hidden_act", "sliding_window"},
        defaults={**UNTIED, "sliding_window": 4096},
    ),
    "qwen2": family(
        "Qwen2ForCausalLM", {"hidden_act", *WINDOWS},
        fixed={"attention_bias": True, "attention_out_bias": False},
        defaults={**UNTIED, "max_window_layers": 28},
    ),
    "qwen3": family(
        "Qwen3ForCausalLM", {"hidden_act", "attention_bias", *WINDOWS},
        fixed={"use_qk_norm": True},
        defaults={**UNTIED, "max_window_layers": 28},
    ),
    "qwen3_moe": family(
        "Qwen3MoeForCausalLM",
        {"hidden_act", "attention_bias", "use_sliding_window", "sliding_window", "num_local_experts",
         "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
         "mlp_only_layers", "router_aux_loss_coef"},
        # num_experts: transformers 5 writes num_local_experts. max_window_layers: released files
        # have it, transformers' Qwen3-MoE does not read it (a window would cover every layer)
        older={"num_experts", "max_window_layers"},
        fixed={**ROUTED_ONLY, "use_qk_norm": True},
        defaults={**UNTIED, **MOE_DEFAULTS, "norm_topk_prob": False, "decoder_sparse_step": 1},
    ),
    "mixtral": family(
        "MixtralForCausalLM",
        {"hidden_act", "sliding_window", "num_local_experts", "num_experts_per_tok",
         "router_aux_loss_coef"},
        fixed={**ROUTED_ONLY, "norm_topk_prob": True},
        defaults={**UNTIED, **MOE_DEFAULTS, "rope_theta": 1e6},
    ),
    "gemma2": family(
        "Gemma2ForCausalLM", GEMMA, older={"hidden_act"},
        fixed=GEMMA_FIXED,
        neutral={"use_bidirectional_attention": (None, False)},
        defaults={**GEMMA_DEFAULTS, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    ),
    "gemma3_text": family(
        "Gemma3ForCausalLM", GEMMA - {"attn_logit_softcapping"} | {"_sliding_window_pattern"},
        older={"hidden_act", "sliding_window_pattern", "rope_local_base_freq"},
        fixed={**GEMMA_FIXED, "use_qk_norm": True},
        # transformers' Gemma 3 reads no attn_logit_softcapping; Gemma 3 attends bidirectionally
        # only as an embedding model
        neutral={"attn_logit_softcapping": (None,), "use_bidirectional_attention": (None, False)},
        defaults={**GEMMA_DEFAULTS, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0},
    ),
    "phi3": family(
        "Phi3ForCausalLM",
        {"hidden_act", "sliding_window", "original_max_position_embeddings"},
        older={"partial_rotary_factor"},  # transformers 5 keeps it in rope_parameters
        # Phi-4-mini's file names these at the values transformers' Phi-3 computes (it reads
        # none of them: no biases, no other attention pattern or interpolation)
        neutral={
            "attention_bias": (False,), "mlp_bias": (False,), "lm_head_bias": (False,),
            "full_attn_mod": (1,), "interpolate_factor": (1,),
        },
        defaults={**UNTIED, "original_max_position_embeddings": 4096},
    ),
    "smollm3": family(
        "SmolLM3ForCausalLM",
        {"hidden_act", "attention_bias", "mlp_bias", "use_sliding_window", "sliding_window",
         "layer_types", "no_rope_layers", "no_rope_layer_interval"},
        # its first files carry Qwen2's max_window_layers, which transformers' SmolLM3 does not
        # read: layer_types (or the NoPE layers) say which layers slide
        older={"max_window_layers"},
        defaults={"tie_word_embeddings": True, "no_rope_layer_interval": 4, "rope_theta": 2e6},
    ),
    "olmo2": family(
        "Olmo2ForCausalLM", {"hidden_act", "attention_bias"},
        fixed={"norm_placement": "post", "use_qk_norm": True, "qk_norm_per_head": False},
        defaults=UNTIED,
    ),
    "granite": family(
        "GraniteForCausalLM",
        {"hidden_act", "attention_bias", "mlp_bias", *GRANITE},
        defaults={**UNTIED, **dict.fromkeys(GRANITE, 1.0)},
    ),
}  # fmt: skip


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def refused(source: str, key: str, value: Any, name: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {_shown(value)} is not supported ({name})")


def config_from_hf(data: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig; a ConfigError names what is not
    supported."""
    name = data["model_type"]
    fam = FAMILIES[name]
    hf = {**fam.defaults, **data}
    neutral = NEUTRAL | fam.neutral
    known = COMMON | COMMON_OLDER | fam.keys | fam.older | IGNORED
    for key, value in hf.items():
        if key in neutral:
            if value not in neutral[key]:
                raise refused(source, key, value, name)
        elif key not in known:
            raise refused(source, key, value, name)
    try:
        fields = {
            **{k: hf[k] for k in SHAPE if k in hf},
            "hidden_act": _activation(hf, name, source),
            "attention_bias": hf.get("attention_bias", False),
            "attention_out_bias": hf.get("attention_bias", False),
            "mlp_bias": hf.get("mlp_bias", False),
            **_rope(hf, name, source),
            **_windows(hf, name),
            **(READERS[name](hf) if name in READERS else {}),
            **fam.fixed,
            "model_type": "decoder",
            "family": name,
        }
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return from_dict(ModelConfig, fields, source)


def _activation(hf: dict[str, Any], name: str, source: str) -> str:
    """hidden_act, or Gemma's hidden_activation (its files may repeat it as hidden_act)."""
    act = hf.get("hidden_activation", hf.get("hidden_act", "silu"))
    key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    if act not in ACTIVATIONS:
        raise refused(source, key, act, name)
    if hf.get("hidden_act", act) != act:
        other = hf["hidden_act"]
        raise ConfigError(f"{source}: hidden_act: {other} disagrees with hidden_activation: {act}")
    return act


def _gemma(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3: embeddings scaled by sqrt(hidden_size), scores by 1 / sqrt of
    query_pre_attn_scalar, capped scores (Gemma 2) and logits."""
    return {
        "embedding_multiplier": hf["hidden_size"] ** 0.5,
        "query_pre_attn_scalar": hf["query_pre_attn_scalar"],
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
    }


def _granite(hf: dict[str, Any]) -> dict[str, Any]:
    """Granite: multipliers of the embeddings, each block's output and the attention scores,
    and a divisor of the logits."""
    return {k: hf[k] for k in GRANITE}


def _rope_flags(hf: dict[str, Any]) -> list[int]:
    """SmolLM3's no_rope_layers: 1 where a layer applies RoPE; by default all but every
    no_rope_layer_interval-th."""
    every = hf["no_rope_layer_interval"]
    flags = hf.get("no_rope_layers") or [
        int((i + 1) % every != 0) for i in range(hf["num_hidden_layers"])
    ]
    return flags[: hf["num_hidden_layers"]]


def _smollm3(hf: dict[str, Any]) -> dict[str, Any]:
    return {"nope_layers": [i for i, rotates in enumerate(_rope_flags(hf)) if not rotates]}


def _experts(hf: dict[str, Any]) -> dict[str, Any]:
    """Mixtral / Qwen3-MoE's routed experts. Mixtral's are intermediate_size wide; Qwen3-MoE
    keeps dense MLPs in mlp_only_layers and wherever (i + 1) % decoder_sparse_step != 0."""
    L, every = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or ()) | {i for i in range(L) if (i + 1) % every}
    return {
        "n_routed_experts": hf.get("num_local_experts", hf.get("num_experts")),
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf.get("moe_intermediate_size", hf["intermediate_size"]),
        "norm_topk_prob": hf.get("norm_topk_prob", True),
        "mlp_only_layers": sorted(dense),
        "router_aux_loss_coef": hf["router_aux_loss_coef"],
    }


# The fields a family reads beyond those every family has.
READERS = {
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "granite": _granite,
    "smollm3": _smollm3,
    "qwen3_moe": _experts,
    "mixtral": _experts,
}


# --- RoPE ----------------------------------------------------------------------------------

DEFAULT_THETA = 10000.0


def _rope(hf: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    """rope_theta and rope_scaling from transformers 5's rope_parameters, or from the rope_theta
    and rope_scaling keys of older files; Gemma 3's sliding layers rotate by their own base
    (rope_parameters per layer type, or rope_local_base_freq)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" not in params and "sliding_attention" not in params:
        out = _one_rope(params or hf.get("rope_scaling") or {}, hf, name, source)
        if "rope_local_base_freq" in hf:
            out["rope_local_base_freq"] = float(hf["rope_local_base_freq"])
        return out
    if "rope_local_base_freq" not in FAMILIES[name].older:
        raise refused(source, "rope_parameters", params, name)
    local_base = {"rope_theta": hf["rope_local_base_freq"]}
    local = _one_rope(params.get("sliding_attention") or {}, local_base, name, source)
    if local["rope_scaling"] is not None:
        kind = local["rope_scaling"]["rope_type"]
        raise refused(source, "rope_parameters.sliding_attention.rope_type", kind, name)
    full = _one_rope(params.get("full_attention") or {}, hf, name, source)
    return {**full, "rope_local_base_freq": local["rope_theta"]}


def _one_rope(params: dict[str, Any], hf: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    rope = dict(params)
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or DEFAULT_THETA
    kind = rope.pop("rope_type", None) or rope.get("type") or "default"
    rope.pop("type", None)
    out = {"rope_theta": float(theta)}
    if "partial_rotary_factor" in FAMILIES[name].older:
        out["partial_rotary_factor"] = rope.pop("partial_rotary_factor", None) or hf.get(
            "partial_rotary_factor", 1.0
        )
    if name == "phi3" and kind in ("su", "yarn"):  # transformers' names of Phi-3's longrope
        kind = "longrope"
    if kind == "longrope":
        rope = _longrope(rope, hf)
    if kind not in ROPE_TYPES:
        raise refused(source, "rope_parameters.rope_type", kind, name)
    if kind == "default" and rope:
        key, value = next(iter(rope.items()))
        raise refused(source, f"rope_parameters.{key}", value, name)
    return out | {"rope_scaling": None if kind == "default" else {"rope_type": kind, **rope}}


def _longrope(rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's context lengths: the original one from the file's top level when the RoPE keys do
    not say it, and the factor, when not given, as how many times longer the context became."""
    original = rope.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings"
    )
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    return {**rope, "original_max_position_embeddings": original, "factor": factor}


# --- sliding windows -------------------------------------------------------------------------


def _type(sliding: bool) -> str:
    return "sliding_attention" if sliding else "full_attention"


def _after_max_window_layers(hf: dict[str, Any]) -> list[str]:
    """Qwen2 / Qwen3 files from before layer_types: the layers from max_window_layers on."""
    return [_type(i >= hf["max_window_layers"]) for i in range(hf["num_hidden_layers"])]


def _gemma2_layers(hf: dict[str, Any]) -> list[str]:
    return [_type(i % 2 == 0) for i in range(hf["num_hidden_layers"])]


def _gemma3_layers(hf: dict[str, Any]) -> list[str]:
    """Every sliding_window_pattern-th layer attends to the whole sequence."""
    every = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return [_type((i + 1) % every != 0) for i in range(hf["num_hidden_layers"])]


def _smollm3_layers(hf: dict[str, Any]) -> list[str]:
    """SmolLM3: the layers without RoPE."""
    return [_type(not rotates) for rotates in _rope_flags(hf)]


# Which layers slide when a file names a window but no layer_types; not listed: every layer.
DEFAULT_LAYER_TYPES = {
    "qwen2": _after_max_window_layers,
    "qwen3": _after_max_window_layers,
    "gemma2": _gemma2_layers,
    "gemma3_text": _gemma3_layers,
    "smollm3": _smollm3_layers,
}


def _windows(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """sliding_window and layer_types, in one form: no window when no layer slides, no
    layer_types when every layer does."""
    window, types = hf.get("sliding_window"), hf.get("layer_types")
    if "use_sliding_window" in FAMILIES[name].keys and not hf.get("use_sliding_window"):
        window = None  # the family's switch is off: transformers drops the window
    if window is None:
        if "sliding_attention" in (types or ()):
            raise ValueError("layer_types names sliding_attention layers, but no sliding_window")
        return {"sliding_window": None, "layer_types": None}
    if types is None and name in DEFAULT_LAYER_TYPES:
        types = DEFAULT_LAYER_TYPES[name](hf)
    if types is None or all(t == "sliding_attention" for t in types):
        return {"sliding_window": window, "layer_types": None}
    if "sliding_attention" not in types:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": types}


# --- writing ---------------------------------------------------------------------------------


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """cfg as its family's config.json (a dict). ValueError when the family's keys cannot hold
    cfg (a field would read back otherwise), naming the field."""
    fam = FAMILIES[cfg.family]
    L = cfg.num_hidden_layers
    slides = [cfg.is_sliding_layer(i) for i in range(L)]
    every = {
        "architectures": [fam.architecture],
        "model_type": cfg.family,
        **{k: getattr(cfg, k) for k in SHAPE},
        "hidden_act": cfg.hidden_act,
        "hidden_activation": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "rope_parameters": _rope_parameters(cfg),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None,
        "max_window_layers": slides.index(True) if any(slides) else L,
        "layer_types": [_type(s) for s in slides],
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        **{k: getattr(cfg, k) for k in GRANITE},
        "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(L)],
        "no_rope_layer_interval": 4,  # transformers reads no_rope_layers first
        "num_local_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "original_max_position_embeddings": (
            cfg.rope_scaling.original_max_position_embeddings
            if cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position_embeddings
            else cfg.max_position_embeddings
        ),
    }
    out = {k: v for k, v in every.items() if k in COMMON | fam.keys | {"architectures"}}
    if cfg.head_dim is None:  # some families' modules take a head_dim of None at its word
        del out["head_dim"]
    back = config_from_hf(out, f"{cfg.family} config.json")
    for field in cfg.__struct_fields__:
        if getattr(back, field) != getattr(cfg, field):
            raise ValueError(
                f"a {cfg.family} config.json cannot hold {field} = {getattr(cfg, field)!r} "
                f"(it would read back as {getattr(back, field)!r})"
            )
    return out


# The fields of RopeScaling each rope_type reads.
ROPE_FIELDS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": (
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "attention_factor",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": (
        "factor", "original_max_position_embeddings", "attention_factor", "short_factor",
        "long_factor",
    ),
}  # fmt: skip


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.family == "phi3":
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    if (rs := cfg.rope_scaling) is not None:
        rope |= {"rope_type": rs.rope_type}
        rope |= {k: getattr(rs, k) for k in ROPE_FIELDS[rs.rope_type] if getattr(rs, k) is not None}
    if cfg.rope_local_base_freq is None:
        return rope
    local = {"rope_theta": cfg.rope_local_base_freq, "rope_type": "default"}
    return {"full_attention": rope, "sliding_attention": local}


def model_config_from_json(path: str | Path) -> ModelConfig:
    """Read config.json: AstrAI's own, or one of a Hugging Face family (docs/models.md)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    kind = data.get("model_type", "decoder")
    if kind in get_args(HFFamily):
        return config_from_hf(data, str(path))
    if kind not in ("decoder", "encoder"):
        families = ", ".join(get_args(HFFamily))
        raise ConfigError(f"{path}: model_type: {kind} is not supported (ours, or {families})")
    return from_dict(ModelConfig, data, str(path))
