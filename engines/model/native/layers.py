"""Building blocks every family shares: RMSNorm and the SwiGLU feed-forward block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32, scale in the model's dtype (as transformers does)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)). ``fused`` keeps gate and up as one [2I, H] matrix (one matmul),
    the inference layout; its rows are gate's then up's (``hub_placements`` says so)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.intermediate, self.fused = intermediate, fused
        if fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
            self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)

    def hub_placements(self) -> list[tuple[str, str, int, tuple[int, ...]]]:
        """(checkpoint name, own parameter, element offset, shape) of each checkpoint tensor the fused
        layout holds inside another; names relative to this block."""
        if not self.fused:
            return []
        i, h = self.intermediate, self.gate_up_proj.in_features
        out = [("gate_proj.weight", "gate_up_proj.weight", 0, (i, h)),
               ("up_proj.weight", "gate_up_proj.weight", i * h, (i, h))]
        if self.gate_up_proj.bias is not None:
            out += [("gate_proj.bias", "gate_up_proj.bias", 0, (i,)), ("up_proj.bias", "gate_up_proj.bias", i, (i,))]
        return out
