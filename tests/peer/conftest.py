"""The tests here run exported files in llama.cpp itself, which the `peer` extra installs (it
compiles llama.cpp). Without it they skip, saying how to install it; with ASTRAI_REQUIRE_PEER=1
(set by .ci/run, which installs it) a missing llama.cpp fails them instead."""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def llama_cpp_installed():
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    reason = 'llama.cpp is not installed: pip install -e ".[peer]", then just test-peer'
    if os.environ.get("ASTRAI_REQUIRE_PEER") == "1":
        pytest.fail(f"ASTRAI_REQUIRE_PEER=1 but {reason}")
    pytest.skip(reason)
