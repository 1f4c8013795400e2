"""Training data: JSONL records -> memory-mapped token shards -> batches read by cursor.

summary = prepare(load_data_config("data.toml"))      # offline, once
data = open_dataset("prepared/")                      # memory maps, nothing loaded
cursor = Cursor(batch_size=8, seed=0)
cursor, batch = next_batch(data, cursor)              # pure: same cursor, same batch
"""

from astrai.data.batches import (
    Cursor,
    as_cursor,
    collate,
    cursor_dict,
    epoch_order,
    next_batch,
    next_indices,
)
from astrai.data.config import DataConfig, Fields, data_config, load_data_config
from astrai.data.datasets import IGNORE, Dataset, get_example, open_dataset
from astrai.data.packing import fit_length, pack_bfd, pack_greedy, pack_none, segment_positions
from astrai.data.pipeline import Summary, format_summary, prepare
from astrai.data.records import RecordError
from astrai.data.shards import ShardError

__all__ = [
    "IGNORE",
    "Cursor",
    "DataConfig",
    "Dataset",
    "Fields",
    "RecordError",
    "ShardError",
    "Summary",
    "as_cursor",
    "collate",
    "cursor_dict",
    "data_config",
    "epoch_order",
    "fit_length",
    "format_summary",
    "get_example",
    "load_data_config",
    "next_batch",
    "next_indices",
    "open_dataset",
    "pack_bfd",
    "pack_greedy",
    "pack_none",
    "prepare",
    "segment_positions",
]
