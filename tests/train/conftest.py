"""One intra-op thread for the training tests: their tensors are tiny, and on a busy machine
a second OpenMP thread costs far more in waiting than it gains."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
