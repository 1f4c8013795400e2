import os
import stat
from pathlib import Path

import pytest

from astrai.config import ModelConfig
from astrai.files import write_atomically
from astrai.model import init_params
from astrai.model.checkpoint import save_pretrained


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_file_has_the_mode_open_would_give(tmp_path, umask_022):
    write_atomically(tmp_path / "a.txt", lambda tmp: Path(tmp).write_text("hello"))
    assert (tmp_path / "a.txt").read_text() == "hello"
    assert _mode(tmp_path / "a.txt") == 0o644


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")

    def fail(tmp):
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, fail)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]


def test_checkpoints_are_readable_by_others(tmp_path, umask_022):
    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    save_pretrained(tmp_path, init_params(cfg, seed=0), cfg)
    for name in ("model.safetensors", "config.json"):
        assert _mode(tmp_path / name) == 0o644, name
