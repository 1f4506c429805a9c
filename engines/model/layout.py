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
    covered |= scale_tensors(model)  # FP8 replicas keep block scales beside matrices
    for name, t in placed_tensors(model, model_tensors(model)).items():  # QLoRA: a quantized base stands for its weight
        # LoRA's adapters are no checkpoint tensor: they travel and are saved on their own
        if name not in covered and not is_adapter(name):
            placed[_rename(name, aliases)] = Placement(name, 0, tuple(t.shape))
    placed.update(scale_placements(model, placed))
    return placed


# ---- tensors a model holds that are not its checkpoint's, known by name or declared by their module -------------
# (so this map needs none of the modules that hold them: FP8 layers, LoRA adapters, a QLoRA base)

#: LoRA's factors beside an adapted weight (``q_proj.lora_A.weight``): PEFT's names less its prefix
ADAPTER_FACTORS = (".lora_A.", ".lora_B.")
#: a QLoRA base's packed bytes and scales, which stand for its weight (``engines.model.lora.quant``)
QUANTIZED_BASE = (".base_packed", ".base_absmax")


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...lora_A.weight``, ``...lora_B.weight``)."""
    return any(f in name for f in ADAPTER_FACTORS)


def is_quantized_base(name: str) -> bool:
    """Whether a tensor name is a quantized base's packed bytes or scales (no checkpoint tensor)."""
    return name.endswith(QUANTIZED_BASE)


def placed_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (``model``'s own by name) as checkpoint placements see them: a quantized base's bytes out, and
    its weight in as a meta tensor of the original shape (the checkpoint tensor it stands for)."""
    out = {n: t for n, t in tensors.items() if not is_quantized_base(n)}
    for path, m in model.named_modules():
        if getattr(m, "base_quant", None):
            out[f"{path}.weight"] = torch.empty((m.out_features, m.in_features), dtype=m.base_dtype, device="meta")
    return out


def _scaled(model: nn.Module):
    """(module path, [(matrix attribute, its scale grid's attribute)], block) of every block-scaled (FP8) module:
    those that declare ``hub_scales``."""
    for prefix, m in model.named_modules():
        scales = getattr(m, "hub_scales", None)
        if scales is not None:
            yield prefix, scales(), m.block


def scale_tensors(model: nn.Module) -> set[str]:
    """Names of the scale grids of ``model``'s FP8 matrices (placed by ``scale_placements``)."""
    return {f"{prefix}.{scale}" for prefix, pairs, _ in _scaled(model) for _, scale in pairs}


def scale_placements(model: nn.Module, placed: dict[str, Placement]) -> dict[str, Placement]:
    """Checkpoint name of each FP8 matrix's scale grid (its matrix's name + the grid attribute's suffix) -> its
    placement in the replica: each checkpoint part of a matrix has its own grid, in the order of the parts."""
    by_target: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    for name, p in placed.items():
        by_target.setdefault(p.target, []).append((p.offset, name, p.shape))
    out = {}
    for prefix, pairs, block in _scaled(model):
        for weight, scale in pairs:
            suffix, at = scale.removeprefix(weight), 0
            for _, name, shape in sorted(by_target.get(f"{prefix}.{weight}", [])):
                g = (-(-shape[0] // block), -(-shape[1] // block))
                out[name + suffix] = Placement(f"{prefix}.{scale}", at, g)
                at += g[0] * g[1]
    return out


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
