"""Whole tensors out of the checkpoint engine's buckets, read where the buckets lie (an IPC buffer on this GPU).

A bucket holds pieces of tensors (``checkpoint_engine.buckets``): bytes [start, start + length) of a tensor at byte
``offset`` of the bucket. A tensor whose bytes are all in one bucket is handed out as a view of the buffer (no copy
at all); one split across buckets (a tensor larger than a bucket, or a trainer's FSDP shards, one bucket per rank)
is copied piece by piece into a tensor of its own on the buffer's device and handed out with its last piece. The
caller must be done with the views before it lets the sender reuse the buffer (a loader that keeps a tensor for
later takes ``own=True`` copies).

What is held between buckets is the split tensors still missing pieces: with FSDP shards interleaved by rank,
about one bucket per trainer rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: (name, start, length, offset, shape, dtype): one piece of a bucket, as ``Piece`` and ``TensorSpec`` give it
PieceRef = tuple[str, int, int, int, tuple[int, ...], str]


@dataclass
class _Partial:
    data: torch.Tensor  # the whole tensor's bytes, flat uint8
    have: int = 0       # bytes written so far


class BucketAssembler:
    """Turns each bucket's pieces into the whole tensors that bucket completes (see the module)."""

    def __init__(self) -> None:
        self.partial: dict[str, _Partial] = {}

    def take(self, buffer: torch.Tensor, pieces: list[PieceRef], own: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs bucket ``pieces`` completes, read from ``buffer`` (the bucket's first byte at 0):
        views of it unless ``own`` (then every tensor is a copy the caller may keep), in the pieces' order."""
        done = []
        for name, start, length, offset, shape, dtype in pieces:
            dt = getattr(torch, dtype)
            nbytes = dt.itemsize * _numel(shape)
            src = buffer[offset:offset + length]
            if start == 0 and length == nbytes:  # the whole tensor in this bucket
                t = src.view(dt).view(shape)
                done.append((name, t.clone() if own else t))
                continue
            part = self.partial.get(name)
            if part is None:
                part = self.partial[name] = _Partial(torch.empty(nbytes, dtype=torch.uint8, device=buffer.device))
            part.data[start:start + length].copy_(src)
            part.have += length
            if part.have == nbytes:
                del self.partial[name]
                done.append((name, part.data.view(dt).view(shape)))
        return done

    def held_bytes(self) -> int:
        """Bytes of the split tensors still missing pieces."""
        return sum(p.data.numel() for p in self.partial.values())

    def clear(self) -> None:
        """Forget every split tensor (an update that ended or was aborted)."""
        self.partial.clear()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
