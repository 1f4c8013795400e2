"""Train a model as a TOML file says (docs/training.md lists every key).

    python programs/train.py config.toml [--resume [CHECKPOINT]] [--fresh]
    torchrun --nproc_per_node N programs/train.py config.toml     # [parallel] mode: data or sharded

A run continues from the latest checkpoint in its out_dir unless --fresh is given; --resume
CHECKPOINT continues from that checkpoint folder instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from astrai.config import ConfigError, load_train_config
from astrai.model import CheckpointError
from astrai.model.lora_folder import CONFIG_FILE, RUN_SUBFOLDER
from astrai.train import TrainingDiverged, train
from astrai.train.distributed import shutdown


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="training TOML")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default="latest",
        metavar="CHECKPOINT",
        help="checkpoint folder to continue from (default: the run's latest, if any)",
    )
    parser.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    args = parser.parse_args()
    try:
        cfg = load_train_config(args.config)
        resume = False if args.fresh else (True if args.resume == "latest" else args.resume)
        state = train(cfg, resume=resume)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except TrainingDiverged as exc:
        print(f"training stopped: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    print(f"done: step {state.step}, model in {Path(cfg.out_dir) / 'model'}", file=sys.stderr)
    adapter = Path(cfg.out_dir) / RUN_SUBFOLDER
    if state.lora is not None and cfg.init_from and (adapter / CONFIG_FILE).is_file():
        print(
            f"LoRA adapter in {adapter}; serve it over its base model with\n"
            f"  just serve --model {cfg.init_from} --lora NAME={adapter}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
