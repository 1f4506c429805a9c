"""Which optimizer takes each parameter, decided by its shape and its role in the model, not by family-specific
names, so the native models and any transformers model get the same rule.

Muon orthogonalises the update of a matrix that maps hidden features to hidden features. It takes:
- ``matrix``: a 2-D weight inside a decoder layer (attention and MLP projections, fused ones included, the
  projections of linear-attention and state-space mixers);
- ``experts``: a 3-D stack of expert matrices inside a decoder layer [experts, n, m] (each orthogonalised alone).
AdamW takes the rest:
- ``embedding`` (an ``nn.Embedding``'s table) and ``head`` (outside the decoder layers: the output head, final
  norms and anything else at the root);
- ``bias`` (a parameter named ``*bias``, whatever its shape: gpt-oss's stacked expert biases are 2-D);
- ``router``: an MoE router or gate (it scores experts against each other rather than mapping features;
  DeepSeek-V3 and Kimi K2 train theirs with AdamW): a native ``Router``, a module whose class name says
  ``Router``, or a sub-module named ``gate``/``router``/``shared_expert_gate``;
- ``conv``: a convolution's kernel (the depthwise short convolutions of Mamba, Gated DeltaNet, LFM2);
- ``norm`` (a 1-D gain of a norm module), ``sink`` (gpt-oss's per-head sink logits), ``vector`` (other 1-D or
  n×1 parameters: Mamba's ``A_log`` and ``D``, a gate with one output);
- ``vision``: a vision-language model's vision tower and projector (``engines.model.hf.spec.vision_modules``).
  Muon and QK-Clip are the language model's: its attention logits are the ones K2 caps, and the tower (a ViT
  trained apart, with AdamW, as published vision-language models are) keeps the optimizer it was trained with.
"""

from __future__ import annotations

from torch import nn

from engines.model.hf.spec import decoder_layers, vision_modules
from engines.model.native.moe import Router

#: Roles whose parameters Muon optimises.
MUON_ROLES = frozenset({"matrix", "experts"})
#: Names of sub-modules that are MoE routers/gates (``gate_proj`` is an MLP projection, not one of these).
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})


def _role_in_layer(name: str, p: nn.Parameter, owner: nn.Module, owner_name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    cls = type(owner).__name__
    if leaf.endswith("bias"):
        return "bias"
    if isinstance(owner, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(owner, Router) or "Router" in cls or owner_name in ROUTER_NAMES:
        return "router"
    if p.ndim <= 1 or (p.ndim == 2 and min(p.shape) == 1):
        if "Norm" in cls or "norm" in owner_name:
            return "norm"
        return "sink" if "sink" in leaf else "vector"
    if p.ndim == 2:
        return "matrix"
    if p.ndim == 3:
        return "experts"
    return "vector"


def param_roles(model: nn.Module) -> dict[str, str]:
    """The role (see the module docstring) of every parameter of ``model``, by its (first) name."""
    inside = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    vision = {id(p) for m in vision_modules(model) for p in m.parameters()}
    roles: dict[str, str] = {}
    for name, p in model.named_parameters():
        path = name.rsplit(".", 1)[0] if "." in name else ""
        owner = model.get_submodule(path)
        if id(p) in vision:
            roles[name] = "vision"
        elif isinstance(owner, nn.Embedding):
            roles[name] = "embedding"
        elif id(p) not in inside:
            roles[name] = "head"
        else:
            roles[name] = _role_in_layer(name, p, owner, path.rsplit(".", 1)[-1])
    return roles


def muon_params(model: nn.Module) -> set[int]:
    """ids of the parameters Muon optimises (roles in ``MUON_ROLES``); AdamW takes every other one."""
    roles = param_roles(model)
    return {id(p) for name, p in model.named_parameters() if roles[name] in MUON_ROLES}
