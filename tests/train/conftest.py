"""One intra-op thread for the training tests: their tensors are tiny, and on a busy machine
a second OpenMP thread costs far more in waiting than it gains. ASTRAI_TEST_THREADS overrides
it, so that CI also runs them with reductions split over several threads."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("ASTRAI_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)
