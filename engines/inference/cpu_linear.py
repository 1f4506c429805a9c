"""A CPU replica's linear layers through oneDNN's matmul instead of torch's default CPU GEMM.

On this project's 2-core AMD EPYC machine ``F.linear`` in float32 runs at about half the speed of oneDNN's matmul
on the same dense weight (128 x 768 x 768: 766 against 350 us; the decode step of an 88 M model 1.69x faster in
all), which is what vLLM's CPU build uses. PyTorch exposes that matmul as ``torch.ops.mkldnn._linear_pointwise``
(the op its own compiler emits for CPU linears); it reads the module's dense weight as it is, so a weight update
written in place needs no re-packing. The op has no backward: a forward that records gradients (a model trained
as well as served, as some tests do) takes ``F.linear``. Where the op is missing or disagrees with ``F.linear`` on
a probe, nothing is changed.
"""

from __future__ import annotations

import logging
import types
from functools import cache

import torch
from torch import nn

log = logging.getLogger(__name__)


def padded_rows(rows: int) -> int:
    """The batch a step of ``rows`` rows is padded to: oneDNN builds a kernel for every new shape (~0.4 ms each,
    then cached), and an RL rollout's batch shrinks step by step; padded to a power of two (at least 8; past 1024
    a multiple of 256) a few dozen shapes serve every batch, at most twice the rows (still faster than F.linear
    on unpadded rows, which is slowest on small batches here)."""
    if rows > 1024:
        return -(-rows // 256) * 256
    return max(8, 1 << (rows - 1).bit_length())


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad)):
        # a model trained as well as served (the op has no backward): torch's path
        return nn.functional.linear(x, self.weight, self.bias)
    padded = padded_rows(rows)
    flat = x.reshape(rows, x.shape[-1])
    if padded != rows:
        flat = torch.cat((flat, flat.new_zeros(padded - rows, flat.shape[1])))
    out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


@cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear runs here in ``dtype`` and agrees with ``F.linear`` (a bias, a strided input). A CPU
    without native bfloat16 (AVX2 only, as this project's machine) has no bfloat16 kernel: such layers keep
    F.linear."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 12, 5, generator=g).transpose(1, 2).to(dtype)
        w, b = torch.randn(7, 12, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "").float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(got, nn.functional.linear(x.float(), w.float(), b.float()), atol=tol, rtol=tol))
    except Exception as e:  # a build or a CPU without it: the default GEMM stays
        log.info("oneDNN linear unavailable in %s (%s)", dtype, e)
        return False


#: Layers with fewer inputs than this keep F.linear: on the 0.92 M quick-start model (width 128) oneDNN won on a uniform
#: batch (0.72 -> 0.59 s) but lost an RL rollout (0.29-0.31 -> 0.31-0.50 s) to its per-shape kernel builds; at
#: width 768 (88 M) the RL rollout decodes 1.5x as fast.
MIN_FEATURES = 512


def route_linears(model: nn.Module, min_features: int = MIN_FEATURES) -> int:
    """Make every plain ``nn.Linear`` of ``model`` (on CPU, float32 or bfloat16, with at least ``min_features``
    inputs) compute through oneDNN; returns how many. Only this model object changes (an instance attribute), so
    other models keep torch's GEMM."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype in (torch.float32,
                                                                                           torch.bfloat16) \
                and m.in_features >= min_features and available(m.weight.dtype):
            m.forward = types.MethodType(_forward, m)
            n += 1
    return n
