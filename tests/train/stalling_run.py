"""Run under torchrun: `train` a TOML's run, where rank 1 stops still after `stall_after`
optimizer steps (its batch source sleeps), so that a test can kill it with SIGKILL at a known
point. It first writes its pid to `pid_file`, which tells the test where it stands.

    torchrun --nproc_per_node 2 stalling_run.py run.toml STALL_AFTER PID_FILE
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from astrai.config import load_train_config
from astrai.model import model_config_from_json
from astrai.train import train
from astrai.train.batches import BatchSource, open_batches
from astrai.train.distributed import init_distributed, shutdown


def stalling(source: BatchSource, stall_after: int, pid_file: Path) -> BatchSource:
    taken = 0

    def next_batch(cursor):
        nonlocal taken
        if taken == stall_after:
            pid_file.write_text(str(os.getpid()))
            time.sleep(600)  # until killed
        taken += 1
        return source.next(cursor)

    return BatchSource(source.cursor, next_batch)


def main(config: str, stall_after: int, pid_file: str) -> None:
    cfg = load_train_config(config)
    info = init_distributed(cfg.backend, cfg.device)
    model_cfg = cfg.model or model_config_from_json(Path(cfg.init_from) / "config.json")
    source = open_batches(cfg, model_cfg, info.rank, info.world_size, "train")
    if info.rank == 1:
        source = stalling(source, stall_after, Path(pid_file))
    train(cfg, resume=False, batches=source)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
