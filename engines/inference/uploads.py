"""Host values to the device without the host waiting for it.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then waits for the stream, so
every such call in a step is a sync (and one inside a CUDA graph capture is an error). These helpers
stage the values in pinned memory and copy them non-blocking; torch's pinned allocator keeps a staging
block until the copy that reads it has run, so the host may go on at once. (A tensor already on the
host goes the same way through ``engines.device.to_device``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (numbers, or equal-length rows of them) as a tensor on ``device``, copied non-blocking."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def upload_rows(vectors: Sequence[Sequence[int]], tables: Sequence[Sequence[Sequence[int]]], device: torch.device
                ) -> list[torch.Tensor]:
    """Integer lists (as 1-D tensors) and tables (rows of equal length, as 2-D tensors) on ``device``, in
    that order, through one ``upload``: one copy per step instead of one per list."""
    flat = [x for v in vectors for x in v] + [x for t in tables for row in t for x in row]
    parts = upload(flat, device).split([len(v) for v in vectors] + [sum(map(len, t)) for t in tables])
    shaped = [p.view(len(t), len(t[0]) if len(t) else 0) for p, t in zip(parts[len(vectors):], tables, strict=True)]
    return [*parts[: len(vectors)], *shaped]
