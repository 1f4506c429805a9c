"""The trailer each bucket carries after its data: the update's version, the bucket's index and a checksum.

The sending side writes it as the bucket lands in an IPC buffer; the receiving side reads it before loading, so a
bucket of another update, of another index, aborted by its owner (``ABORT``) or corrupted on the way is refused.
"""

from __future__ import annotations

import torch

from checkpoint_engine.buckets import ALIGN

TRAILER = ALIGN  # bytes after a bucket's data: int64 version, bucket index, checksum
ABORT = -1       # bucket index in a trailer whose owner failed to stage it


def checksum(data: torch.Tensor) -> int:
    """Wrapping sum of the bytes as int64 words (data length is a multiple of ``ALIGN``)."""
    return int(data.view(torch.int64).sum())


def write_trailer(buf: torch.Tensor, used: int, version: int, bucket: int) -> None:
    """Write the trailer of the ``used`` bytes at the start of ``buf`` (a bucket of update ``version``)."""
    words = torch.tensor([version, bucket, checksum(buf[:used])], dtype=torch.int64, device=buf.device)
    buf[used : used + TRAILER].view(torch.int64)[:3] = words


def read_trailer(buf: torch.Tensor, used: int) -> tuple[int, int, int]:
    """(version, bucket, checksum) of the bucket of ``used`` bytes at the start of ``buf``."""
    v, b, c = buf[used : used + TRAILER].view(torch.int64)[:3].tolist()
    return v, b, c
