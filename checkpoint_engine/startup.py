"""Start-up: the checkpoint engine reads a safetensors checkpoint once, collectively.

Each worker reads only its share of the files (whole files, balanced by size) and the update
pipeline delivers it to every worker, so the checkpoint crosses the disk once however many
inference replicas start. Tensors are read one at a time, when their first bucket is staged,
so memory stays at one tensor plus the three buckets. The same buckets also fill each worker's
trainer shard (``ShardTap``): a cluster reads its model once, not once per process.

Block-FP8 checkpoints (DeepSeek-V3, Kimi K2: ``F8_E4M3`` matrices with float32 ``_scale_inv``
grids) travel as they are stored: an FP8 replica takes the bytes, a trainer dequantises its rows.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from checkpoint_engine.buckets import BucketPlan, TensorSpec, plan_buckets
from engines.model.native.fp8 import BLOCK, FP8, SCALE_SUFFIX, dequantize, grid

_ST_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F64": ("float64", 8),
              "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
              "U8": ("uint8", 1), "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1)}


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


def plan_startup(path: str | Path, world: int, bucket_bytes: int, names: set[str] | None = None,
                 block: int = BLOCK) -> tuple[BucketPlan, dict[Path, int], dict[str, tuple[Path, TensorSpec]]]:
    """The start-up plan of the checkpoint at ``path`` over ``world`` workers: each file's tensors are
    sent by the worker that reads the file. ``names``: the tensors to send (a model's; the FP8 scale
    grids of those come along), default all; ``block``: the FP8 block size (config.json's
    ``quantization_config``). Returns (plan, file -> worker, the index)."""
    index = read_index(checkpoint_files(path))
    if names is not None:
        missing = sorted(n for n in names if n not in index)
        if missing:
            raise CheckpointReadError(f"{path}: missing tensors {missing[:5]} ({len(missing)} in all)")
        keep = set(names) | {n + SCALE_SUFFIX for n in names if n + SCALE_SUFFIX in index}
        index = {n: v for n, v in index.items() if n in keep}
    fp8 = {n: n + SCALE_SUFFIX for n, (_, spec) in index.items() if spec.dtype == "float8_e4m3fn"}
    for n, sc in fp8.items():
        if sc not in index:
            raise CheckpointReadError(f"{index[n][0]}: FP8 tensor {n} has no {sc} to dequantise it with")
        if len(index[n][1].shape) != 2 or index[sc][1].shape != grid(*index[n][1].shape, block):
            raise CheckpointReadError(f"{index[sc][0]}: {sc} has shape {index[sc][1].shape}, not the grid of "
                                      f"{block}x{block} blocks of {n} {index[n][1].shape}")
    owner = assign_files(index, world)
    owners = {n: owner[f] for n, (f, _) in index.items()}
    plan = plan_buckets([spec for _, spec in index.values()], bucket_bytes, owners, fp8, block)
    return plan, owner, index


class ShardTap:
    """Fills a worker's own part of each tensor (a trainer shard) from the buckets as they pass.

    ``tensors``: per plan tensor, this worker's elements of it as a flat writable tensor in its own
    dtype (views of the trainer's storage); ``offsets``: the index of each one's first element in the
    full tensor. Values are cast; FP8 ones are kept raw until ``finish`` dequantises them with their
    block scales, which may arrive in a later bucket.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], offsets: dict[str, int]) -> None:
        self.tensors, self.offsets = tensors, offsets
        self._raw: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}
        self._plan: BucketPlan | None = None

    def take(self, bucket: int, data: torch.Tensor) -> None:
        """Copy what bucket ``bucket`` (bytes ``data``) holds of this worker's part."""
        plan = self._plan
        assert plan is not None, "ShardTap.bind(plan) first"
        scale_of = set(plan.fp8.values())
        for p in plan.buckets[bucket]:
            wire = getattr(torch, plan.tensors[p.name].dtype)
            piece = data[p.offset:p.offset + p.length]
            if p.name in scale_of:  # small: every worker keeps whole grids
                if p.name not in self._scales:
                    self._scales[p.name] = torch.zeros(plan.tensors[p.name].nbytes, dtype=torch.uint8)
                self._scales[p.name][p.start:p.start + p.length].copy_(piece)
                continue
            if p.name not in self.tensors:
                continue
            mine, first = self.tensors[p.name], self.offsets.get(p.name, 0)
            e0, e1 = p.start // wire.itemsize, (p.start + p.length) // wire.itemsize
            a, b = max(e0, first), min(e1, first + mine.numel())
            if a >= b:
                continue
            values = piece.view(wire)[a - e0:b - e0]
            if wire == FP8 and mine.dtype != FP8:
                if p.name not in self._raw:
                    self._raw[p.name] = torch.zeros(mine.numel(), dtype=FP8)
                self._raw[p.name][a - first:b - first] = values
            else:
                mine[a - first:b - first] = values

    def bind(self, plan: BucketPlan) -> ShardTap:
        """The plan whose buckets ``take`` will be given."""
        self._plan = plan
        return self

    def finish(self) -> None:
        """Dequantise the FP8 tensors received (their scales have all arrived by now)."""
        plan = self._plan
        assert plan is not None
        for name, raw in self._raw.items():
            cols = plan.tensors[name].shape[1]
            scale_grid = self._scales[plan.fp8[name]].view(torch.float32).view(plan.tensors[plan.fp8[name]].shape)
            first_row = self.offsets.get(name, 0) // cols
            n = raw.numel() // cols
            b0 = first_row // plan.block
            mine = self.tensors[name]
            mine.copy_(dequantize(raw.view(n, cols), scale_grid[b0:-(-(first_row + n) // plan.block)], plan.block,
                                  mine.dtype, top=first_row - b0 * plan.block).reshape(-1))
        self._raw.clear()
