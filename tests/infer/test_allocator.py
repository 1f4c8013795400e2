"""The C allocator keeps freed temporaries for reuse once inference weights are prepared."""

import platform
import subprocess
import sys

import pytest

CHURN = """
import resource, torch
from astrai.infer.allocator import keep_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def churn():
    # three 31 MiB temporaries alive at once, four times: by default glibc may hand them back
    # to the OS (unmapped, or trimmed off the heap's top), and the next ones fault in afresh
    before = faults()
    for _ in range(4):
        blocks = [torch.ones(31 << 18) for _ in range(3)]
        del blocks
    return faults() - before

if {keep}:
    assert keep_freed_memory()
churn()  # the heap grows once
print(churn())
"""

PAGES = 4 * 3 * 31 * 256  # 4 KiB pages the churn touches


def faults_of_second_churn(keep: bool) -> int:
    code = CHURN.format(keep=keep)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_temporaries_are_reused_without_page_faults():
    # By default glibc faulted 63,360 of the churn's pages in 7 processes of 10 here; in the
    # others the address layout left the heap no room to be trimmed and nothing faulted. So
    # each process is a fresh draw, and a keep_freed_memory that does nothing fails ~9 in 10.
    for _ in range(2):
        assert faults_of_second_churn(keep=True) < PAGES // 100


def test_preparing_weights_keeps_freed_memory():
    from astrai.infer import allocator, prepare_params

    allocator.keep_freed_memory.cache_clear()
    prepare_params({})
    assert allocator.keep_freed_memory.cache_info().currsize == 1
