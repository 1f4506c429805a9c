"""QLoRA: the frozen base of LoRA's adapted projections kept quantized (bitsandbytes' NF4 blocks, or int8 rows).

``quantize_base`` replaces the ``weight`` of each ``engines.model.lora.adapters.LoraLinear`` by bitsandbytes' packed
form, held as buffers of the same module (``base_packed``, and ``base_absmax``: NF4's per-64-element scales or int8's
per-row ones), so offload, the trainer state and ``nn.Module.to`` move them as any tensor. Each product
dequantizes the weight (bitsandbytes' own kernels: the numbers a QLoRA user gets from ``bitsandbytes``/PEFT) and
the backward dequantizes it again instead of keeping it: the model's persistent bytes for those weights drop to
about 0.53 (NF4) or 1.02 (int8) bytes per element.

The trainer then computes with the quantized base while a replica serves the exact base plus the adapters (it keeps
the checkpoint's weights): the policy the trainer scores differs from the one sampled by the quantization error,
which the run reports as ``logprob_diff`` and the mismatch correction sees, as with any QLoRA RL setup. Saves write
the checkpoint's base plus the adapters (``exact_base``): what the replicas served.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.layout import is_quantized_base

#: model.lora.quantize_base values: bitsandbytes' 4-bit NormalFloat (QLoRA's) and its row-wise int8.
QUANT_KINDS = ("nf4", "int8")
BLOCK = 64  # NF4's block of elements per scale (bitsandbytes' and PEFT's default)


def bitsandbytes_missing() -> str | None:
    """Why bitsandbytes cannot be used here (one line), or None."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:
        return f"bitsandbytes cannot be imported ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); " \
               "pip install 'colocated-rl[qlora]'"
    return None


def _dequantized(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The module's base weight [out, in] in ``dtype``, as bitsandbytes dequantizes it."""
    import bitsandbytes.functional as bf

    if module.base_quant == "nf4":
        # NF4's blocks run over the flattened weight, but bitsandbytes' AVX-512 CPU kernel (0.49-0.50) takes a row's
        # scales as if each row began a block: wrong when in_features is not a multiple of 64. Asked for rows of
        # exactly one block (or a single row), every kernel reads the right scale; the result is the same tensor.
        n = module.out_features * module.in_features
        shape = (n // BLOCK, BLOCK) if n % BLOCK == 0 else (n,)
        state = bf.QuantState(absmax=module.base_absmax, shape=torch.Size(shape),
                              code=bf.get_4bit_type("nf4", device=module.base_packed.device), blocksize=BLOCK,
                              quant_type="nf4", dtype=module.base_dtype)
        w = bf.dequantize_4bit(module.base_packed, state, quant_type="nf4").view(module.out_features,
                                                                                  module.in_features)
    else:
        w = bf.int8_vectorwise_dequant(module.base_packed, module.base_absmax)
    return w.to(dtype)


class _QuantizedBaseLinear(torch.autograd.Function):
    """x·Wᵀ (+ b) for a frozen quantized W: dequantized for the product and again for the backward's x-gradient,
    so autograd keeps the packed bytes, never the dequantized weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.module = module
        return F.linear(x, _dequantized(module, x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ _dequantized(ctx.module, grad.dtype), None, None


def base_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x·Wᵀ (+ b) through the quantized base of ``module`` (a ``LoraLinear`` after ``quantize_base``)."""
    return _QuantizedBaseLinear.apply(x, module, module.bias)


@torch.no_grad()
def quantize_base(model: nn.Module, kind: str) -> list[str]:
    """Quantize the frozen weight of every LoRA-adapted projection of ``model`` (filled: after the checkpoint
    read) to ``kind`` ("nf4" or "int8"); returns their weights' names. The weights' own tensors are dropped."""
    import bitsandbytes.functional as bf

    if kind not in QUANT_KINDS:
        raise ValueError(f"quantize_base must be one of {QUANT_KINDS}, got {kind!r}")
    names = []
    for path, m in model.named_modules():
        # an adapted projection (engines.model.lora.adapters.LoraLinear) not quantized yet
        if not (isinstance(m, nn.Linear) and hasattr(m, "lora_A")) or getattr(m, "base_quant", None) is not None:
            continue
        w = m.weight.detach()
        if kind == "nf4":
            # float32 input: the blocks' scales come from the weight itself, not a rounded copy
            packed, state = bf.quantize_4bit(w.float(), blocksize=BLOCK, quant_type="nf4")
            absmax = state.absmax
        else:
            packed, absmax, _ = bf.int8_vectorwise_quant(w.to(torch.float16))
        m.base_dtype = w.dtype
        m.register_parameter("weight", None)
        m.register_buffer("base_packed", packed.contiguous())
        m.register_buffer("base_absmax", absmax.float().contiguous())
        m.base_quant = kind
        names.append(f"{path}.weight")
    return names


def quantized_weights(model: nn.Module) -> list[str]:
    """Names of the weights ``quantize_base`` replaced (``...q_proj.weight``), sorted."""
    return sorted(f"{path}.weight" for path, m in model.named_modules() if getattr(m, "base_quant", None))


def exact_base(state: dict[str, torch.Tensor], names: Iterable[str], checkpoint: dict[str, torch.Tensor]) -> dict:
    """``state`` (a quantized model's tensors by name) with the quantized bases' bytes dropped and the weights
    ``names`` taken from ``checkpoint`` (the run's starting model): the base the replicas serve."""
    out = {n: t for n, t in state.items() if not is_quantized_base(n)}
    for n in names:
        out[n] = checkpoint[n]
    return out


#: Bytes ``quantize_base`` keeps per weight element: packed values plus float32 scales (NF4: one per block of 64;
#: int8: one per row, below 1 % of a row of 512 or more, not counted).
BYTES_PER_WEIGHT = {"nf4": 0.5 + 4 / BLOCK, "int8": 1.0}
