"""Start-up: the checkpoint engine reads a safetensors checkpoint once, collectively.

Each worker reads only its share of the files (whole files, balanced by size) and the update
pipeline broadcasts it to every worker, so the checkpoint crosses the disk once however many
inference replicas start. Tensors are read one at a time, when their first bucket is staged,
so memory stays at one tensor plus the three buckets.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from checkpoint_engine.buckets import TensorSpec

_ST_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F64": ("float64", 8),
              "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
              "U8": ("uint8", 1), "BOOL": ("bool", 1)}


class CheckpointReadError(ValueError):
    """A checkpoint file is missing or not a safetensors file."""


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a Hugging Face model directory (or one file)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointReadError(f"no .safetensors files at {p}")
    return files


def read_index(files: list[Path]) -> dict[str, tuple[Path, TensorSpec]]:
    """Tensor name -> (file, spec), from the files' headers only (no tensor data is read)."""
    out: dict[str, tuple[Path, TensorSpec]] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise CheckpointReadError(f"{f}: not a readable safetensors file ({e})") from e
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise CheckpointReadError(f"{f}: tensor {name} has unsupported dtype {meta['dtype']}")
            dtype, size = _ST_DTYPES[meta["dtype"]]
            numel = 1
            for d in meta["shape"]:
                numel *= d
            out[name] = (f, TensorSpec(name, tuple(meta["shape"]), dtype, numel * size))
    return out


def assign_files(index: dict[str, tuple[Path, TensorSpec]], world: int) -> dict[Path, int]:
    """Give each file to one worker, largest first to the least loaded, so reads are balanced."""
    sizes: Counter[Path] = Counter()
    for f, spec in index.values():
        sizes[f] += spec.nbytes
    load = [0] * world
    owner: dict[Path, int] = {}
    for f, size in sorted(sizes.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        w = min(range(world), key=lambda i: load[i])
        owner[f] = w
        load[w] += size
    return owner


class SafetensorsShare(Mapping[str, torch.Tensor]):
    """This worker's tensors, read lazily from its files; ``reads`` counts tensor reads per file.

    A tensor larger than a bucket is staged from consecutive buckets, so the last tensor read is
    kept until another is asked for: every tensor is read from disk exactly once.
    """

    def __init__(self, index: dict[str, tuple[Path, TensorSpec]], files: list[Path]) -> None:
        mine = set(files)
        self.index = {n: f for n, (f, _) in index.items() if f in mine}
        self.reads: Counter[str] = Counter()
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        f = self.index[name]
        with safe_open(str(f), framework="pt") as fh:
            t = fh.get_tensor(name).contiguous()
        self.reads[f.name] += 1
        self._last = (name, t)
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)
