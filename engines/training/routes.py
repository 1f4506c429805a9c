"""Rollout routes laid out as a packed batch's tokens, for replaying them in the trainer's forward.

A sequence's routes are an int [tokens, MoE layers, k] array over its prompt and response tokens as the rollout
engine fed them to the model (``Sample.routed_experts``). The rollout never feeds the last response token (it is
sampled, not read), so a sequence may carry one row fewer than its tokens: that token's output is no loss target
and no later token attends to it, so any route serves; it gets the sequence's previous row. Filler positions of a
packed row take experts 0..k-1 (they are never targets either).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engines.model.native.routing import check_routes
from engines.training.packing import PackedBatch


def pack_routes(batch: PackedBatch, routes: Sequence[np.ndarray], layers: int, top_k: int,
                num_experts: int) -> torch.Tensor:
    """[rows · width, layers, k] routes of ``batch``'s tokens in the forward's flattened order, from each packed
    sequence's ``routes`` (checked in one line against the model and the sequence's length)."""
    doc, pos = batch.mask.doc.cpu(), batch.mask.positions.cpu()
    lengths = torch.bincount(doc[doc >= 0], minlength=len(routes)).tolist()
    per_seq = []
    for i, r in enumerate(routes):
        if r is None:
            raise ValueError(f"sequence {i} has no routes: its rollout engine did not record them")
        check_routes(r, layers, top_k, num_experts)
        if len(r) not in (lengths[i], lengths[i] - 1) or len(r) == 0:
            raise ValueError(f"sequence {i} has {len(r)} routes for {lengths[i]} tokens (its prompt and response)")
        t = torch.as_tensor(np.asarray(r), dtype=torch.long)
        per_seq.append(t if len(t) == lengths[i] else torch.cat((t, t[-1:])))
    flat = torch.cat(per_seq) if per_seq else torch.zeros(0, layers, top_k, dtype=torch.long)
    starts = torch.tensor([0, *np.cumsum([len(t) for t in per_seq])[:-1].tolist()], dtype=torch.long)
    out = torch.arange(top_k).expand(doc.numel(), layers, top_k).clone()
    real = (doc >= 0).flatten()
    out[real] = flat[starts[doc.flatten()[real]] + pos.flatten()[real]]
    return out.to(batch.ids.device)
