"""Configuration errors name the key and the file."""

import pytest

from astrai.config import ConfigError, ModelConfig, load_toml
from astrai.model import model_config_from_json


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("hiden_size = 64", "hiden_size"),
        ('hidden_size = "big"', "hidden_size"),
        ("hidden_size = 30\nnum_attention_heads = 4", "hidden_size"),
        ("num_attention_heads = 8\nnum_key_value_heads = 3", "num_key_value_heads"),
        ('attn_type = "flash"', "attn_type"),
        ("rope_scaling = { rope_type = 'yarn', factor = 'x' }", "rope_scaling.factor"),
    ],
)
def test_bad_model_config_names_key_and_file(tmp_path, body, expected):
    path = write(tmp_path, "run.toml", f"[model]\n{body}\n")
    with pytest.raises(ConfigError) as err:
        load_toml(path, ModelConfig, "model")
    assert expected in str(err.value)
    assert str(path) in str(err.value)


def test_missing_table_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"missing \[model\]"):
        load_toml(write(tmp_path, "a.toml", "x = 1\n"), ModelConfig, "model")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_toml(write(tmp_path, "b.toml", "x = = 1\n"), ModelConfig, "model")


def test_good_toml_and_json(tmp_path):
    cfg = load_toml(write(tmp_path, "c.toml", "[model]\nhidden_size = 64\n"), ModelConfig, "model")
    assert cfg.hidden_size == 64 and cfg.kv_heads == 8
    path = write(tmp_path, "config.json", '{"hidden_size": 64, "num_attention_heads": 4}')
    assert model_config_from_json(path).dim_per_head == 16
    with pytest.raises(ConfigError, match=r"config\.json"):
        model_config_from_json(write(tmp_path, "config.json", '{"vocab_size": -1}'))
