"""The float32 products' libraries (astrai/model/products.py) as this machine chose them, kept
on disk so that every process of the machine multiplies the same way: a run resumed in a new
process continues bit for bit only where its products round as the first process's did, and
a timing near the margin (oneDNN 1.12-1.16x MKL's on an AMD Zen 5 held to AVX2, against 1.1)
could choose differently in each process.

The record is `$XDG_CACHE_HOME/astrai/float32_products.json`, beside the matmul peak's, keyed
as the peak is (the CPU model, threads, torch version and instruction holds:
matmul_peak.record_key) and by the shapes timed. The first choice made stands; delete the
file to time again.
"""

from __future__ import annotations

from pathlib import Path

import torch

from astrai.model import products
from astrai.train.matmul_peak import load_records, record_key, record_path, store_records


def choices_path() -> Path:
    return record_path().with_name("float32_products.json")


def choose_products(rows: int, inputs: int, outputs: int) -> dict[str, bool]:
    """products.ONEDNN, from this machine's record for these shapes, or timed now and recorded
    (products.choose)."""
    if products.ONEDNN:
        return products.ONEDNN
    rows = max(1, min(rows, products.ROWS))
    key = f"{record_key(torch.device('cpu'), torch.float32)}, {rows} x {inputs} x {outputs}"
    records = read_choices(choices_path())
    if key in records:
        products.ONEDNN.update(records[key])
        return products.ONEDNN
    chosen = products.choose(rows, inputs, outputs)
    if chosen:  # a read-only cache costs the next process a timing, not this run
        store_records(choices_path(), {**records, key: chosen})
    return products.ONEDNN


def read_choices(path: Path) -> dict[str, dict[str, bool]]:
    """The recorded choices; a missing or unreadable file, or an entry that is not a choice
    for every kind, is no record."""
    return {
        key: choice
        for key, choice in load_records(path).items()
        if isinstance(choice, dict)
        and set(choice) == set(products.KINDS)
        and all(isinstance(v, bool) for v in choice.values())
    }
