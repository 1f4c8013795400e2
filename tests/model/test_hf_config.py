"""Reading Hugging Face config.json: every key transformers writes is used or on the reviewed
ignore list, and what we do not compute is refused by name."""

import copy
import json

import pytest

from astrai.config import ConfigError
from astrai.model import model_config_from_json
from astrai.model.hf_config import (
    COMMON,
    FAMILIES,
    IGNORED,
    NEUTRAL,
    config_from_hf,
    config_to_hf,
)

transformers = pytest.importorskip("transformers")

CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "smollm3": "SmolLM3Config",
    "olmo2": "Olmo2Config",
    "granite": "GraniteConfig",
}


def hf_defaults(family: str) -> dict:
    """The config.json transformers writes for the family's default configuration."""
    return getattr(transformers, CONFIG_CLASSES[family])().to_dict()


def test_every_supported_family_has_its_transformers_config_class():
    assert set(CONFIG_CLASSES) == set(FAMILIES)


@pytest.mark.parametrize("family", list(CONFIG_CLASSES))
def test_every_key_transformers_writes_is_read_or_ignored(family):
    data = hf_defaults(family)
    fam = FAMILIES[family]
    known = COMMON | fam.keys | set(NEUTRAL) | set(fam.neutral)
    assert set(data) - known - IGNORED == set()
    assert fam.keys - set(data) == set()  # the keys we write are the ones transformers writes
    cfg = config_from_hf(data)
    assert cfg.family == family
    assert config_from_hf(config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("family", list(CONFIG_CLASSES))
def test_files_from_before_rope_parameters_read_alike(family):
    data = hf_defaults(family)
    older = {k: v for k, v in data.items() if k not in ("rope_parameters", "layer_types")}
    assert config_from_hf(older) == config_from_hf(data)


@pytest.mark.parametrize("family", list(CONFIG_CLASSES))
def test_the_values_assumed_for_missing_keys_are_transformers_defaults(family):
    data = hf_defaults(family)
    for key, value in FAMILIES[family].defaults.items():
        if key in data:  # the RoPE bases are checked above
            assert data[key] == value, key


# Keys that change nothing unless another key switches them on: each is changed with these set.
SWITCHED_ON_BY = {
    "use_sliding_window": {"sliding_window": 4, "layer_types": None},
    "sliding_window": {"use_sliding_window": True, "layer_types": None},
    "max_window_layers": {"use_sliding_window": True, "sliding_window": 4, "layer_types": None},
    "_sliding_window_pattern": {"layer_types": None},
    "no_rope_layer_interval": {"no_rope_layers": None},
    "original_max_position_embeddings": lambda data: {"rope_parameters": longrope(data)},
}


def longrope(data: dict) -> dict:
    half = data["hidden_size"] // data["num_attention_heads"] // 2
    factors = {"short_factor": [1.0] * half, "long_factor": [2.0] * half}
    return {"rope_type": "longrope", "rope_theta": 1e4, **factors}


def changed(value):
    """Another value of the same kind."""
    match value:
        case bool():
            return not value
        case int() | float():
            return value * 2 if value else 1
        case None:
            return 4
        case "silu":
            return "gelu_pytorch_tanh"
        case "gelu_pytorch_tanh":
            return "silu"
        case ["sliding_attention", *rest]:
            return ["full_attention", *rest]
        case ["full_attention", *rest]:
            return ["sliding_attention", *rest]
        case [int() as first, *rest]:
            return [1 - first, *rest]
        case list():
            return [*value, 1]
        case {"sliding_attention": local}:  # RoPE by layer type: change the local one
            return {**value, "sliding_attention": changed(local)}
        case dict():
            return {**value, "rope_theta": value["rope_theta"] * 2}
    raise AssertionError(f"no change for {value!r}")


@pytest.mark.parametrize("family", list(CONFIG_CLASSES))
def test_changing_a_key_that_is_not_ignored_changes_the_model_or_is_refused(family):
    data = hf_defaults(family)
    for key in sorted(set(data) - IGNORED - {"model_type"}):
        switch = SWITCHED_ON_BY.get(key, {})
        context = {
            k: v for k, v in (switch(data) if callable(switch) else switch).items() if k in data
        }
        before = {**data, **context}
        after = {**before, key: changed(before[key])}
        try:
            different = config_from_hf(copy.deepcopy(after)) != config_from_hf(before)
        except (ConfigError, ValueError) as exc:
            different = key in str(exc)
        assert different, f"{family}: changing {key} changed nothing"


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act: gelu is not supported (llama)"),
        ("llama", {"rope_scaling_kind": "x"}, "rope_scaling_kind: x is not supported"),
        ("llama", {"is_encoder_decoder": True}, "is_encoder_decoder: true is not supported"),
        ("llama", {"rope_parameters": {"rope_type": "su2", "rope_theta": 1.0}},
         "rope_parameters.rope_type: su2 is not supported"),
        ("llama", {"rope_parameters": {"rope_type": "default", "factor": 2.0}},
         "rope_parameters.factor: 2.0 is not supported"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "truncate": False}},
         "truncate"),
        ("llama", {"sliding_window": 4}, "sliding_window: 4 is not supported (llama)"),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0,
                                       "partial_rotary_factor": 0.5}},
         "rope_parameters.partial_rotary_factor: 0.5 is not supported (llama)"),
        ("llama", {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
         "rope_parameters: "),
        ("mistral", {"layer_types": ["full_attention"] * 32}, "layer_types"),
        ("qwen2", {"layer_types": ["sliding_attention"] * 24}, "no sliding_window"),
        ("gemma2", {"hidden_act": "silu"}, "hidden_act: silu disagrees with hidden_activation"),
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation: gelu is not supported"),
        ("gemma3_text", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
         "rope_parameters.sliding_attention.rope_type: linear is not supported"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
         "longrope needs short_factor and long_factor"),
    ],
)  # fmt: skip
def test_what_we_do_not_compute_is_refused_by_name(tmp_path, family, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**hf_defaults(family), **change}))
    with pytest.raises(ConfigError) as err:
        model_config_from_json(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_an_unknown_model_type_is_refused_by_name(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "gpt_neox", "hidden_size": 64}')
    with pytest.raises(ConfigError, match="model_type: gpt_neox is not supported"):
        model_config_from_json(path)


def other_than(allowed: tuple):
    return next(v for v in (True, 2, 0.5, "other") if v not in allowed)


@pytest.mark.parametrize(
    ("family", "key"),
    [(f, key) for f, fam in FAMILIES.items() for key in {**NEUTRAL, **fam.neutral}],
)
def test_keys_accepted_at_one_value_are_refused_at_any_other(family, key):
    fam = FAMILIES[family]
    allowed = {**NEUTRAL, **fam.neutral}[key]
    with pytest.raises(ConfigError, match=f"{key}: .* is not supported \\({family}\\)"):
        config_from_hf({**hf_defaults(family), key: other_than(allowed)})


@pytest.mark.parametrize("family", list(CONFIG_CLASSES))
def test_a_key_no_family_reads_is_refused(family):
    with pytest.raises(ConfigError, match=f"attn_sinks: true is not supported \\({family}\\)"):
        config_from_hf({**hf_defaults(family), "attn_sinks": True})
