"""What this machine can run: the layouts of float matrices (astrai/infer/layouts.py), the
8-bit products (astrai/infer/quant.py) and the 4-bit ones (astrai/infer/int4.py), each with the
reason where it cannot. prepare_params chooses among those that run; the tests run each one
that does and skip the others, naming why.

A product is refused for a CPU feature its library needs and the CPU lacks (read from
/proc/cpuinfo, so that the reason names it), for a shape its kernel mishandles, where our own C
kernel did not build (no compiler, no AVX2), or when one tiny product of it raises here (tried
once per process): a library built without the kernel, or held below what the CPU offers
(ONEDNN_MAX_CPU_ISA=AVX2), then says why in its own words.
"""

from __future__ import annotations

import functools

import torch

from astrai.hardware import cpu_flags
from astrai.infer import int4
from astrai.infer.layouts import LAYOUTS
from astrai.infer.quant import BUILDERS, int8_matrix
from astrai.kernels.build import why_absent
from astrai.model.layers import project

# The CPU features (as /proc/cpuinfo names them) a product's library checks for; any one group
# is enough. oneDNN reorders bfloat16 weights only with AVX-512 BW+VL+DQ, AVX-NE-CONVERT or
# Arm's BF16; fbgemm's integer kernels need AVX2, and so do ours.
CPU_NEEDS = {
    (torch.bfloat16, "packed"): (
        ("avx512bw", "avx512vl", "avx512dq"),
        ("avx_ne_convert",),
        ("bf16",),
    ),
    (torch.int8, "dynamic"): (("avx2",),),
    # our C kernels: AVX2 + FMA at least (AVX-512 VNNI taken where present)
    (torch.int8, "gemv"): (("avx2", "fma"),),
    (torch.int4, "gemv"): (("avx2", "fma"),),
    (torch.float32, "gemv"): (("avx2", "fma"),),
    (torch.bfloat16, "gemv"): (("avx2", "fma"),),
    (torch.float32, "panels"): (("avx2", "fma"),),
    (torch.bfloat16, "panels"): (("avx2", "fma"),),
}
# torch's CPU kernel of the weight-only product reads each activation row in whole vectors (16
# floats with AVX-512, 8 with AVX2) and runs past the end of a row that is not a multiple of
# them: a segfault, not an error to catch.
IN_FEATURES_MULTIPLE = {
    (torch.int8, "weight_only"): 16,
    # ours reads whole vectors of 16 too, and refuses other widths
    (torch.float32, "gemv"): 16,
    (torch.bfloat16, "gemv"): 16,
    (torch.float32, "panels"): 16,
    (torch.bfloat16, "panels"): 16,
}
OUR_KERNELS = ("gemv", "panels")  # the C products of astrai/kernels, where they build
PROBE_SHAPE = (16, 32)  # the [out, in] of the tiny product each one is tried on


def products_here(
    dtype: torch.dtype, shape: tuple[int, int] | None = None, device: str | torch.device = "cpu"
) -> dict[str, str | None]:
    """Every product of matrices of `dtype` on `device`: the layouts of LAYOUTS for a float
    dtype, the 8-bit products of quant.BUILDERS for torch.int8, the 4-bit ones of
    int4.BUILDERS for torch.int4. Each maps to None where it runs
    here, else to the reason it does not. With `shape` ([out, in]) the kernels' limits on shapes
    count too; without it, None means that it runs for some shapes."""
    device = torch.device(device)
    return {
        name: _shape_refused(dtype, name, shape, device) or _machine_refuses(dtype, name, device)
        for name in _names(dtype)
    }


def _names(dtype: torch.dtype):
    return {torch.int8: BUILDERS, torch.int4: int4.BUILDERS}.get(dtype, LAYOUTS)


def _shape_refused(dtype, name: str, shape, device: torch.device) -> str | None:
    if dtype == torch.int4 and shape is not None and not int4.groups_for(shape[1]):
        return f"in_features {shape[1]} is a multiple of no group size {int4.GROUPS}"
    multiple = IN_FEATURES_MULTIPLE.get((dtype, name))
    if device.type != "cpu" or multiple is None or shape is None or shape[1] % multiple == 0:
        return None
    return f"its CPU kernel needs in_features a multiple of {multiple}, not {shape[1]}"


def _machine_refuses(dtype, name: str, device: torch.device) -> str | None:
    needs = CPU_NEEDS.get((dtype, name), ()) if device.type == "cpu" else ()
    flags = cpu_flags()  # empty where the system does not say: the probe alone decides
    if needs and flags and not any(flags.issuperset(group) for group in needs):
        wanted = " or ".join("+".join(group) for group in needs)
        return f"needs the CPU feature {wanted}, which this CPU lacks"
    if name in OUR_KERNELS and (reason := _our_kernel_absent(device)):
        return reason
    return _probe(dtype, name, str(device))


def _our_kernel_absent(device: torch.device) -> str | None:
    """Why our C products (named OUR_KERNELS among the layouts and the 8- and 4-bit products)
    do not run on `device`, or None: they run on the CPU, where they built."""
    return "our C kernel runs on the CPU only" if device.type != "cpu" else why_absent()


def prepared_matrix(w: torch.Tensor, dtype: torch.dtype, name: str):
    """w [out, in] (float) as a weight for `project` in product `name` of `dtype` matrices (4
    bits: in the smallest group size that divides in_features)."""
    if dtype == torch.int8:
        return int8_matrix(w, name)
    if dtype == torch.int4:
        return int4.int4_matrix(w, name, int4.groups_for(w.shape[1])[0])
    return LAYOUTS[name](w.to(dtype))


@functools.cache
def _probe(dtype, name: str, device: str) -> str | None:
    """None where one tiny product runs, else what it raised."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(PROBE_SHAPE, generator=g).to(device)
    x = torch.randn(3, PROBE_SHAPE[1], generator=g).to(device)
    try:
        quantized = dtype in (torch.int8, torch.int4)
        project(x if quantized else x.to(dtype), prepared_matrix(w, dtype, name))
    except RuntimeError as exc:  # torch's own errors for a kernel it lacks
        return f"raises here: {str(exc).splitlines()[0]}"
    return None
