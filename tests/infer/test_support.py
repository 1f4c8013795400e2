"""What this machine runs (astrai.infer.support): every product it offers runs on every shape,
and what it refuses is refused with the reason, the CPU feature it lacks by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from infer_models import make_model

from astrai.hardware import cpu_flags
from astrai.infer import kernels_used, prepare, prepare_params, support
from astrai.infer.support import prepared_matrix, products_here
from astrai.model.layers import project

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.int4]
# [out, in]: one row or one column, odd sizes, sizes no vector width divides, a wide head
SHAPES = [(1, 1), (1, 64), (7, 1), (3, 5), (17, 33), (48, 80), (64, 24), (96, 200), (1000, 64)]
# an AVX2-only x86 CPU's flags (AMD Zen 3; /proc/cpuinfo's names): no AVX-512, no AVX-NE-CONVERT
AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_product_offered_runs(dtype, shape):
    offered = [name for name, reason in products_here(dtype, shape).items() if reason is None]
    assert offered or dtype in (torch.int8, torch.int4)  # a float matrix can stay as it is
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    activation = torch.float32 if dtype in (torch.int8, torch.int4) else dtype
    for name in offered:
        weight = prepared_matrix(w, dtype, name)
        for rows in [(1,), (5,), (2, 3)]:
            x = torch.randn(*rows, shape[1], generator=g).to(activation)
            y = project(x, weight)
            assert y.shape == (*rows, shape[0]) and y.dtype == activation, name
            assert bool(y.isfinite().all()), name


def test_a_missing_cpu_feature_is_refused_by_name(monkeypatch, fresh_choices):
    before = {dtype: products_here(dtype) for dtype in DTYPES}
    monkeypatch.setattr(support, "cpu_flags", lambda: AVX2_FLAGS)
    packed = products_here(torch.bfloat16)["packed"]
    assert "avx512bw+avx512vl+avx512dq" in packed and "avx_ne_convert" in packed
    assert products_here(torch.float32) == before[torch.float32]
    assert products_here(torch.int8) == before[torch.int8]  # fbgemm has its AVX2
    # prepare chooses among the others
    params, _ = make_model("gqa")
    prepared = prepare_params({k: v.to(torch.bfloat16) for k, v in params.items()})
    assert set(kernels_used(prepared)) <= {"float", "gemv", "panels"}  # torch's, or our C kernels
    monkeypatch.setattr(support, "cpu_flags", lambda: AVX2_FLAGS - {"avx2"})
    assert "avx2" in products_here(torch.int8)["dynamic"]


def test_a_product_that_raises_here_is_refused_with_its_error(monkeypatch, fresh_choices):
    def unavailable(w):
        raise RuntimeError("columns: no kernel for this build\nException raised from ...")

    monkeypatch.setitem(support.LAYOUTS, "columns", unavailable)
    reason = products_here(torch.float32)["columns"]
    assert reason == "raises here: columns: no kernel for this build"
    assert "columns" not in prepare.runnable(torch.float32, (32, 32))
    params, _ = make_model("gqa")
    prepare_params(params)  # building the refused layout would raise


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="ONEDNN_MAX_CPU_ISA=AVX2 needs an x86 CPU")
def test_onednn_held_to_avx2_packs_no_bf16_and_prepare_takes_another_layout():
    # what an AVX2-only CPU gets from oneDNN, on any x86 CPU: its bf16 reorder refuses
    script = (
        "import torch\n"
        "from infer_models import make_model\n"
        "from astrai.infer import kernels_used, prepare_params, products_here\n"
        "print(products_here(torch.bfloat16)['packed'])\n"
        "params, _ = make_model('gqa')\n"
        "bf16 = {k: v.to(torch.bfloat16) for k, v in params.items()}\n"
        "print(sorted(kernels_used(prepare_params(bf16))))\n"
    )
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here.parents[1]), str(here), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    reason, used = run.stdout.splitlines()
    assert "avx512bw" in reason
    assert "packed" not in used and used != "[]"  # float or gemv, whichever times faster
