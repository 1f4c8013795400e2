"""The speculative-decoding flags of `just generate` and `just chat` (`just serve` has one flag
per EngineConfig field already), and the check of --draft-model all three make before the
engine starts, so that a wrong folder is named as the flag's, not as the model's."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=["lookup", "draft"],
        help="speculative decoding: 'lookup' copies from the prompt (no model), 'draft' asks"
        " --draft-model; greedy output is unchanged (default: none)",
    )
    parser.add_argument("--draft-model", help="with --speculative draft: the draft's folder")
    parser.add_argument(
        "--speculative-k", type=int, default=4, help="most tokens proposed per step (default 4)"
    )


def speculation_settings(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the flags set; a ValueError when they do not go together
    (EngineConfig's own check, made here before any weights are read)."""
    from astrai.config import EngineConfig

    settings = {
        "speculative": args.speculative,
        "draft_model": args.draft_model,
        "speculative_k": args.speculative_k,
    }
    EngineConfig(**settings)
    return settings


def check_draft(draft_model: str | None, target_folder: Path) -> None:
    """A ValueError naming --draft-model when the folder holds no decoder model or one with
    another vocabulary than the target's (a draft must share the target's tokenizer)."""
    if draft_model is None:
        return
    from astrai.infer.speculate_step import check_draft_config
    from astrai.model import model_config_from_json

    config = Path(draft_model) / "config.json"
    if not config.is_file():
        raise ValueError(f"--draft-model {draft_model}: not a model folder (no config.json)")
    target = model_config_from_json(Path(target_folder) / "config.json")
    try:
        check_draft_config(model_config_from_json(config), target)
    except ValueError as exc:
        raise ValueError(f"--draft-model {draft_model}: {exc}") from None
