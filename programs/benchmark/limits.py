"""The hardware limits of decoding and prompts. Each step reads every weight once, so no decoder
beats memory bandwidth / bytes of weights per step; and each token costs two flops per weight,
so no batch beats peak matmul speed / flops per token, and no prompt the compute peak of its
products / flops per prompt token. All are measured in the same run, on the same device and
threads, STREAM-style for bandwidth."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from astrai.config import ModelConfig
from astrai.infer.ahead import one_row_ahead
from astrai.kernels import gemv
from astrai.kernels.build import kernel_library
from astrai.kernels.huge_pages import contiguous_in_huge_pages
from astrai.model import param_shapes
from astrai.train.mfu import matmul_peak_gflops

from .timing import median, timed

QUANTIZED_BITS = {"int8": 8, "int4": 4}  # bits per matrix element of prepare_params' quantize


def stream_bandwidth(device: torch.device, n: int = 1 << 25, repeats: int = 5) -> dict[str, float]:
    """GB/s of copy (b = a), triad (a = b + 3c) and read (sum a) over float32 arrays of n
    elements (128 MiB each by default, far beyond any cache). Best of `repeats`, as STREAM."""
    # in 2 MiB pages where the CPU's are, as the weights are (astrai/kernels/huge_pages.py)
    a, b, c = (contiguous_in_huge_pages(torch.rand(n, device=device)) for _ in range(3))
    size = a.element_size() * n
    kernels = {
        "copy": (lambda: b.copy_(a), 2 * size),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3 * size),
        "read": (lambda: a.sum(), size),
    }
    return {name: _best_rate(fn, nbytes, device, repeats) for name, (fn, nbytes) in kernels.items()}


def weights_read_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """GB/s of reading a working set the size of the model's weights (weights_reader, once)."""
    return weights_reader(device, nbytes, repeats)()


def weights_reader(device: torch.device, nbytes: int, repeats: int = 5) -> Callable[[], float]:
    """A reader of a working set the size of the model's weights, as a decode step reads
    them: each call returns the GB/s it read at now. When the weights fit in the cache this is
    the cache's speed, not DRAM's: the real limit of a step that rereads them every token. The
    faster of two readers: torch's sum, and on the CPU our float32 product at one row over the
    same bytes as a [n / 1024, 1024] matrix (it reads in several streams a thread; torch's sum
    read 1 GiB at 25 GB/s on a 2-core Intel Xeon where it read 31), asking for the weights
    ahead or not as is faster here; the bytes in 2 MiB pages, as the weights. Both only read
    slower than the memory can, so a share of the roofline made from the faster never
    flatters."""
    a = contiguous_in_huge_pages(torch.rand(max(nbytes // 4, 1024) // 1024 * 1024, device=device))
    readers = [lambda: a.sum()]
    if device.type == "cpu" and kernel_library() is not None:
        one_row_ahead(gemv.FLOAT32)
        x = torch.rand(1, 1024)
        readers.append(functools.partial(gemv.float_product(a.view(-1, 1024)), x))
    size = a.element_size() * a.numel()
    return lambda: max(_best_rate(read, size, device, repeats) for read in readers)


def matmul_gflops(device: torch.device, dtype: torch.dtype, n: int = 1024) -> float:
    """Peak matmul speed in GFLOP/s: the best rate of square n x n products this machine has
    shown at this thread count (astrai.train.matmul_peak: measured now, never below the
    record), the same peak `just train`'s MFU divides by."""
    return matmul_peak_gflops(device, dtype, n)


def int8_matmul_gops(device: torch.device, n: int = 1024, repeats: int = 5) -> float:
    """Peak int8 product speed in GOP/s (torch._int_mm, int8 x int8 -> int32, square n x n):
    the compute ceiling of the int8 and int4 weights' kernels, which multiply integers (VNNI,
    DP4A), where the float matmul peak is 2-4x lower and would cap their roofline below what
    they run at. The float32 peak where torch has no int8 product for `device`."""
    a = torch.ones(n, n, dtype=torch.int8, device=device)
    try:
        return _best_rate(lambda: torch._int_mm(a, a), 2 * n**3, device, repeats)
    except (RuntimeError, AttributeError):
        return matmul_gflops(device, torch.float32, n)


# What a format's prompt products multiply in (astrai_arithmetic_peak's kinds): the 8- and 4-bit
# weights' prompts multiply int8 activations by int8 (or unpacked 4-bit) weights
ARITHMETIC = {"float32": 0, "bfloat16": 1, "int8": 2}
ARITHMETIC_STEPS = 1 << 22  # a few ms a call at any width seen


def arithmetic_peak(kind: str, repeats: int = 5) -> float | None:
    """The cores' multiply-adds of `kind` (ARITHMETIC) issued back to back on torch's threads,
    in GOP/s, a multiply-add counted as two (astrai/kernels/arithmetic_peak.c): the ceiling no
    product beats, where torch's square product (matmul_gflops) is one library's rate and our
    products pass it on some CPUs. None where our kernels do not run."""
    lib = kernel_library()
    if lib is None:
        return None
    threads = torch.get_num_threads()
    run = functools.partial(lib.astrai_arithmetic_peak, ARITHMETIC[kind], ARITHMETIC_STEPS, threads)
    return _best_rate(run, run(), torch.device("cpu"), repeats)


def compute_peak(device: torch.device, kind: str) -> float:
    """The most a prompt's products can multiply in `kind` (ARITHMETIC) a second: the higher of
    the cores' multiply-adds (arithmetic_peak, on the CPU) and the library's square product,
    which on a CPU with AMX tiles runs bfloat16 and int8 where those multiply-adds do not."""
    if kind == "int8":
        library = int8_matmul_gops(device)
    else:
        library = matmul_gflops(device, getattr(torch, kind))
    chains = arithmetic_peak(kind) if device.type == "cpu" else None
    return max(library, chains or 0.0)


def _best_rate(fn, units: int, device: torch.device, repeats: int) -> float:
    fn()  # first touch: page faults and kernel selection are not speed
    best = min(timed(fn, device)[0] for _ in range(repeats))
    return units / best / 1e9


def _matrix_elements(cfg: ModelConfig) -> tuple[int, int]:
    """(elements of every weight but the embedding, plus the head's), (hidden size)."""
    shapes = param_shapes(cfg)
    vocab, hidden = shapes["model.embed_tokens.weight"]
    elements = sum(math.prod(s) for k, s in shapes.items() if k != "model.embed_tokens.weight")
    if "lm_head.weight" not in shapes:
        elements += vocab * hidden  # the tied head reads the embedding matrix
    return elements, hidden


def decode_bytes_per_token(
    cfg: ModelConfig, dtype: torch.dtype, quantize: str | None = None
) -> int:
    """Bytes of weights one batch-1 decode step must read: every matrix and norm once, one row
    of the embedding, and the head (the embedding matrix itself when tied). The K/V cache read
    is left out: at these lengths it is under 1% of the weights. For MoE every expert is
    counted, which overstates the bytes of a sparse step. With int8 weights the matrices take
    one byte per element (the per-row scales and the norms are left out: under 1%); with int4
    half a byte (its group scales are left out too: the count never overstates the bytes, so
    a fraction of the roofline made from it never flatters)."""
    elements, hidden = _matrix_elements(cfg)
    bits = QUANTIZED_BITS.get(quantize) or 8 * torch.empty((), dtype=dtype).element_size()
    return (elements + hidden) * bits // 8


def kv_bytes_per_token(cfg: ModelConfig, context: int, element_size: int) -> int:
    """Bytes of K and V one decode step reads with `context` tokens behind it: every layer's
    K/V heads over the positions it attends to (at most its window on a sliding layer)."""
    per_position = 2 * cfg.kv_heads * cfg.dim_per_head * element_size
    seen = [
        min(context, cfg.sliding_window) if cfg.is_sliding_layer(i) else context
        for i in range(cfg.num_hidden_layers)
    ]
    return sum(seen) * per_position


def mean_kv_bytes(cfg: ModelConfig, prompt_len: int, new_tokens: int, element_size: int) -> float:
    """The K/V bytes a decode step reads, averaged over the steps of one generation: the step
    for token t (counting from 0) attends to prompt_len + t positions."""
    steps = range(prompt_len, prompt_len + new_tokens)
    return sum(kv_bytes_per_token(cfg, c, element_size) for c in steps) / max(len(steps), 1)


def gguf_bytes_per_token(path) -> int:
    """Bytes of weights one batch-1 step of llama.cpp reads from a GGUF file: every tensor
    once, in the file's own types (Q4_K_M mixes several), but of the token embedding one row,
    or all of it when it is also the head (no output.weight)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    embed = tensors.pop("token_embd.weight")
    rows = int(embed.shape[-1]) if len(embed.shape) > 1 else 1  # GGUF lists [cols, rows]
    total = sum(int(t.n_bytes) for t in tensors.values())
    return (
        total
        + int(embed.n_bytes) // rows
        + (0 if "output.weight" in tensors else int(embed.n_bytes))
    )


def roofline_fraction(tokens_per_s: float, bytes_per_token: float, bandwidth_gb_s: float) -> float:
    """The share of the memory bandwidth a batch-1 decoder streams: tokens/s x bytes read per
    token over what the memory delivers (1.0: at the memory limit)."""
    return tokens_per_s * bytes_per_token / (bandwidth_gb_s * 1e9)


def round_roofline(rates: list[float], bytes_per_token: float, bandwidths: list[float]) -> float:
    """The median over rounds of each round's roofline fraction, its tokens/s against the
    bandwidth read in the same round: on a machine whose memory is slower in some minutes
    than in others (a VM's neighbours), the share of what the memory delivered then, where
    roofline_fraction against the run's best read counts a slow minute against the decoder."""
    pairs = zip(rates, bandwidths, strict=True)
    return median([roofline_fraction(rate, bytes_per_token, bw) for rate, bw in pairs])


def prompt_flops_per_token(cfg: ModelConfig, length: int) -> float:
    """Flops a prompt token costs a prefill of `length` tokens that keeps the last logits: two
    per layer weight, and attention's two products (scores, then the weighted values) over the
    positions it sees, (length + 1) / 2 on average, at most a sliding layer's window. The one
    head product per prompt and the elementwise work are left out."""
    elements, hidden = _matrix_elements(cfg)
    weights = elements - cfg.vocab_size * hidden  # the head's matrix runs once a prompt
    seen = 0.0
    for i in range(cfg.num_hidden_layers):
        window = cfg.sliding_window if cfg.is_sliding_layer(i) else length
        seen += sum(min(t, window) for t in range(1, length + 1)) / length
    return 2 * weights + 4 * cfg.num_attention_heads * cfg.dim_per_head * seen


def decode_flops_per_token(cfg: ModelConfig) -> int:
    """Two flops (multiply, add) per weight for each token; attention over a short context
    and the elementwise work are left out (under 2% at these lengths)."""
    return 2 * _matrix_elements(cfg)[0]


def roofline_tokens_per_s(limits: dict, batch: int) -> float:
    """Tokens/s no decoder can beat at this batch: `batch` tokens per read of the weights,
    and no faster than the matmul peak allows."""
    by_memory = batch * limits["bandwidth_gb_s"] * 1e9 / limits["bytes_per_token"]
    by_compute = limits["matmul_gflops"] * 1e9 / limits["flops_per_token"]
    return min(by_memory, by_compute)
