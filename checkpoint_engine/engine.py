"""The per-worker checkpoint engine: one H2D buffer, two IPC buffers, a two-stage pipeline.

For bucket k, owned by worker o (whose trainer shard holds those parameters):
  1. worker o copies the bucket's bytes from its parameters into its H2D buffer (synchronous);
  2. worker o broadcasts the H2D buffer into IPC buffer k mod 2 of every worker (torch.distributed:
     gloo on CPU, NCCL on GPU) while each local inference engine reloads bucket k−1 from the
     other IPC buffer.
On CPU there is no device: the H2D buffer is not allocated and stage 1 writes into the IPC buffer.
Each bucket carries a trailer (update version, bucket index, checksum) so the inference side can
refuse a corrupted or mismatched bucket. Extra memory is three buckets, whatever the model size.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from checkpoint_engine.buckets import ALIGN, BucketPlan, as_bytes
from checkpoint_engine.shm import SharedBuffer

TRAILER = ALIGN  # bytes after a bucket's data: int64 version, bucket index, checksum
ABORT = -1       # bucket index in a trailer whose owner failed to stage it


class UpdateError(RuntimeError):
    """A weight update failed; the message names the worker, the bucket and its parameters."""


def checksum(data: torch.Tensor) -> int:
    """Wrapping sum of the bytes as int64 words (data length is a multiple of ``ALIGN``)."""
    return int(data.view(torch.int64).sum())


def write_trailer(buf: torch.Tensor, used: int, version: int, bucket: int) -> None:
    buf[used : used + TRAILER].view(torch.int64)[:3] = torch.tensor([version, bucket, checksum(buf[:used])])


def read_trailer(buf: torch.Tensor, used: int) -> tuple[int, int, int]:
    v, b, c = buf[used : used + TRAILER].view(torch.int64)[:3].tolist()
    return v, b, c


class Reloader(Protocol):
    """How the engine tells its local inference engine to load a bucket, and waits for it."""

    def start(self, bucket: int, buffer: int, version: int) -> None: ...

    def wait(self, bucket: int) -> None: ...

    def abort(self, version: int) -> None:
        """The update failed: restore the previous weights (or mark the engine unusable)."""


class CheckpointEngine:
    """One per worker; all workers of all nodes form one torch.distributed group."""

    def __init__(self, rank: int, world: int, init_method: str, bucket_bytes: int, name: str,
                 device: str = "cpu", timeout_s: float = 120) -> None:
        self.rank, self.world, self.device = rank, world, torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        size = bucket_bytes + TRAILER
        # On CPU there is no device to copy to: the stage copy writes straight into the IPC buffer.
        self.h2d = torch.empty(size, dtype=torch.uint8, device=self.device) if self.device.type == "cuda" else None
        if self.device.type == "cpu":
            self._shm = [SharedBuffer.create(f"{name}-r{rank}-ipc{i}", size) for i in range(2)]
            self.ipc = [b.tensor for b in self._shm]
        else:  # device memory, shared with the inference process through CUDA IPC handles
            self._shm = []
            self.ipc = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def ipc_handles(self):
        """What the local inference engine needs to map the IPC buffers without a copy."""
        if self.device.type == "cpu":
            return [("shm", b.name, b.nbytes) for b in self._shm]
        from torch.multiprocessing.reductions import reduce_tensor

        return [("cuda", reduce_tensor(t)) for t in self.ipc]

    def update(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], version: int,
               reloader: Reloader | None = None, offsets: Mapping[str, int] | None = None) -> None:
        """Broadcast every bucket of ``plan`` to all workers; ``tensors`` are this worker's own.

        ``offsets`` gives, for a tensor this worker holds only a part of, the element offset of that
        part inside the full tensor (the plan's pieces address full tensors). A tensor whose dtype
        differs from the plan's is cast while it is staged (fp32 master weights to a bf16 replica).

        ``reloader`` is the local inference engine to load the buckets into; None when this
        worker's replica needs nothing (another worker's restarted replica is catching up).
        """
        try:
            self._pipeline(plan, tensors, version, reloader, offsets or {})
        except Exception:
            if reloader is not None:
                try:
                    reloader.abort(version)
                except Exception:
                    pass
            raise

    def _pipeline(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], version: int,
                  reloader: Reloader | None, offsets: Mapping[str, int]) -> None:
        n_buckets = len(plan.buckets)
        load_failure: tuple[int, Exception] | None = None
        for k, pieces in enumerate(plan.buckets):
            owner, used, buf = plan.owners[k], plan.used_bytes(k), k % 2
            if reloader is not None and k >= 2:
                try:
                    reloader.wait(k - 2)  # the inference engine is done with this IPC buffer
                except Exception as e:
                    load_failure, reloader = (k - 2, e), None
            dst = self.ipc[buf][: used + TRAILER]
            names = sorted({p.name for p in pieces})
            where = f"bucket {k}/{n_buckets} from worker {owner} (parameters {', '.join(names[:4])})"
            stage_failure: Exception | None = None
            try:
                if owner == self.rank:
                    src = dst if self.h2d is None else self.h2d[: used + TRAILER]
                    try:
                        self._stage(plan, pieces, tensors, offsets, src, used, version, k)
                    except Exception as e:
                        stage_failure = e
                        write_trailer(src, used, version, ABORT)
                    dist.broadcast(src, src=owner)
                    if src is not dst:
                        dst.copy_(src)
                else:
                    dist.broadcast(dst, src=owner)
            except Exception as e:
                raise UpdateError(f"worker {self.rank}: {where} failed: {e}") from e
            if stage_failure is not None:
                raise UpdateError(f"worker {self.rank} failed to stage {where}: "
                                  f"{type(stage_failure).__name__}: {stage_failure}") from stage_failure
            if read_trailer(dst, used)[1] == ABORT:  # every worker stops here, so the group stays usable
                raise UpdateError(f"worker {self.rank}: worker {owner} aborted {where}")
            if reloader is not None:
                if dst.is_cuda:  # the inference process reads the buffer on its own stream
                    torch.cuda.current_stream(dst.device).synchronize()
                reloader.start(k, buf, version)
        if reloader is not None:
            for k in range(max(0, n_buckets - 2), n_buckets):
                try:
                    reloader.wait(k)
                except Exception as e:
                    load_failure = (k, e)
                    break
        if load_failure is not None:
            k, e = load_failure
            raise UpdateError(f"worker {self.rank}: its inference engine failed to load bucket {k}: {e}") from e

    def _stage(self, plan: BucketPlan, pieces, tensors, offsets, into: torch.Tensor, used: int, version: int,
               bucket: int) -> None:
        """Stage 1: the synchronous copy of this worker's bucket into its H2D (on CPU: IPC) buffer.

        On GPU the source is the offloaded (pinned host) parameter, so each piece is one H2D copy.
        """
        for p in pieces:
            if p.name not in tensors:
                raise KeyError(f"worker {self.rank} holds no tensor {p.name}")
            src, wire = tensors[p.name], getattr(torch, plan.tensors[p.name].dtype)  # spec_of's names
            first = (p.start // wire.itemsize) - offsets.get(p.name, 0)
            dst = into[p.offset : p.offset + p.length]
            if src.dtype == wire:
                dst.copy_(as_bytes(src)[first * wire.itemsize : first * wire.itemsize + p.length])
            else:  # one cast per piece, as the tensor itself would be cast (round to nearest even)
                dst.view(wire).copy_(src.reshape(-1)[first : first + p.length // wire.itemsize])
        write_trailer(into, used, version, bucket)

    def close(self) -> None:
        for b in self._shm:
            b.close()
        if dist.is_initialized():
            dist.destroy_process_group()
