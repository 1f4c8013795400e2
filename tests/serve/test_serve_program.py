"""programs/serve.py: where the model comes from, and how settings are merged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from astrai.infer import Engine

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "serve.py"


@pytest.fixture(scope="module")
def program():
    spec = importlib.util.spec_from_file_location("serve_program", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_model_it_says_how_to_make_one(program, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/demo/model here
    assert program.main([]) == 2
    err = capsys.readouterr().err
    assert "just demo" in err and "runs/demo/model" in err and "--random-tiny" in err


def test_bad_folder_and_bad_flag_exit_nonzero(program, tmp_path, capsys):
    assert program.main(["--model", str(tmp_path / "missing")]) == 2
    assert "cannot load" in capsys.readouterr().err
    assert program.main(["--model", str(tmp_path), "--page-size", "0"]) == 2
    assert "page_size" in capsys.readouterr().err


def test_settings_merge(program, tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text('[serve]\nport = 9000\nmax_batch = 8\napi_key = "from-file"\n')
    args = program.parse_args(["--config", str(toml), "--port", "9100"])
    cfg = program.serve_config(args, environ={"ASTRAI_API_KEY": "from-env"})
    assert (cfg.port, cfg.max_batch, cfg.api_key, cfg.host) == (9100, 8, "from-file", "127.0.0.1")
    cfg = program.serve_config(program.parse_args([]), environ={"ASTRAI_API_KEY": "from-env"})
    assert cfg.api_key == "from-env"
    toml.write_text("[serve]\nprot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        program.serve_config(program.parse_args(["--config", str(toml)]), environ={})


def test_random_tiny_loads_and_generates(program, tmp_path):
    folder = program.make_random_tiny(tmp_path / "tiny")
    cfg = program.serve_config(program.parse_args(["--max-batch", "4"]), environ={})
    engine = program.load_engine(folder, cfg)
    try:
        assert isinstance(engine, Engine)
        (completion,) = engine.generate(["Hello"], max_tokens=3)
        assert completion.usage.completion_tokens <= 3
    finally:
        engine.close()
    assert program.default_name(folder, program.parse_args([])) == "tiny"
    assert program.default_name(Path("runs/demo/model"), program.parse_args([])) == "demo"


def test_every_setting_has_a_flag_and_zero_waiting_is_no_limit(program, tmp_path):
    from astrai.config import EngineConfig, ServeConfig, engine_config

    args = program.parse_args(["--no-prefix-cache", "--dtype", "bfloat16", "--max-waiting", "0"])
    cfg = program.serve_config(args, environ={})
    assert (cfg.prefix_cache, cfg.dtype, cfg.max_waiting) == (False, "bfloat16", 0)
    assert set(ServeConfig.__struct_fields__) <= set(vars(args))
    assert engine_config(cfg) == EngineConfig(prefix_cache=False, dtype="bfloat16")
    assert engine_config(program.serve_config(program.parse_args([]), {})).max_waiting == 256
    toml = tmp_path / "serve.toml"
    toml.write_text("[serve]\nmax_waiting = 0\nmax_batch = 2\n")
    cfg = program.serve_config(program.parse_args(["--config", str(toml)]), environ={})
    assert (cfg.max_waiting, cfg.max_batch) == (0, 2)
