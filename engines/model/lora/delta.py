"""Unmerged LoRA in a serving model: each layer that holds adapted weights adds its adapters' low-rank product to
its output, so an update writes megabytes of adapters in place instead of re-merging the model's adapted weights.

A serving layer may fuse several checkpoint weights (the native replica's ``qkv_proj`` holds q, k and v as row
blocks, ``gate_up_proj`` gate and up). For such a layer [out, in] holding P adapted blocks, ``LowRankDelta`` keeps
A = [A_1; ...; A_P] [P·r, in] and a block-diagonal B [out, P·r] whose block j (the rows of weight j, the columns
j·r..(j+1)·r) is s·B_j: the layer computes W·x + B·(A·x), which for each block's rows is W_j·x + s·B_j·A_j·x, the
trainer's ``LoraLinear`` product (the other blocks' zeros add exact zeros). A and B are plain attributes, not
parameters or buffers: the layer's tensors (what loads, sleeps and placements see) stay the base's, and the
adapters (megabytes) stay where they are through a sleep, at fixed addresses that captured graphs can read.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.layout import Placement
from engines.model.lora.adapters import adapter_pairs


def _add_delta(lin: nn.Linear, k: int) -> None:
    """Give ``lin`` a zero delta of k ranks: its forward (its own, or an instance override such as the CPU engine's
    oneDNN route) plus B·(A·x)."""
    w = lin.weight
    # plain attributes (nn.Module registers only parameters and buffers assigned so): see the module docstring
    lin.delta_a = torch.zeros(k, lin.in_features, dtype=w.dtype, device=w.device)
    lin.delta_b = torch.zeros(lin.out_features, k, dtype=w.dtype, device=w.device)
    base = lin.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return base(x) + F.linear(F.linear(x, lin.delta_a), lin.delta_b)

    lin.forward = forward


class LowRankDelta:
    """The unmerged adapters of a serving model: built, it gives each layer holding an adapted checkpoint weight a
    zero delta (it serves the base); ``load`` writes a whole set of adapters in place."""

    def __init__(self, model: nn.Module, placements: Mapping[str, Placement], adapted: list[str], rank: int) -> None:
        """``placements``: checkpoint name -> placement in ``model`` (``engines.model.layout.placements``);
        ``adapted``: the checkpoint weights (``...q_proj.weight``) the adapters adapt, each a whole row block of
        one ``nn.Linear`` weight; ``rank``: r."""
        self.rank = rank
        self._layers: list[nn.Linear] = []
        # each weight's A rows and B block, as views made once: an update is then two copies per weight
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        layers: dict[str, list[str]] = {}
        for name in sorted(adapted):
            p = placements.get(name)
            if p is None or len(p.shape) != 2 or not p.target.endswith(".weight"):
                raise ValueError(f"LoRA update: the serving model holds no weight {name}")
            layers.setdefault(p.target.removesuffix(".weight"), []).append(name)
        r = rank
        for path, names in layers.items():
            lin = model.get_submodule(path)
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"LoRA update: {path} is a {type(lin).__name__}, not a linear layer")
            _add_delta(lin, r * len(names))
            self._layers.append(lin)
            for j, name in enumerate(names):
                p = placements[name]
                if p.offset % lin.in_features or p.shape[1] != lin.in_features:
                    raise ValueError(f"LoRA update: {name} is not a row block of {path}.weight")
                row, rows = p.offset // lin.in_features, p.shape[0]
                self._views[name] = (lin.delta_a[j * r:(j + 1) * r], lin.delta_b[row:row + rows, j * r:(j + 1) * r])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lin in self._layers for t in (lin.delta_a, lin.delta_b))

    @torch.no_grad()
    def load(self, adapters: Mapping[str, torch.Tensor], scaling: float) -> None:
        """Serve ``adapters`` (every one, by the trainer's names: ``...q_proj.lora_A.weight`` [r, in],
        ``...lora_B.weight`` [out, r]) at ``scaling``: A and s·B (scaled in the adapters' dtype) copied in place."""
        dst, src = [], []
        pairs = adapter_pairs(adapters)
        for name, (a_rows, b_block) in self._views.items():
            m = name.removesuffix(".weight")
            a, b = pairs.get(name, (None, None))
            if a is None or b is None or a.shape != a_rows.shape or b.shape != b_block.shape:
                have = "missing" if a is None or b is None else f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}"
                raise ValueError(f"LoRA update: {m} has {have}, not "
                                 f"{list(a_rows.shape)} and {list(b_block.shape)}")
            dst += (a_rows, b_block)
            src += (a, b)
        # s·B in the adapters' dtype, then every copy in one batched call (cast into the replica's dtype)
        src[1::2] = torch._foreach_mul(src[1::2], scaling)
        torch._foreach_copy_(dst, src, non_blocking=True)
