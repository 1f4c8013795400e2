"""config.json of the Hugging Face families, read into a ModelConfig and written back.

Reading is strict. Each key of a family's config.json is read into ModelConfig, accepted only at
the one value we compute with (`neutral`), or on IGNORED (keys about how transformers runs, not
what it computes); anything else is a ConfigError naming the key and its value, so a model
whose numbers we would get wrong never loads. Writing (for `save_pretrained` of an imported
model) gives the family's keys as transformers writes them, and checks itself by reading back.
docs/models.md lists the families and what each maps to.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, get_args, get_type_hints

from astrai.config import ConfigError, ModelConfig, RopeScaling, from_dict

# Keys that say nothing about what a forward pass computes. Reviewed: add a key here only when
# no value of it changes a logit.
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
    "attention_dropout", "output_router_logits",
}  # fmt: skip

# Keys of every family that only one value of is a decoder-only language model.
NEUTRAL = {"is_encoder_decoder": False}

# Keys of every family, read below.
COMMON = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "initializer_range", "bos_token_id",
    "eos_token_id", "pad_token_id", "rope_parameters",
    # older files: transformers 5 moved these into rope_parameters
    "rope_theta", "rope_scaling",
}  # fmt: skip
LEGACY = {"rope_theta", "rope_scaling"}  # read, never written

# Copied as they are.
SHAPE = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
ACTIVATIONS = get_args(get_type_hints(ModelConfig)["hidden_act"])
ROPE_TYPES = get_args(get_type_hints(RopeScaling)["rope_type"])
WINDOW_KEYS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


class Family(NamedTuple):
    """What sets one Hugging Face family apart: its class name, the keys it writes besides
    COMMON, the ModelConfig fields it implies, keys accepted at one value only (transformers
    reads them for this family not at all, or we compute that value alone), and the values
    transformers assumes for keys a file leaves out."""

    architecture: str
    keys: frozenset[str]
    fixed: dict[str, Any]
    neutral: dict[str, Any]
    defaults: dict[str, Any]


UNTIED = {"tie_word_embeddings": False}

FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM",
        keys=frozenset({"attention_bias", "mlp_bias"}),
        fixed={},
        neutral={},
        defaults=UNTIED,
    ),
    "mistral": Family(
        "MistralForCausalLM",
        keys=frozenset({"sliding_window"}),
        fixed={},
        neutral={},
        defaults={**UNTIED, "sliding_window": 4096},
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM",
        keys=frozenset(WINDOW_KEYS),
        fixed={"attention_bias": True, "attention_out_bias": False},
        neutral={},
        defaults={**UNTIED, "max_window_layers": 28},
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM",
        keys=frozenset({"attention_bias", *WINDOW_KEYS}),
        fixed={"use_qk_norm": True},
        neutral={},
        defaults={**UNTIED, "max_window_layers": 28},
    ),
}


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def refused(source: str, key: str, value: Any, family: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {_shown(value)} is not supported ({family})")


def config_from_hf(data: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig; ConfigError names what is not
    supported."""
    name = data["model_type"]
    family = FAMILIES[name]
    hf = {**family.defaults, **data}
    neutral = NEUTRAL | family.neutral
    for key, value in hf.items():
        if key in neutral:
            if value != neutral[key]:
                raise refused(source, key, value, name)
        elif key not in COMMON and key not in family.keys and key not in IGNORED:
            raise refused(source, key, value, name)
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise refused(source, "hidden_act", act, name)
    try:
        fields = {
            **{k: hf[k] for k in SHAPE if k in hf},
            "hidden_act": act,
            "attention_bias": hf.get("attention_bias", False),
            "attention_out_bias": hf.get("attention_bias", False),
            "mlp_bias": hf.get("mlp_bias", False),
            **_rope(hf, name, source),
            **_windows(hf, name),
            **family.fixed,
            "model_type": "decoder",
            "family": name,
        }
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return from_dict(ModelConfig, fields, source)


# --- RoPE ----------------------------------------------------------------------------------

DEFAULT_THETA = 10000.0


def _rope(hf: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    """rope_theta and rope_scaling from transformers 5's rope_parameters, or from the
    rope_theta and rope_scaling keys of older files."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or DEFAULT_THETA
    kind = rope.pop("rope_type", None) or rope.get("type") or "default"
    rope.pop("type", None)
    if kind not in ROPE_TYPES:
        raise refused(source, "rope_parameters.rope_type", kind, name)
    scaling = None if kind == "default" else {"rope_type": kind, **rope}
    if kind == "default" and rope:
        key, value = next(iter(rope.items()))
        raise refused(source, f"rope_parameters.{key}", value, name)
    return {"rope_theta": float(theta), "rope_scaling": scaling}


# --- sliding windows -------------------------------------------------------------------------


def _after_max_window_layers(hf: dict[str, Any]) -> list[str]:
    """Qwen2 / Qwen3 files from before layer_types: the layers from max_window_layers on."""
    first = hf["max_window_layers"]
    return [_type(i >= first) for i in range(hf["num_hidden_layers"])]


def _type(sliding: bool) -> str:
    return "sliding_attention" if sliding else "full_attention"


# Which layers slide when a file names a window but no layer_types; not listed: every layer.
DEFAULT_LAYER_TYPES = {"qwen2": _after_max_window_layers, "qwen3": _after_max_window_layers}


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
    """cfg as its family's config.json (a dict). ValueError when the family's keys cannot
    hold cfg (a field would read back otherwise), naming the field."""
    family = FAMILIES[cfg.family]
    L = cfg.num_hidden_layers
    slides = [cfg.is_sliding_layer(i) for i in range(L)]
    every = {
        "architectures": [family.architecture],
        "model_type": cfg.family,
        **{k: getattr(cfg, k) for k in SHAPE},
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "rope_parameters": _rope_parameters(cfg),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None,
        "max_window_layers": slides.index(True) if any(slides) else L,
        "layer_types": [_type(s) for s in slides],
    }
    keys = (COMMON - LEGACY) | family.keys | {"architectures"}
    out = {k: v for k, v in every.items() if k in keys}
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
}  # fmt: skip


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    rs = cfg.rope_scaling
    if rs is None:
        return {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    fields = {k: getattr(rs, k) for k in ROPE_FIELDS[rs.rope_type] if getattr(rs, k) is not None}
    return {"rope_theta": cfg.rope_theta, "rope_type": rs.rope_type, **fields}
