"""Turn a training checkpoint (sharded or whole) into a model folder.

    python programs/export_checkpoint.py runs/x/checkpoints/step_00001000 models/x

The folder holds model.safetensors, config.json and the tokenizer files the checkpoint has:
what `load_pretrained`, `just serve` and `just chat` read. A sharded checkpoint is read in one
process (torch.distributed.checkpoint gathers each tensor whole), so this needs the memory of
the whole model once, not of the training state.
"""

from __future__ import annotations

import argparse
import sys

from astrai.config import ConfigError
from astrai.train import export_checkpoint


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (with train_state.json)")
    parser.add_argument("out", help="the model folder to write")
    args = parser.parse_args()
    try:
        out = export_checkpoint(args.checkpoint, args.out)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
