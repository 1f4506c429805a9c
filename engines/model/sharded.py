"""Tensors that may be FSDP2 shards: this rank's rows of a DTensor, where they start, and the whole.

FSDP2 splits each parameter's rows over the ranks (``Shard(0)``, ``torch.chunk`` sizes); expert-parallel training
splits the stacked experts the same way along each dimension of its grid (whole experts on each rank). The model
code (QK-Clip scaling rows of a sharded weight), checkpoint I/O and the checkpoint engine read
parameters through these helpers, so they work the same on a plain tensor and on a shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard


class UnsupportedShardingError(ValueError, NotImplementedError):
    """A DTensor layout other than rows split over a 1-D mesh (``Shard(0)``) or replication."""


def world_size() -> int:
    """Ranks in the default process group; 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group; 0 when torch.distributed is not initialised."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def chunk_rows(rows: int, world: int) -> list[int]:
    """Rows each rank holds under FSDP2's ``torch.chunk``-style ``Shard(0)`` split (later ranks may hold 0)."""
    c = -(-rows // world)
    return [max(0, min(c, rows - r * c)) for r in range(world)]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The locally held part of ``t``: a DTensor's local shard, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_row_sharded(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows are split over several ranks (False: each rank holds it whole); any layout
    other than ``Shard(0)`` on every dimension of its mesh, or replication, raises UnsupportedShardingError."""
    if not isinstance(t, DTensor) or t.device_mesh.size() == 1 or all(isinstance(p, Replicate) for p in t.placements):
        return False
    if not all(isinstance(p, Shard) and p.dim == 0 for p in t.placements):
        raise UnsupportedShardingError(f"only rows sharded as Shard(0) on each mesh dimension (or Replicate) are "
                                       f"supported, got placements {t.placements} on a {t.device_mesh.ndim}-D mesh")
    return True


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's local tensor of ``t`` and the global index of its first row (dim-0 sharding: on a mesh of several
    dimensions, the rows split along the first, each part along the next, as DTensor nests them)."""
    local = local_tensor(t)
    if not is_row_sharded(t):
        return local, 0
    mesh, rows, first = t.device_mesh, t.shape[0], 0
    for d, r in enumerate(mesh.get_coordinate()):
        counts = chunk_rows(rows, mesh.size(d))
        first, rows = first + sum(counts[:r]), counts[r]
    if local.shape[0] != rows:  # a different chunking rule than torch.chunk's would land here
        raise RuntimeError(f"rank {dist.get_rank()} holds {local.shape[0]} rows of {t.shape[0]}, expected {rows}")
    return local, first


def shard_offset(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's local tensor of ``t`` and its byte offset inside the full tensor's row-major bytes."""
    local, first = local_rows(t)
    return local, (first * (t.numel() // t.shape[0]) * t.element_size() if first else 0)


def local_shards(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Per state_dict entry (HF names): this rank's contiguous local tensor and its byte offset.

    The tensors are views of the live storage: valid only while the engine is not offloaded
    (``TrainingEngine.host_shards`` gives the same views inside the host buffer meanwhile).
    """
    out = {}
    for name, t in model.state_dict().items():
        local, offset = shard_offset(t)
        if not local.is_contiguous():
            raise RuntimeError(f"{name}: the local shard is not contiguous")
        out[name] = (local, offset)
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the state_dict as a full tensor; collective, every rank must call it."""
    return {name: t.full_tensor() if isinstance(t, DTensor) else t.detach()
            for name, t in model.state_dict().items()}
