"""AstrAI: train and serve your own language model with plain pytrees and pure functions."""

from astrai.config import ConfigError, ModelConfig
from astrai.model import (
    CheckpointError,
    encode,
    forward,
    forward_cached,
    init_cache,
    init_lora,
    init_params,
    load_pretrained,
    merge_lora,
    save_pretrained,
)

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ModelConfig",
    "encode",
    "forward",
    "forward_cached",
    "init_cache",
    "init_lora",
    "init_params",
    "load_pretrained",
    "merge_lora",
    "save_pretrained",
]
