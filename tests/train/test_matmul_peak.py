"""The matmul peak MFU divides by: the machine's best measured rate, kept on disk and only
ever raised, so a measurement made under load cannot lower it."""

from __future__ import annotations

import pytest
import torch

from astrai.train import matmul_peak
from astrai.train.matmul_peak import (
    ISA_HOLDS,
    matmul_peak_gflops,
    read_records,
    record_key,
    record_path,
    refreshed_peak_gflops,
)

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture(autouse=True)
def own_record(tmp_path, monkeypatch):
    """A record file of the test's own and a process cache that starts empty."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(matmul_peak, "_BEST", {})


def measured(monkeypatch, *rates):
    """Make the next measurements read `rates`, in order."""
    queue = list(rates)
    monkeypatch.setattr(matmul_peak, "measure_gflops", lambda *a, **k: queue.pop(0))


def test_a_real_measurement_is_stored_for_this_machine_dtype_and_thread_count():
    peak = matmul_peak_gflops(CPU, F32, n=64)
    assert peak > 0 and read_records(record_path()) == {record_key(CPU, F32): peak}
    assert str(torch.get_num_threads()) + " threads" in record_key(CPU, F32)
    assert record_key(CPU, F32) != record_key(CPU, torch.bfloat16)


def test_a_run_held_to_fewer_instructions_keeps_a_record_of_its_own(monkeypatch):
    """A run as on an AVX2-only CPU multiplies slower than the machine: its MFU divides by
    its own peak, and its products never lower (or raise) the machine's."""
    for hold in ISA_HOLDS:
        monkeypatch.delenv(hold, raising=False)
    machine = record_key(CPU, F32)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert record_key(CPU, F32) != machine and "ONEDNN_MAX_CPU_ISA=AVX2" in record_key(CPU, F32)


def test_a_measurement_under_load_does_not_lower_the_recorded_peak(monkeypatch):
    measured(monkeypatch, 100.0)
    assert matmul_peak_gflops(CPU, F32) == 100.0
    monkeypatch.setattr(matmul_peak, "_BEST", {})  # a new process, on a busier moment
    measured(monkeypatch, 40.0)
    assert matmul_peak_gflops(CPU, F32) == 100.0
    assert read_records(record_path())[record_key(CPU, F32)] == 100.0


def test_each_refresh_can_raise_the_peak_and_never_lowers_it(monkeypatch):
    measured(monkeypatch, 50.0, 80.0, 30.0)
    assert matmul_peak_gflops(CPU, F32) == 50.0  # once per process
    assert refreshed_peak_gflops(CPU, F32) == 80.0  # a quieter moment later in the run
    assert refreshed_peak_gflops(CPU, F32) == 80.0
    assert read_records(record_path())[record_key(CPU, F32)] == 80.0


def test_an_unreadable_record_is_no_record_and_is_replaced(monkeypatch):
    record_path().parent.mkdir(parents=True)
    record_path().write_text("{not json")
    measured(monkeypatch, 70.0)
    assert matmul_peak_gflops(CPU, F32) == 70.0
    assert read_records(record_path()) == {record_key(CPU, F32): 70.0}
