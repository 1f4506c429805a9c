"""The owner's side of an FP8 update: block-quantise, bucket by bucket, the rows a worker holds.

A plan's FP8 tensors (``BucketPlan.fp8``: weight -> its ``_scale_inv`` grid) go on the wire as
e4m3 bytes plus float32 block scales, half the bytes of bf16. Each worker quantises the rows of
the trainer shard it holds, on the device that stages the bucket (the GPU on GPU: the source rows
are copied there first), and the receivers get exactly ``engines.model.native.fp8.quantize`` of the full
weight: every element depends only on itself and its block's scale, and a block's scale on the
block's largest |element|. A block whose rows two workers hold (an FSDP shard boundary inside a
block) is the one thing a worker cannot compute alone: ``prepare`` combines those partial maxima
with one all-reduce before the first bucket.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from checkpoint_engine.buckets import BucketPlan, Piece
from checkpoint_engine.wire import Wire
from engines.model.native.fp8 import FP8, block_amax, quantize_with, scales_from_amax


def holders(plan: BucketPlan, name: str) -> list[tuple[int, int, int]]:
    """(worker, first byte, end byte) of each run of tensor ``name`` that one worker sends."""
    runs = sorted((p.start, p.start + p.length, plan.owners[k]) for k, b in enumerate(plan.buckets)
                  for p in b if p.name == name)
    out: list[tuple[int, int, int]] = []
    for lo, hi, w in runs:
        if out and out[-1][0] == w and out[-1][2] == lo:
            out[-1] = (w, out[-1][1], hi)
        else:
            out.append((w, lo, hi))
    return out


def split_bands(plan: BucketPlan) -> list[tuple[str, int]]:
    """(FP8 weight, block row) of every block row whose rows more than one worker sends."""
    out = []
    for name in sorted(plan.fp8):
        band_rows = plan.block * plan.tensors[name].shape[1]  # bytes of one block row (FP8: a byte an element)
        for _, lo, _ in holders(plan, name)[1:]:
            if lo % band_rows:
                out.append((name, lo // band_rows))
    return sorted(set(out))


def scale_owners(weight_rows: list[tuple[int, int, int]], rows: int, cols: int, block: int
                 ) -> list[tuple[int, int, int]]:
    """Byte ranges of a scale grid per worker: each block row is sent by the worker holding its first
    row. ``weight_rows``: (worker, first row, end row) of the weight, in row order."""
    width = -(-cols // block) * 4
    out: list[tuple[int, int, int]] = []
    for band in range(-(-rows // block)):
        first = band * block
        w = next(w for w, lo, hi in weight_rows if lo <= first < hi)
        if out and out[-1][0] == w:
            out[-1] = (w, out[-1][1], (band + 1) * width)
        else:
            out.append((w, band * width, (band + 1) * width))
    return out


class OwnerQuantizer:
    """Scales and FP8 bytes of the FP8 pieces this worker stages, from ``tensors`` (its flat parts of
    each weight, ``offsets``: the element index of each part's first element)."""

    def __init__(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], offsets: Mapping[str, int],
                 device: torch.device) -> None:
        self.plan, self.tensors, self.offsets, self.device = plan, tensors, offsets, device
        self.weight_of = {s: w for w, s in plan.fp8.items()}
        self._scales: dict[tuple[str, int], torch.Tensor] = {}  # (weight, block row) -> its row of scales

    def handles(self, name: str) -> bool:
        """Whether this quantiser stages ``name`` (sources already in FP8, as a checkpoint's, are copied)."""
        if name in self.plan.fp8:
            return name in self.tensors and self.tensors[name].dtype != FP8
        return name in self.weight_of and name not in self.tensors

    def prepare(self) -> None:
        """Collective (every worker calls it): the scales of the blocks split between workers."""
        bands = split_bands(self.plan)
        if not bands:
            return
        widths = [-(-self.plan.tensors[w].shape[1] // self.plan.block) for w, _ in bands]
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        amax = torch.zeros(sum(widths), dtype=torch.float32, device=device)
        at = 0
        for (name, band), width in zip(bands, widths, strict=True):
            rows = self._local_rows(name, band * self.plan.block, (band + 1) * self.plan.block)
            if rows is not None and rows.numel():
                amax[at:at + width] = block_amax(rows.to(device), self.plan.block)[0]
            at += width
        Wire(device).all_reduce(amax, dist.ReduceOp.MAX)
        at = 0
        for key, width in zip(bands, widths, strict=True):
            self._scales[key] = scales_from_amax(amax[at:at + width])
            at += width

    def stage(self, piece: Piece, dst: torch.Tensor) -> None:
        """Write ``piece`` (bytes of an FP8 weight or of its scale grid) into ``dst``."""
        if piece.name in self.plan.fp8:
            self._stage_weight(piece, dst)
        else:
            self._stage_scales(piece, dst)

    def _stage_weight(self, piece: Piece, dst: torch.Tensor) -> None:
        name, block = piece.name, self.plan.block
        cols = self.plan.tensors[name].shape[1]
        r0, r1 = piece.start // cols, -(-(piece.start + piece.length) // cols)
        rows = self._local_rows(name, r0, r1)
        if rows is None or rows.shape[0] != r1 - r0:
            raise KeyError(f"{name}: rows {r0}..{r1} are not all held by this worker")
        rows = rows.to(dst.device, non_blocking=True)
        b0 = r0 // block
        scales = torch.stack([self._band(name, b) for b in range(b0, -(-r1 // block))]).to(dst.device)
        q = quantize_with(rows, scales, block, top=r0 - b0 * block).reshape(-1)
        skip = piece.start - r0 * cols
        dst.copy_(q[skip:skip + piece.length].view(torch.uint8))

    def _stage_scales(self, piece: Piece, dst: torch.Tensor) -> None:
        weight = self.weight_of[piece.name]
        width = self.plan.tensors[piece.name].shape[1]
        s0, s1 = piece.start // 4, (piece.start + piece.length) // 4
        bands = torch.cat([self._band(weight, b) for b in range(s0 // width, -(-s1 // width))])
        skip = s0 - (s0 // width) * width
        dst.view(torch.float32).copy_(bands[skip:skip + s1 - s0])

    def _band(self, name: str, band: int) -> torch.Tensor:
        """The scales of block row ``band`` of weight ``name`` (all its rows are this worker's, or it was
        combined by ``prepare``)."""
        key = (name, band)
        if key not in self._scales:
            block, rows_total = self.plan.block, self.plan.tensors[name].shape[0]
            lo, hi = band * block, min((band + 1) * block, rows_total)
            rows = self._local_rows(name, lo, hi)
            if rows is None or rows.shape[0] != hi - lo:
                raise KeyError(f"{name}: block row {band} is split between workers but was not combined")
            device = self.device if self.device.type == "cuda" else torch.device("cpu")
            self._scales[key] = scales_from_amax(block_amax(rows.to(device, non_blocking=True), block)[0])
        return self._scales[key]

    def _local_rows(self, name: str, lo: int, hi: int) -> torch.Tensor | None:
        """Rows [lo, hi) of weight ``name`` that this worker holds, as [n, cols] (None: holds none)."""
        if name not in self.tensors:
            return None
        cols = self.plan.tensors[name].shape[1]
        flat, first = self.tensors[name].reshape(-1), self.offsets.get(name, 0)
        if first % cols or flat.numel() % cols:
            raise ValueError(f"{name}: FP8 quantisation needs whole rows, this worker holds elements "
                             f"{first}..{first + flat.numel()} of rows of {cols}")
        r0 = first // cols
        a, b = max(lo, r0), min(hi, r0 + flat.numel() // cols)
        if a >= b:
            return None
        return flat[(a - r0) * cols:(b - r0) * cols].view(b - a, cols)
