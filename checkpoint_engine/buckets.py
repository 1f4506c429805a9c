"""Packing parameters into fixed-size, aligned buckets, byte-exactly.

A tensor larger than a bucket is split into pieces across consecutive buckets, so peak buffer
memory never depends on the largest parameter.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

ALIGN = 256  # bytes; matches CUDA's allocation alignment so pieces can be viewed in place


@dataclass(frozen=True)
class TensorSpec:
    """What the receiver must hold for one named tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """Bytes [start, start + length) of tensor ``name`` live at ``offset`` in the bucket."""

    name: str
    start: int
    length: int
    offset: int


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """Buckets in transfer order; bucket k holds pieces of ``owners[k]``'s tensors only.

    ``fp8`` maps each block-FP8 tensor of the plan to its scale grid's tensor (``engines.model.native.fp8``, blocks
    of ``block`` x ``block``): an owner holding the weight in another dtype quantises it while staging.
    """

    bucket_bytes: int
    tensors: dict[str, TensorSpec]
    buckets: list[list[Piece]]
    owners: list[int]
    fp8: dict[str, str] = field(default_factory=dict)
    block: int = 128

    def used_bytes(self, k: int) -> int:
        """Bytes of bucket k that carry data, rounded up to ``ALIGN``."""
        last = self.buckets[k][-1]
        return -(-(last.offset + last.length) // ALIGN) * ALIGN


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())


#: Who holds a tensor: one worker (the whole tensor), or byte ranges ``(worker, lo, hi)`` of it,
#: as a row-sharded trainer holds them (a dim-0 shard is a contiguous byte range).
Ownership = int | Sequence[tuple[int, int, int]]


def _pack(segments: list[tuple[str, int, int]], bucket_bytes: int) -> list[list[Piece]]:
    buckets: list[list[Piece]] = [[]]
    used = 0
    for name, start, end in segments:
        while start < end:
            if used >= bucket_bytes:
                buckets.append([])
                used = 0
            length = min(end - start, bucket_bytes - used)
            buckets[-1].append(Piece(name, start, length, used))
            start += length
            used += -(-length // ALIGN) * ALIGN
    return [b for b in buckets if b]


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int, owners: Mapping[str, Ownership] | None = None,
                 fp8: Mapping[str, str] | None = None, block: int = 128) -> BucketPlan:
    """Assign every byte of every tensor to a bucket, each piece aligned to ``ALIGN``.

    ``owners`` maps a tensor to the worker that holds it, or to the byte ranges each worker holds
    (its trainer shard); each owner's bytes are packed separately and the owners' buckets
    interleaved, so broadcast sources rotate. Unlisted tensors belong to worker 0. ``fp8``: FP8
    weights and their scale grids (see ``BucketPlan``).
    """
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket size must be a positive multiple of {ALIGN} bytes, got {bucket_bytes}")
    owners = owners or {}
    by_owner: dict[int, list[tuple[str, int, int]]] = {}
    for s in specs:
        held = owners.get(s.name, 0)
        ranges = [(held, 0, s.nbytes)] if isinstance(held, int) else sorted(held, key=lambda r: r[1])
        if sum(hi - lo for _, lo, hi in ranges) != s.nbytes or any(
                a[2] != b[1] for a, b in itertools.pairwise(ranges)) or ranges[0][1] != 0:
            raise ValueError(f"{s.name}: owner ranges {list(ranges)} do not tile its {s.nbytes} bytes")
        for owner, lo, hi in ranges:
            if hi > lo:
                by_owner.setdefault(owner, []).append((s.name, lo, hi))
    packed = {o: _pack(ss, bucket_bytes) for o, ss in sorted(by_owner.items())}
    buckets, order = [], []
    for i in range(max((len(b) for b in packed.values()), default=0)):
        for o, bs in packed.items():
            if i < len(bs):
                buckets.append(bs[i])
                order.append(o)
    fp8 = dict(fp8 or {})
    tensors = {s.name: s for s in specs}
    for w, sc in fp8.items():
        if tensors.get(w) is None or tensors[w].dtype != "float8_e4m3fn" or len(tensors[w].shape) != 2 or \
                sc not in tensors or tensors[sc].dtype != "float32":
            raise ValueError(f"{w}: an FP8 weight needs a 2-D float8_e4m3fn tensor and a float32 scale grid {sc}")
    return BucketPlan(bucket_bytes=bucket_bytes, tensors=tensors, buckets=buckets, owners=order, fp8=fp8, block=block)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view sharing ``t``'s storage."""
    if not t.is_contiguous():
        raise ValueError("checkpoint engine tensors must be contiguous")
    return t.detach().reshape(-1).view(torch.uint8)
