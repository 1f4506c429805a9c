"""The per-worker checkpoint engine: an H2D buffer, two IPC buffers, a two-stage pipeline.

For bucket k, owned by worker o (whose trainer shard holds those parameters):
  1. worker o copies the bucket's bytes from its parameters into its H2D buffer (synchronous),
     casting them to the replicas' dtype or quantising them to block FP8 on the way;
  2. the bucket reaches IPC buffer k mod 2 of every worker while each local inference engine
     reloads bucket k-1 from the other IPC buffer.
On GPU stage 2 is an NCCL broadcast over all workers. On CPU the workers of a node share their two
IPC buffers (``checkpoint_engine.topology``): the owner stages straight into the shared buffer, the
node's inference engines read it where it is, and only between nodes does a bucket travel, over
gloo, to one worker of each other node. Each bucket carries a trailer (update version, bucket
index, checksum) so the inference side can refuse a corrupted or mismatched bucket. Extra memory is
three buckets (on CPU: two per node), whatever the model size, and ``CAST_CHUNK`` on a GPU whose
trainer holds another dtype than the replicas (float32 masters cross as they are, the GPU casts them).
Every tensor given to torch.distributed goes through ``checkpoint_engine.wire``, on the engine's device.

A replica whose ranks load from their own GPU's copy of each bucket (a tensor-parallel vLLM replica: rank j
reads worker rank lead + j's IPC buffer, ``share_replica``) makes every rank of its worker wait for the replica's
load of bucket k-2 before bucket k is received into the buffer it read: a barrier of the worker's ranks after
the lead's wait. Without it a rank could receive bucket k (NCCL moves the bytes as soon as the ring lets it)
while the replica's rank on that GPU still reads bucket k-2 there.

A restarted replica catches up from one live replica, point to point (``serve_catch_up`` on the
live replica's worker, ``catch_up`` on the restarted one's): the live replica packs its weights
into its worker's IPC buffers bucket by bucket and they travel to the other worker alone, so the
other workers and replicas take no part and keep serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from checkpoint_engine.buckets import BucketPlan, as_bytes
from checkpoint_engine.quantize import OwnerQuantizer
from checkpoint_engine.topology import NodeBuffers
from checkpoint_engine.trailer import ABORT, TRAILER, read_trailer, write_trailer
from checkpoint_engine.wire import Wire

CAST_CHUNK = 64 << 20  # device bytes of host source staged at a time when a piece changes dtype on the way


class UpdateError(RuntimeError):
    """A weight update failed; the message names the worker, the bucket and its parameters."""


def copy_cast(dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """``dst.copy_(src)`` for flat tensors of different dtypes, with the cast done where ``scratch`` is.

    A copy that changes both device and dtype casts on the host into pageable memory, then copies
    synchronously; through ``scratch`` (bytes on ``dst``'s device) the source crosses as it is, a chunk
    at a time and asynchronously from pinned memory, and the device casts it. Stream order keeps a
    chunk's cast ahead of the next chunk's copy into the same scratch.
    """
    if scratch is None:
        dst.copy_(src)
        return
    per = scratch.numel() // src.element_size()
    for lo in range(0, src.numel(), per):
        n = min(per, src.numel() - lo)
        staged = scratch[: n * src.element_size()].view(src.dtype)
        staged.copy_(src[lo : lo + n], non_blocking=True)
        dst[lo : lo + n].copy_(staged)


def stage_bucket(plan: BucketPlan, pieces, tensors: Mapping[str, torch.Tensor], offsets: Mapping[str, int],
                 quant: OwnerQuantizer | None, into: torch.Tensor, used: int, version: int, bucket: int, rank: int,
                 scratch=None) -> None:
    """Copy rank ``rank``'s ``pieces`` of bucket ``bucket`` into ``into`` and write its trailer: cast to the plan's
    dtypes, or block-quantised by ``quant`` for its FP8 tensors.

    On GPU the source is the offloaded (pinned host) parameter, so each piece is one H2D copy; a piece whose dtype
    changes crosses in its own dtype and is cast on the device (``copy_cast`` through ``scratch()``'s buffer).
    """
    for p in pieces:
        dst = into[p.offset : p.offset + p.length]
        if quant is not None and quant.handles(p.name):
            quant.stage(p, dst)
            continue
        if p.name not in tensors:
            raise KeyError(f"worker {rank} holds no tensor {p.name}")
        src, wire = tensors[p.name], getattr(torch, plan.tensors[p.name].dtype)  # spec_of's names
        first = (p.start // wire.itemsize) - offsets.get(p.name, 0)
        if src.dtype == wire:
            dst.copy_(as_bytes(src)[first * wire.itemsize : first * wire.itemsize + p.length])
        else:  # one cast per piece, as the tensor itself would be cast (round to nearest even)
            piece = src.reshape(-1)[first : first + p.length // wire.itemsize]
            cross = piece.device != dst.device and scratch is not None
            copy_cast(dst.view(wire), piece, scratch() if cross else None)
    write_trailer(into, used, version, bucket)


class Reloader(Protocol):
    """How the engine tells its local inference engine to load a bucket, and waits for it."""

    def start(self, bucket: int, buffer: int, version: int) -> None: ...

    def wait(self, bucket: int) -> None: ...

    def abort(self, version: int) -> None:
        """The update failed: restore the previous weights (or mark the engine unusable)."""


class Packer(Protocol):
    """How a live inference engine writes bucket ``bucket`` of its weights into IPC buffer ``buffer``
    (trailer included); returns the version of the weights it holds."""

    def pack(self, bucket: int, buffer: int) -> int: ...


class Tap(Protocol):
    """Something of this worker's own that takes each bucket as it arrives (the trainer at start-up)."""

    def take(self, bucket: int, data: torch.Tensor) -> None: ...


class WeightTransport(Protocol):
    """How buckets travel from the trainer ranks to the replicas' receivers (``checkpoint_engine.transfer``), whose
    sinks (``checkpoint_engine.sinks``) put them where each engine serves them from. Implementations:
    ``CheckpointEngine`` (the colocated broadcast: every rank's shard into two IPC buffers per worker, each
    worker's replica loading bucket k-1 while bucket k arrives). A transport delivers a plan's buckets
    (``update``, collective over the ranks), fills a restarted replica from a live one point to point
    (``serve_catch_up``/``catch_up``), and names the buffers a receiver maps (``ipc_handles``)."""

    def ipc_handles(self) -> list: ...

    def update(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], version: int,
               reloader: Reloader | None = None, offsets: Mapping[str, int] | None = None,
               tap: Tap | None = None) -> None: ...

    def serve_catch_up(self, plan: BucketPlan, peer: int, packer: Packer) -> int: ...

    def catch_up(self, plan: BucketPlan, peer: int, reloader: Reloader) -> int: ...

    def close(self) -> None: ...


class CheckpointEngine:
    """The colocated broadcast ``WeightTransport``: one per worker; all workers of all nodes form one
    torch.distributed group.

    ``node`` names this worker's node (default: its host name); workers of one node share their IPC
    buffers on CPU.
    """

    def __init__(self, rank: int, world: int, init_method: str, bucket_bytes: int, name: str,
                 device: str = "cpu", timeout_s: float = 120, node: str | None = None) -> None:
        self.rank, self.world, self.device = rank, world, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            # the object collectives (model_plan, topology) stage their bytes on the current device
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.wire = Wire(self.device)  # every tensor given to torch.distributed goes through it
        self._cast_scratch: torch.Tensor | None = None
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        size = bucket_bytes + TRAILER
        self.replica_group = None  # the worker's ranks, when its replica reads every one's buffers (share_replica)
        self.nodes: NodeBuffers | None = None
        if self.device.type == "cpu":  # no device to copy to: the owner stages into the shared IPC buffer
            self.h2d = None
            self.nodes = NodeBuffers(rank, world, name, size, node)
            self.ipc = [b.tensor for b in self.nodes.buffers]
        else:  # device memory, shared with the inference process through CUDA IPC handles
            self.h2d = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.ipc = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def share_replica(self, ranks_per_worker: int) -> None:
        """The worker of ``ranks_per_worker`` consecutive ranks (this one's among them) has a replica that reads
        every rank's IPC buffers: they wait for its loads together from now on (see the module). Collective."""
        for lo in range(0, self.world, ranks_per_worker):
            ranks = list(range(lo, min(lo + ranks_per_worker, self.world)))
            group = dist.new_group(ranks, backend="gloo")  # every rank creates every group, in the same order
            if self.rank in ranks and len(ranks) > 1:
                self.replica_group = group

    def ipc_handles(self):
        """What the local inference engine needs to map the IPC buffers without a copy."""
        if self.nodes is not None:
            return [("shm", b.name, b.nbytes) for b in self.nodes.buffers]
        from checkpoint_engine.transfer import cuda_handle

        return [cuda_handle(t) for t in self.ipc]

    def update(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], version: int,
               reloader: Reloader | None = None, offsets: Mapping[str, int] | None = None,
               tap: Tap | None = None) -> None:
        """Deliver every bucket of ``plan`` to all workers; ``tensors`` are this worker's own.

        ``offsets`` gives, for a tensor this worker holds only a part of, the element offset of that
        part inside the full tensor (the plan's pieces address full tensors). A tensor whose dtype
        differs from the plan's is cast while it is staged (fp32 master weights to a bf16 replica) or,
        for the plan's FP8 tensors, block-quantised (``checkpoint_engine.quantize``).

        ``reloader`` is the local inference engine to load the buckets into; None when this worker's
        replica takes no part. ``tap`` also receives every bucket (the trainer's shards at start-up).
        """
        try:
            self._pipeline(plan, tensors, version, reloader, offsets or {}, tap)
        except Exception:
            if reloader is not None:
                try:
                    reloader.abort(version)
                except Exception:
                    pass
            raise

    def _pipeline(self, plan: BucketPlan, tensors: Mapping[str, torch.Tensor], version: int,
                  reloader: Reloader | None, offsets: Mapping[str, int], tap: Tap | None) -> None:
        n_buckets = len(plan.buckets)
        quant = OwnerQuantizer(plan, tensors, offsets, self.device) if plan.fp8 else None
        load_failure: tuple[int, Exception] | None = None
        shared = self.nodes is not None
        # every rank of a worker whose replica reads all their buffers waits with the lead (the same on each: all
        # pass a reloader, or none does), also after the lead stopped using a failed one
        together = self.replica_group is not None and reloader is not None and not shared
        if quant is not None:
            quant.prepare()  # collective: block scales of blocks whose rows two workers hold
        for k, pieces in enumerate(plan.buckets):
            owner, used, buf = plan.owners[k], plan.used_bytes(k), k % 2
            # the buffer this bucket goes to must be free: on CPU the node barrier of bucket k-1
            # followed every replica's bucket k-2; on GPU only this worker's replica reads it
            wait_for = k - 1 if shared else k - 2
            dst = self.ipc[buf][: used + TRAILER]
            names = sorted({p.name for p in pieces})
            where = f"bucket {k}/{n_buckets} from worker {owner} (parameters {', '.join(names[:4])})"
            stage_failure: Exception | None = None
            try:
                if reloader is not None and not shared and wait_for >= 0:
                    load_failure, reloader = self._wait(reloader, wait_for, load_failure)
                if together and wait_for >= 0:
                    dist.barrier(group=self.replica_group)  # the worker's replica is done with bucket k-2
                if owner == self.rank:
                    src = dst if self.h2d is None else self.h2d[: used + TRAILER]
                    try:
                        self._stage(plan, pieces, tensors, offsets, quant, src, used, version, k)
                    except Exception as e:
                        stage_failure = e
                        write_trailer(src, used, version, ABORT)
                    if src is not dst:
                        self.wire.broadcast(src, owner)
                        dst.copy_(src)
                    elif self.nodes is not None and self.nodes.multi_node:
                        self.wire.broadcast(dst, owner, self.nodes.rail_group(owner))
                elif not shared:
                    self.wire.broadcast(dst, owner)
                elif self.nodes.multi_node and self.rank in self.nodes.topology.rail(owner):
                    self.wire.broadcast(dst, owner, self.nodes.rail_group(owner))
                if shared:
                    if reloader is not None and wait_for >= 0:
                        load_failure, reloader = self._wait(reloader, wait_for, load_failure)
                    self.nodes.barrier()  # bucket k is in the node's buffer; k-1's loads are done
            except Exception as e:
                raise UpdateError(f"worker {self.rank}: {where} failed: {e}") from e
            if stage_failure is not None:
                raise UpdateError(f"worker {self.rank} failed to stage {where}: "
                                  f"{type(stage_failure).__name__}: {stage_failure}") from stage_failure
            if read_trailer(dst, used)[1] == ABORT:  # every worker stops here, so the group stays usable
                raise UpdateError(f"worker {self.rank}: worker {owner} aborted {where}")
            if tap is not None:
                tap.take(k, dst)
            if reloader is not None:
                if dst.is_cuda:  # the inference process reads the buffer on its own stream
                    torch.cuda.current_stream(dst.device).synchronize()
                reloader.start(k, buf, version)
        if reloader is not None:
            for k in range(max(0, n_buckets - 2), n_buckets):
                load_failure, reloader = self._wait(reloader, k, load_failure)
                if reloader is None:
                    break
        if shared and n_buckets:
            self.nodes.barrier()  # nobody reuses the buffers until every replica of the node is done
        if load_failure is not None:
            k, e = load_failure
            raise UpdateError(f"worker {self.rank}: its inference engine failed to load bucket {k}: {e}") from e

    @staticmethod
    def _wait(reloader: Reloader, k: int, failure):
        """Wait for the replica's load of bucket k; on its failure, remember it and stop using it."""
        try:
            reloader.wait(k)
        except Exception as e:
            return failure or (k, e), None
        return failure, reloader

    def _stage(self, plan: BucketPlan, pieces, tensors, offsets, quant: OwnerQuantizer | None, into: torch.Tensor,
               used: int, version: int, bucket: int) -> None:
        """Stage 1: the synchronous copy of this worker's bucket into its H2D (on CPU: IPC) buffer."""
        stage_bucket(plan, pieces, tensors, offsets, quant, into, used, version, bucket, self.rank, self._scratch)

    def _scratch(self) -> torch.Tensor:
        """The device buffer host sources cross in before a cast (allocated on first use, then kept)."""
        if self._cast_scratch is None:
            self._cast_scratch = torch.empty(CAST_CHUNK, dtype=torch.uint8, device=self.device)
        return self._cast_scratch

    # ---- peer-to-peer catch-up -----------------------------------------------------------------

    def serve_catch_up(self, plan: BucketPlan, peer: int, packer: Packer) -> int:
        """Send this worker's live replica's weights to worker ``peer``'s restarted replica, bucket by
        bucket (``peer`` calls ``catch_up``); no other worker takes part. Returns the version sent."""
        shared = self.nodes is not None and self.nodes.topology.shares_buffers(peer)
        n, sends, acked = len(plan.buckets), {}, 0
        for k in range(n):
            buf, used = k % 2, plan.used_bytes(k)
            dst = self.ipc[buf][: used + TRAILER]
            if k >= 2:  # the buffer is free once the peer has it (and, if shared, has loaded it)
                if shared:
                    acked = self._ack(peer, acked, k - 2)
                else:
                    sends.pop(k - 2).wait()
                    if dst.is_cuda:  # the packer writes from another process: the send must be done, not queued
                        torch.cuda.current_stream(dst.device).synchronize()
            try:
                version = packer.pack(k, buf)
            except Exception as e:
                version = -1
                write_trailer(dst, used, version, ABORT)
                failure = e
            else:
                failure = None
            if k == 0:
                self.wire.send(self.wire.word(version), peer)
            if shared:
                self.wire.send(self.wire.word(k), peer)
            else:
                sends[k] = self.wire.isend(dst, peer)
            if failure is not None:
                for s in sends.values():
                    s.wait()
                raise UpdateError(f"worker {self.rank}: its replica could not pack bucket {k}: {failure}") \
                    from failure
        for s in sends.values():
            s.wait()
        while shared and acked < n:
            acked = self._ack(peer, acked, n - 1)
        return version if n else -1

    def _ack(self, peer: int, acked: int, upto: int) -> int:
        """Receive the peer's acknowledgements (one per loaded bucket) up to bucket ``upto``."""
        got = self.wire.word()
        while acked <= upto:
            self.wire.recv(got, peer)
            acked += 1
        return acked

    def catch_up(self, plan: BucketPlan, peer: int, reloader: Reloader) -> int:
        """Fill this worker's restarted replica from worker ``peer``'s live one (``serve_catch_up``);
        returns the version it now holds."""
        shared = self.nodes is not None and self.nodes.topology.shares_buffers(peer)
        n = len(plan.buckets)
        head = self.wire.word()
        try:
            for k in range(n):
                buf, used = k % 2, plan.used_bytes(k)
                if k == 0:
                    self.wire.recv(head, peer)
                version = int(head[0])
                if shared:
                    self.wire.recv(self.wire.word(), peer)
                else:
                    if k >= 2:
                        reloader.wait(k - 2)
                    self.wire.recv(self.ipc[buf][: used + TRAILER], peer)
                if read_trailer(self.ipc[buf], used)[1] == ABORT:
                    raise UpdateError(f"worker {self.rank}: worker {peer}'s replica could not send bucket {k}")
                if self.ipc[buf].is_cuda:
                    torch.cuda.current_stream(self.ipc[buf].device).synchronize()
                reloader.start(k, buf, version)
                if shared:  # the peer packs k+1 into the other buffer meanwhile; it needs this one back
                    if k >= 1:
                        reloader.wait(k - 1)
                        self.wire.send(self.wire.word(k - 1), peer)
            for k in range(max(0, n - 2), n):
                reloader.wait(k)
            if shared and n:
                self.wire.send(self.wire.word(n - 1), peer)
        except Exception as e:
            try:
                reloader.abort(int(head[0]))
            except Exception:
                pass
            if isinstance(e, UpdateError):
                raise
            raise UpdateError(f"worker {self.rank}: catch-up from worker {peer} failed: {e}") from e
        return int(head[0])

    def close(self) -> None:
        """Free the buffers (collective: the node's leader removes them once every worker is done)."""
        if self.nodes is not None:
            try:
                self.nodes.barrier()
            except Exception:  # a worker died: nobody is left to wait for
                pass
            self.nodes.close()
        if dist.is_initialized():
            dist.destroy_process_group()
