"""Model-like parameter sets for the local harness and the benchmark, and what replicas must hold.

A synthetic model is a list of ``TensorSpec`` (the trainer's tensors). Its values at update
version v are deterministic, so any process can compute what a replica must hold after update v,
including, for FP8 replicas, the reference block quantisation of every matrix.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_engine.buckets import BucketPlan, Ownership, Piece, TensorSpec, as_bytes, plan_buckets
from checkpoint_engine.quantize import scale_owners
from engines.model.native.fp8 import FP8, SCALE_SUFFIX, grid, quantize


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a ``TensorSpec`` names (``spec_of`` writes it without the "torch." prefix)."""
    return getattr(torch, name)


def synthetic_params(total_bytes: int, dtype: str = "bfloat16", width: int = 4096) -> list[TensorSpec]:
    """A model-like parameter set: [rows, width] matrices plus float32 norm vectors, ~total_bytes."""
    el, specs, used, i = dtype_of(dtype).itemsize, [], 0, 0
    while used < total_bytes:
        rows = max(1, min(width, (total_bytes - used) // (width * el)))
        specs.append(TensorSpec(f"layers.{i}.weight", (rows, width), dtype, rows * width * el))
        specs.append(TensorSpec(f"layers.{i}.norm", (width,), "float32", width * 4))
        used += rows * width * el + width * 4
        i += 1
    return specs


def make_tensor(spec: TensorSpec, version: int = 1, finite: bool = False) -> torch.Tensor:
    """Deterministic values of a parameter at a version: random bits (every bit pattern, NaNs
    included), or with ``finite`` normal values (what quantisation needs)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{spec.name}@{version}".encode()))
    if finite:
        return (torch.randn(spec.shape, generator=g) * 0.05).to(dtype_of(spec.dtype))
    t = torch.empty(spec.shape, dtype=dtype_of(spec.dtype))
    as_bytes(t).copy_(torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g))
    return t


def digest(t: torch.Tensor) -> str:
    """128-bit BLAKE2b of a host tensor's bytes (hashed in place: no copy, and the GIL is released)."""
    return hashlib.blake2b(as_bytes(t.contiguous()).numpy(), digest_size=16).hexdigest()


def fp8_specs(specs: list[TensorSpec], block: int) -> tuple[list[TensorSpec], dict[str, str]]:
    """The wire specs of an FP8 replica of ``specs``: each matrix as FP8 plus its scale grid."""
    out, pairs = [], {}
    for s in specs:
        if len(s.shape) != 2:
            out.append(s)
            continue
        g = grid(*s.shape, block)
        out.append(TensorSpec(s.name, s.shape, "float8_e4m3fn", s.shape[0] * s.shape[1]))
        out.append(TensorSpec(s.name + SCALE_SUFFIX, g, "float32", g[0] * g[1] * 4))
        pairs[s.name] = s.name + SCALE_SUFFIX
    return out, pairs


def row_split(rows: int, world: int) -> list[tuple[int, int, int]]:
    """(worker, first row, end row) under an FSDP2-style split of dim 0 (later workers may hold none)."""
    per = -(-rows // world)
    return [(w, min(rows, w * per), min(rows, (w + 1) * per)) for w in range(world)
            if min(rows, w * per) < min(rows, (w + 1) * per)]


@dataclass(frozen=True)
class SyntheticModel:
    """A synthetic trainer (``specs``) over ``world`` workers and the plan its replicas get.

    Workers hold whole tensors round-robin, or with ``split_rows`` each matrix's rows split across
    all workers (as FSDP2 shards them). ``fp8``: replicas hold block-FP8 matrices (blocks of ``block``).
    """

    specs: tuple[TensorSpec, ...]
    world: int
    split_rows: bool = False
    fp8: bool = False
    block: int = 128

    @property
    def finite(self) -> bool:
        return self.fp8

    def rows_of(self, s: TensorSpec) -> list[tuple[int, int, int]]:
        i = self.specs.index(s)
        if self.split_rows and len(s.shape) == 2:
            return row_split(s.shape[0], self.world)
        return [(i % self.world, 0, s.shape[0])]

    def plan(self, bucket_bytes: int) -> BucketPlan:
        wire, pairs = fp8_specs(list(self.specs), self.block) if self.fp8 else (list(self.specs), {})
        owners: dict[str, Ownership] = {}
        for s in self.specs:
            per_row = s.nbytes // s.shape[0] if self.split_rows and len(s.shape) == 2 else None
            rows = self.rows_of(s)
            if per_row is None:
                owners[s.name] = rows[0][0]
            else:
                wire_row = s.shape[1] if s.name in pairs else per_row
                owners[s.name] = [(w, lo * wire_row, hi * wire_row) for w, lo, hi in rows]
            if s.name in pairs:
                owners[pairs[s.name]] = scale_owners(rows, s.shape[0], s.shape[1], self.block)
        return plan_buckets(wire, bucket_bytes, owners, pairs, self.block)

    def sources(self, rank: int, version: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """This worker's tensors at ``version`` (flat row ranges when split) and their first elements."""
        tensors, offsets = {}, {}
        for s in self.specs:
            for w, lo, hi in self.rows_of(s):
                if w != rank:
                    continue
                full = make_tensor(s, version, self.finite)
                if len(s.shape) == 2:
                    tensors[s.name] = full[lo:hi].reshape(-1)
                    offsets[s.name] = lo * s.shape[1]
                else:
                    tensors[s.name] = full
        return tensors, offsets

    def reference(self, version: int) -> dict[str, torch.Tensor]:
        """What a whole replica holds after update ``version`` (0: never updated, zeros), by plan name."""
        out = {}
        for s in self.specs:
            if version == 0:
                t = torch.zeros(s.shape, dtype=dtype_of(s.dtype))
                if self.fp8 and len(s.shape) == 2:
                    out[s.name] = t.to(FP8)
                    out[s.name + SCALE_SUFFIX] = torch.zeros(grid(*s.shape, self.block))
                    continue
                out[s.name] = t
            elif self.fp8 and len(s.shape) == 2:
                out[s.name], out[s.name + SCALE_SUFFIX] = quantize(make_tensor(s, version, True), self.block)
            else:
                out[s.name] = make_tensor(s, version, self.finite)
        return out


@dataclass(frozen=True)
class Sharding:
    """Which rows of each 2-D parameter an inference engine keeps (tensor parallel on dim 0)."""

    rank: int = 0
    size: int = 1

    def rows(self, n: int) -> tuple[int, int]:
        per = -(-n // self.size)
        return min(n, self.rank * per), min(n, (self.rank + 1) * per)


class ShardedWeights:
    """An inference engine's weights under a sharding, and the per-parameter load hook into them."""

    def __init__(self, specs: list[TensorSpec], sharding: Sharding) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.ranges: dict[str, tuple[int, int]] = {}
        for s in specs:
            two_d = len(s.shape) == 2
            row_bytes = dtype_of(s.dtype).itemsize * (s.shape[1] if two_d else 1)
            lo, hi = sharding.rows(s.shape[0]) if two_d else (0, s.shape[0])
            shape = (hi - lo, s.shape[1]) if two_d else s.shape
            self.tensors[s.name] = torch.zeros(shape, dtype=dtype_of(s.dtype))
            self.ranges[s.name] = (lo * row_bytes, hi * row_bytes)

    def hook(self, piece: Piece) -> list[tuple[int, int, int]]:
        """Bytes of ``piece`` inside this shard: (offset in the shard, lo, hi) in the piece."""
        lo, hi = self.ranges[piece.name]
        a, b = max(lo, piece.start), min(hi, piece.start + piece.length)
        return [(a - lo, a - piece.start, b - piece.start)] if a < b else []

    def rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


def shard_digests(full: dict[str, torch.Tensor], sharding: Sharding) -> dict[str, str]:
    """Digests of what an inference engine with ``sharding`` holds of the tensors ``full``."""
    return {n: digest(t[slice(*sharding.rows(t.shape[0]))] if t.ndim == 2 else t) for n, t in full.items()}


def expected_digests(specs: list[TensorSpec], sharding: Sharding, version: int) -> dict[str, str]:
    """What an inference engine with ``sharding`` must hold after update ``version`` (0: zeros)."""
    return shard_digests(SyntheticModel(tuple(specs), 1).reference(version), sharding)


def save_checkpoint(specs: list[TensorSpec], version: int, directory: str | Path, files: int, fp8: bool = False,
                    block: int = 128) -> list[Path]:
    """Write the parameters at ``version`` as ``files`` safetensors shards (a model directory); with
    ``fp8`` every matrix as block-FP8 with its ``_scale_inv`` grid, as DeepSeek-V3 and Kimi K2 ship."""
    from safetensors.torch import save_file

    ref = SyntheticModel(tuple(specs), 1, fp8=fp8, block=block).reference(version)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        part = {}
        for s in specs[i::files]:
            part[s.name] = ref[s.name]
            if s.name + SCALE_SUFFIX in ref:
                part[s.name + SCALE_SUFFIX] = ref[s.name + SCALE_SUFFIX]
        paths.append(d / f"model-{i + 1:05d}-of-{files:05d}.safetensors")
        save_file(part, str(paths[-1]))
    return paths
