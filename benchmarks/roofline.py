"""What a device can read, copy and multiply per second, measured here and nominal, and the bytes a decode step
must read: the rooflines the rollout benchmarks and the GPU check report against.

A decode step is read-bound: it computes little per byte, and must read every weight once plus the keys and values
of every token its rows attend to. Its read roofline is those bytes over the device's read bandwidth, measured as a
large sum (a reduction reads each byte once and writes almost nothing), not as a copy (which reads and writes each
byte, and so says little about a step that mostly reads). The nominal figures are the vendors' data-sheet peaks
(SXM parts), for the fraction against the part rather than against what this process measured.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.timing import best_seconds

#: dense bf16 tensor-core peak (TFLOP/s) by the name CUDA reports, from the vendors' data sheets (SXM parts)
NOMINAL_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "B200": 2250.0, "GH200": 989.4}
#: memory bandwidth (GB/s) by the same names and sources
NOMINAL_READ_GB_S = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "B200": 8000.0, "GH200": 4000.0}


def nominal(table: dict[str, float], name: str) -> float | None:
    """The entry of ``table`` for a device called ``name`` (the longest key it contains; None when unknown)."""
    for key in sorted(table, key=len, reverse=True):
        if key in name:
            return table[key]
    return None


def device_name(device: torch.device) -> str:
    """The name the nominal tables are keyed by: CUDA's name of the device, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def read_bandwidth(device: torch.device, nbytes: int | None = None, tries: int = 5) -> float:
    """Bytes per second read by a sum over ``nbytes`` (default 2 GiB on a GPU, far past its caches; 256 MiB on a
    CPU), the best of ``tries``."""
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()  # first-call set-up out of the timing
    return nbytes / best_seconds(lambda: x.sum(), device, tries)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, tries: int = 5) -> float:
    """Bytes copied per second by a large device-to-device copy (each byte read once and written once), the best
    of ``tries``; default 1 GiB on a GPU, 256 MiB on a CPU."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / best_seconds(lambda: dst.copy_(src), device, tries)


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, tries: int = 3) -> float:
    """FLOP/s of an n×n GEMM in ``dtype`` (default n 8192 on a GPU, 1024 on a CPU), the best of ``tries``."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    return 2 * n**3 / best_seconds(lambda: a @ b, device, tries)


def weight_read_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes every forward reads, bytes more per token): every parameter once, except an input embedding that is
    not also the output layer (tied), of which a forward reads one row per token."""
    params = {id(p): p for p in model.parameters()}  # a tied matrix once
    total = sum(p.numel() * p.element_size() for p in params.values())
    emb = next((m.weight for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None or getattr(model.config, "tie_word_embeddings", False):
        return total, 0
    row = emb.shape[1] * emb.element_size()
    return total - emb.shape[0] * row, row


def step_read_bytes(weights: tuple[int, int], tokens: int, context_tokens: int, kv_per_token: int) -> int:
    """Bytes a forward of ``tokens`` tokens must read: the weights (``weight_read_bytes``) and the keys and values of
    the ``context_tokens`` its queries attend to, ``kv_per_token`` bytes each (all layers)."""
    return weights[0] + weights[1] * tokens + context_tokens * kv_per_token


def roofline_fields(tokens: int, seconds: float, read_bytes: int, read_bps: float, name: str) -> dict:
    """The record's roofline figures for ``tokens`` made in ``seconds`` by steps that had to read ``read_bytes``:
    the read roofline's seconds and tok/s at the measured ``read_bps``, the fraction reached (tok/s over the
    roofline's), and the same against the nominal bandwidth of the device called ``name`` where it is known."""
    roof_s = read_bytes / read_bps
    peak = nominal(NOMINAL_READ_GB_S, name)
    rec = {"read_bytes": read_bytes, "read_gb_s": round(read_bps / 1e9, 1), "read_roofline_s": round(roof_s, 4),
           "read_roofline_tok_s": round(tokens / roof_s, 1) if roof_s else None,
           "roofline_fraction": round(roof_s / seconds, 4) if seconds else None}
    if peak:
        rec.update(nominal_read_gb_s=peak, roofline_fraction_nominal=round(read_bytes / (peak * 1e9) / seconds, 4))
    return rec
