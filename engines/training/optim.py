"""Optimizers: Muon on the matrices inside the transformer blocks, AdamW on everything else.

Muon (report Algorithm 1) takes 2-D weights of the decoder layers and stacked expert tensors
[experts, n, m], each expert's matrix orthogonalised on its own. AdamW takes embeddings, the output
head, norms, biases and MoE routers: a router's rows score experts against each other rather than
map hidden features, and DeepSeek-V3 and Kimi K2 train theirs with AdamW too. DeepSeek-V3's
``e_score_correction_bias`` is a buffer, not a parameter: it only steers which experts are chosen,
gets no gradient, and stays frozen here (DeepSeek adjusts it during pre-training by expert load, a
rule for large batches; freezing it keeps the policy's routing where the checkpoint left it).
"""

from __future__ import annotations

import torch
from torch import nn

from engines.training.muon import ShardedMuon
from engines.training.param_roles import muon_params


def build_optimizers(model: nn.Module, kind: str, lr: float, weight_decay: float,
                     momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95)) -> list[torch.optim.Optimizer]:
    """``kind`` "muon": Muon (match_rms_adamw) + AdamW for the rest; "adamw": AdamW for all.

    Muon is ``ShardedMuon``: ``torch.optim.Muon``'s step on plain tensors, whole-matrix
    Newton–Schulz on FSDP2-sharded (DTensor) parameters.
    """
    if kind not in ("muon", "adamw"):
        raise ValueError(f"unknown optimizer kind {kind!r}; expected 'muon' or 'adamw'")
    muon = muon_params(model) if kind == "muon" else set()
    trainable = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for p in trainable if id(p) in muon]
    rest = [p for p in trainable if id(p) not in muon]
    opts: list[torch.optim.Optimizer] = []
    if hidden:
        opts.append(ShardedMuon(hidden, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                adjust_lr_fn="match_rms_adamw"))
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas))
    return opts
