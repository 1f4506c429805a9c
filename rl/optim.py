"""Optimizers: Muon on 2-D hidden matrices, AdamW on embeddings, the output head and norms."""

from __future__ import annotations

import torch
from torch import nn

from rl.muon import ShardedMuon


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's domain: 2-D weights inside the transformer blocks (report Algorithm 1)."""
    return p.ndim == 2 and ".layers." in f".{name}"


def build_optimizers(model: nn.Module, kind: str, lr: float, weight_decay: float,
                     momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95)) -> list[torch.optim.Optimizer]:
    """``kind`` "muon": Muon (match_rms_adamw) + AdamW for the rest; "adamw": AdamW for all.

    Muon is ``ShardedMuon``: ``torch.optim.Muon``'s step on plain tensors, whole-matrix
    Newton–Schulz on FSDP2-sharded (DTensor) parameters.
    """
    if kind not in ("muon", "adamw"):
        raise ValueError(f"unknown optimizer kind {kind!r}; expected 'muon' or 'adamw'")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if kind == "muon" and is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not (kind == "muon" and is_hidden_matrix(n, p))]
    opts: list[torch.optim.Optimizer] = []
    if hidden:
        opts.append(ShardedMuon(hidden, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                adjust_lr_fn="match_rms_adamw"))
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas))
    return opts
