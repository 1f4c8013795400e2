"""The model folders a run reads and writes: the tokenizer it reads text with (the `tokenizer`
folder's, else `init_from`'s), and the trained model it leaves, a `save_pretrained` folder with
the tokenizer files beside the weights, and with LoRA the adapter alone as a PEFT folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from astrai.config import TrainConfig
from astrai.model import save_pretrained
from astrai.model.lora_folder import save_lora
from astrai.tokenizer import Tokenizer
from astrai.train.state import TrainState, model_params

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def run_tokenizer(train_cfg: TrainConfig, needed_by: str) -> Tokenizer:
    """The tokenizer of `tokenizer`, else of `init_from`; when neither folder holds one, the
    error says what `needed_by` it."""
    for folder in (train_cfg.tokenizer, train_cfg.init_from):
        if folder and (Path(folder) / "tokenizer.json").is_file():
            return Tokenizer.from_pretrained(folder)
    raise ValueError(f"{needed_by} need a tokenizer: set `tokenizer` to its folder")


def copy_tokenizer(source: str | Path, dest: Path) -> None:
    """The tokenizer files of folder `source` (none when it is "") into `dest`."""
    if not source:
        return
    for name in TOKENIZER_FILES:
        if (Path(source) / name).exists():
            shutil.copyfile(Path(source) / name, Path(dest) / name)


def export_model(state: TrainState, path: Path, tokenizer: str = "") -> None:
    """The trained model as a `save_pretrained` folder, LoRA adapters merged in, with the
    tokenizer files of folder `tokenizer`."""
    save_pretrained(path, model_params(state), state.model_config)
    copy_tokenizer(tokenizer, path)


def export_adapter(state: TrainState, path: Path) -> Path:
    """The trained LoRA adapters alone, as a PEFT adapter folder (astrai.model.lora_folder):
    what `load_lora`, PEFT and servers of many adapters over one base model read. The base
    model is the run's `init_from`; a local folder is written as an absolute path, so that
    PEFT's AutoPeftModel finds it from any working directory."""
    base = state.train_config.init_from
    if base and Path(base).is_dir():
        base = os.path.abspath(base)
    return save_lora(path, state.lora, state.model_config, base_model=base)
