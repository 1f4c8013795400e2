import pytest
import torch
from tiny_server import build_tiny


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls on a shared machine run fastest on one thread (more threads only contend)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny():
    """(params, cfg, tokenizer) of a model that memorised a few answers (see tiny_server)."""
    return build_tiny()
