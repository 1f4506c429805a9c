"""Block-FP8 weights, as DeepSeek-V3 and Kimi K2 checkpoints store them.

A matrix W [rows, cols] is held as Q (float8 e4m3) and one float32 scale per block of
``block`` x ``block`` elements, S [ceil(rows/B), ceil(cols/B)], named ``<weight>_scale_inv``:
W ~= Q * S blockwise. ``quantize`` is the reference: S = block amax / 448 (1 for an all-zero block)
and Q = W / S rounded to nearest even, in float32. Whoever sends FP8 bytes (the checkpoint
engine's owners, bucket by bucket) reproduces it bit for bit, because every element only depends
on its own value and its block's scale.

An FP8 inference replica (``to_fp8``) keeps every linear and stacked-expert matrix of its decoder
layers this way (embedding, output head, norms and routers stay in the model's dtype) and
dequantises one matrix at a time in forward. A matrix that a fused layout builds from several
checkpoint tensors (q/k/v, gate/up, experts) keeps each part's own block grid, stacked in part
order, exactly as the checkpoint holds them, so a fused replica loads the checkpoint's scales as
they are.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.native.moe import Experts

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def grid(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    """Shape of the scale grid of a [rows, cols] matrix."""
    return -(-rows // block), -(-cols // block)


def _blocks(w: torch.Tensor, block: int, top: int = 0) -> torch.Tensor:
    """``w`` [rows, cols] in float32 as [block rows, block, block cols, block], zero-padded at the end
    (and by ``top`` rows at the start: rows that begin inside a block)."""
    rows, cols = w.shape
    gr, gc = grid(top + rows, cols, block)
    x = w.float()
    if top or (top + rows) % block or cols % block:
        x = F.pad(x, (0, gc * block - cols, top, gr * block - rows - top))
    return x.view(gr, block, gc, block)


def block_amax(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Largest |element| of each block of a [rows, cols] matrix, in float32."""
    return _blocks(w, block).abs().amax(dim=3).amax(dim=1)


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_with(w: torch.Tensor, scales: torch.Tensor, block: int = BLOCK, top: int = 0) -> torch.Tensor:
    """Q of the rows ``w`` [n, cols] given the scales of the block rows they fall in; the first row is
    row ``top`` of its block."""
    rows, cols = w.shape
    q = (_blocks(w, block, top) / scales[:, None, :, None]).to(FP8)
    return q.view(q.shape[0] * block, -1)[top:top + rows, :cols]


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference block quantisation of a matrix: (Q float8_e4m3fn, S float32)."""
    s = scales_from_amax(block_amax(w, block))
    return quantize_with(w, s, block).contiguous(), s


def dequantize(q: torch.Tensor, s: torch.Tensor, block: int = BLOCK, dtype: torch.dtype = torch.float32,
               top: int = 0) -> torch.Tensor:
    """W = Q * S blockwise, in ``dtype`` (``top``: the first row's place in its block, as ``quantize_with``)."""
    rows, cols = q.shape
    w = _blocks(q, block, top) * s[:, None, :, None]
    return w.view(w.shape[0] * block, -1)[top:top + rows, :cols].to(dtype)


def dequantize_rows(q: torch.Tensor, row_scales: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """W = Q·S in ``dtype`` for Q [rows, cols] and each row's block scales ``row_scales`` [rows, ceil(cols / block)].

    Computed in the compute dtype itself when it is bfloat16 (which holds every e4m3 value exactly; the
    product is rounded twice instead of once, within a bf16 step) or float32: a forward then reads the FP8
    bytes once and writes one matrix in its own dtype, never a float32 copy.
    """
    rows, cols = q.shape
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    s = row_scales.to(work)
    if cols % block == 0:  # broadcast each scale over its block: no per-element scale matrix
        w = (q.reshape(rows, cols // block, block).to(work) * s[:, :, None]).view(rows, cols)
    else:
        w = q.to(work) * s.repeat_interleave(block, 1)[:, :cols]
    return w.to(dtype)


def checkpoint_block(config) -> int | None:
    """The block size of a config.json's FP8 ``quantization_config`` (``ModelConfig.extra``), or None."""
    qc = (getattr(config, "extra", None) or {}).get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        return None
    return int((qc.get("weight_block_size") or [BLOCK, BLOCK])[0])


def _part_index(parts: list[int], cols: int, block: int) -> tuple[torch.Tensor, int]:
    """For a matrix made of row ``parts``: the scale-grid row of each matrix row, and the grid's rows."""
    index, base = [], 0
    for rows in parts:
        index.append(base + torch.arange(rows) // block)
        base += -(-rows // block)
    return torch.cat(index), base


class Fp8Linear(nn.Module):
    """A linear layer whose weight is block-FP8 (``weight`` + ``weight_scale_inv``); the bias stays."""

    def __init__(self, in_features: int, out_features: int, parts: list[int], bias: nn.Parameter | None,
                 block: int = BLOCK, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        index, grid_rows = _part_index(parts, in_features, block)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(grid_rows, -(-in_features // block),
                                                            dtype=torch.float32, device=device))
        self.register_buffer("_scale_row", index.to(_real(torch.device(device or "cpu"))), persistent=False)
        self.bias = bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight W = Q·S in ``dtype``."""
        return dequantize_rows(self.weight, self.weight_scale_inv[self._scale_row], self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def hub_scales(self) -> list[tuple[str, str]]:
        """(matrix, its scale grid) attributes, which ``engines.model.layout`` places beside the checkpoint's."""
        return [("weight", "weight" + SCALE_SUFFIX)]

    def _apply(self, fn, recurse=True):
        return _keep_dtypes(self, super()._apply, fn, recurse)


class Fp8Experts(Experts):
    """Stacked experts with block-FP8 matrices, one scale grid per expert part (``parts``: row counts)."""

    def __init__(self, experts: Experts, parts: dict[str, list[int]], block: int = BLOCK) -> None:
        nn.Module.__init__(self)  # the FP8 buffers replace the parameters Experts.__init__ would make
        self.num_experts, self.intermediate, self.fused, self.block = (
            experts.num_experts, experts.intermediate, experts.fused, block)
        for name, p in experts.named_parameters(recurse=False):
            e, rows, cols = p.shape
            index, grid_rows = _part_index(parts[name], cols, block)
            self.register_buffer(name, torch.empty(e, rows, cols, dtype=FP8, device=p.device))
            self.register_buffer(name + SCALE_SUFFIX, torch.ones(e, grid_rows, -(-cols // block), dtype=torch.float32,
                                                                 device=p.device))
            self.register_buffer(f"_scale_row_{name}", index.to(_real(p.device)), persistent=False)

    def matrix(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        q, s = getattr(self, name)[e], getattr(self, name + SCALE_SUFFIX)[e]
        rows = getattr(self, f"_scale_row_{name}")
        return dequantize_rows(q, s[rows], self.block, dtype)

    def hub_scales(self) -> list[tuple[str, str]]:
        """(matrix, its scale grid) attributes of every stacked matrix (see ``Fp8Linear.hub_scales``)."""
        return [(n.removesuffix(SCALE_SUFFIX), n) for n in self._buffers if n.endswith(SCALE_SUFFIX)]

    def _apply(self, fn, recurse=True):
        return _keep_dtypes(self, super()._apply, fn, recurse)


def _real(device: torch.device) -> torch.device | str:
    """Index tensors are computed, never loaded: on a meta model they live on the CPU."""
    return "cpu" if device.type == "meta" else device


def _keep_dtypes(module: nn.Module, apply, fn, recurse):
    """``module.to(dtype)`` must move FP8 weights and their float32 scales, never cast them."""
    before = {n: b for n, b in module._buffers.items() if b is not None}
    apply(fn, recurse)
    for n, old in before.items():
        new = module._buffers[n]
        if new is not None and new.dtype != old.dtype:
            module._buffers[n] = old.to(new.device)
    return module


def fp8_targets(model: nn.Module) -> dict[str, list[tuple[int, tuple[int, ...]]]]:
    """Model tensors an FP8 replica quantises -> their checkpoint parts (element offset, shape), in order."""
    from engines.model.layout import placements

    wanted = set()
    for prefix, m in model.model.layers.named_modules(prefix="model.layers"):
        if isinstance(m, nn.Linear):
            wanted.add(f"{prefix}.weight")
        elif isinstance(m, Experts):
            wanted |= {f"{prefix}.{n}" for n, _ in m.named_parameters(recurse=False)}
    parts: dict[str, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for p in placements(model).values():
        if p.target in wanted:
            parts[p.target].append((p.offset, p.shape))
    return {t: sorted(ps) for t, ps in parts.items()}


@torch.no_grad()
def to_fp8(model: nn.Module, block: int = BLOCK) -> nn.Module:
    """Turn ``model`` (in place) into an FP8 replica: its decoder layers' linear and expert matrices
    become block-FP8, quantised from the weights it holds (a meta or uninitialised model stays so)."""
    targets = fp8_targets(model)
    for prefix, m in list(model.model.layers.named_modules(prefix="model.layers")):
        parent_name, _, attr = prefix.rpartition(".")
        if isinstance(m, nn.Linear):
            new: nn.Module = Fp8Linear(m.in_features, m.out_features, [s[0] for _, s in targets[f"{prefix}.weight"]],
                                       m.bias, block, m.weight.device)
            sources = {"weight": m.weight}
        elif isinstance(m, Experts) and not isinstance(m, Fp8Experts):
            names = [n for n, _ in m.named_parameters(recurse=False)]
            new = Fp8Experts(m, {n: _expert_parts(targets[f"{prefix}.{n}"], m.num_experts) for n in names}, block)
            sources = {n: getattr(m, n) for n in names}
        else:
            continue
        if model.model.embed_tokens.weight.device.type != "meta":
            for name, w in sources.items():
                _quantize_into(new, name, w, targets[f"{prefix}.{name}"], block)
        setattr(model.get_submodule(parent_name), attr, new)
    return model


def _expert_parts(parts: list[tuple[int, tuple[int, ...]]], experts: int) -> list[int]:
    """The row parts of one expert's matrix (every expert has the same)."""
    per = len(parts) // experts
    return [s[0] for _, s in parts[:per]]


def _quantize_into(module: nn.Module, name: str, w: torch.Tensor, parts, block: int) -> None:
    """Quantise ``w`` part by part (as the checkpoint's own tensors) into ``module``'s FP8 tensors."""
    q, s = getattr(module, name), getattr(module, name + SCALE_SUFFIX)
    flat_w, flat_q, flat_s = w.reshape(-1), q.view(-1), s.view(-1)
    at = 0
    for offset, shape in parts:
        n = shape[0] * shape[1]
        pq, ps = quantize(flat_w[offset:offset + n].view(shape), block)
        flat_q[offset:offset + n] = pq.reshape(-1)
        flat_s[at:at + ps.numel()] = ps.reshape(-1)
        at += ps.numel()


