"""Where each tensor of a Hugging Face checkpoint lives in a model's own tensors.

A checkpoint holds one tensor per expert matrix (``mlp.experts.3.gate_proj.weight``) and separate
q/k/v and gate/up projections; the model stacks experts, and its inference layout fuses q/k/v and
gate/up. Every checkpoint tensor is one contiguous run of elements of one model tensor, so a
placement is (model tensor, element offset): loading, saving and the checkpoint engine's weight
update all go through this one map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Placement:
    """Checkpoint tensor of ``shape`` = elements [offset, offset + numel) of model tensor ``target``."""

    target: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by name, each storage once (a tied output head
    is not listed: it is the embedding)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def placements(model: nn.Module) -> dict[str, Placement]:
    """Checkpoint tensor name -> its placement in ``model`` (works on meta, sharded and plain models). A model that
    knows its checkpoint's layout itself (a transformers model: ``checkpoint_placements``) answers for itself."""
    own = getattr(model, "checkpoint_placements", None)
    if own is not None:
        return own()
    aliases: dict[str, str] = {}  # module prefix -> the prefix checkpoints use for it
    placed: dict[str, Placement] = {}
    covered: set[str] = set()
    for prefix, module in model.named_modules():
        alias = getattr(module, "hub_alias", None)
        if alias is not None:
            aliases[prefix] = prefix.rpartition(".")[0] + "." + alias
        for hub, own, offset, shape in getattr(module, "hub_placements", lambda: [])():
            placed[_rename(f"{prefix}.{hub}", aliases)] = Placement(f"{prefix}.{own}", offset, tuple(shape))
            covered.add(f"{prefix}.{own}")
    from engines.model.fp8 import scale_placements, scale_tensors  # FP8 replicas keep block scales beside matrices
    from engines.model.lora import is_adapter
    from engines.model.lora_quant import placed_tensors  # QLoRA: a quantized base stands for its weight

    covered |= scale_tensors(model)
    for name, t in placed_tensors(model, model_tensors(model)).items():
        # LoRA's adapters are no checkpoint tensor: they travel and are saved on their own
        if name not in covered and not is_adapter(name):
            placed[_rename(name, aliases)] = Placement(name, 0, tuple(t.shape))
    placed.update(scale_placements(model, placed))
    return placed


def byte_placements(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint tensor name -> (``model``'s own tensor holding it, byte offset inside that tensor)."""
    sizes = {n: t.element_size() for n, t in model_tensors(model).items()}
    return {name: (p.target, p.offset * sizes[p.target]) for name, p in placements(model).items()}


def _rename(name: str, aliases: dict[str, str]) -> str:
    for prefix, alias in aliases.items():
        if name.startswith(prefix + "."):
            return alias + name[len(prefix):]
    return name


def hub_view(tensor: torch.Tensor, p: Placement) -> torch.Tensor:
    """The checkpoint tensor ``p`` as a view of the full model tensor it lives in."""
    return tensor.detach().reshape(-1)[p.offset:p.offset + p.numel].view(p.shape)


def hub_state(model: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under a checkpoint's names, as views (``tensors``: full tensors by the
    model's names, e.g. gathered from FSDP2 shards; default the model's own)."""
    full = tensors if tensors is not None else {k: v.detach() for k, v in model_tensors(model).items()}
    return {name: hub_view(full[p.target], p) for name, p in placements(model).items()}
