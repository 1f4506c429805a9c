"""The inference side of a weight update: map the IPC buffers, verify each bucket, hand it to the replica's sink.

The receiver lives in the inference engine's process. It maps the checkpoint engine's IPC buffers without a copy
(POSIX shared memory on CPU, CUDA IPC handles on GPU), checks each bucket's trailer (update version, bucket index,
checksum), hands the verified bucket to the replica's sink (``checkpoint_engine.sinks``: the bytes into the engine's
tensors through its placements or a load hook, a stream into vLLM's running load, views of the buffer itself, or
LoRA adapters served on a kept base) and owns the version of the weights the replica serves. A bucket that fails
verification, or a sink that fails, rolls the update back: the sink brings the previous weights back (a spare copy
swapped in at the commit, or a host journal of the overwritten bytes, written on a side stream one bucket ahead on
a GPU), or, for a sink that keeps nothing, the replica refuses to serve until a complete update arrives.

A live receiver also packs its weights into a bucket (``pack``): that is how a restarted replica
catches up from it, point to point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from checkpoint_engine.buckets import BucketPlan, Piece, spec_of
from checkpoint_engine.trailer import ABORT, checksum, read_trailer, write_trailer
from engines.device import cuda_handle, device_uuid, local_device, remap_device  # noqa: F401 (re-exported)
from engines.device import map_ipc as device_map_ipc


class PlanMismatchError(ValueError):
    """The sender's tensors do not match what the inference engine holds."""


class CorruptUpdateError(RuntimeError):
    """A bucket failed verification: a stale, aborted or damaged bucket was found."""


#: load_hook(piece) -> [(dst, lo, hi)]: bytes [lo, hi) of the piece go to byte ``dst`` of its tensor.
LoadHook = Callable[[Piece], list[tuple[int, int, int]]]

#: plan tensor name -> (engine tensor, byte offset): where an engine whose layout differs from the
#: sender's (fused q/k/v, stacked experts) keeps each tensor of the plan, as one contiguous run of bytes.
Placements = Mapping[str, tuple[str, int]]

#: How a receiver keeps the previous weights until an update is complete.
#: "swap": load into a second host copy and swap at commit (no extra copy; CPU engines);
#: "journal": save the bytes about to be overwritten in host memory (device engines);
#: "none": nothing kept; a failed update leaves the engine marked inconsistent.
ROLLBACK_MODES = ("swap", "journal", "none")


class WeightStream(Protocol):
    """An engine that takes an update as it arrives: ``begin``, one ``feed`` per bucket (the tensors the
    bucket completed, host tensors it may keep until the update ends), then ``commit`` or ``abort``."""

    def begin(self, version: int) -> None: ...

    def feed(self, version: int, bucket: int, tensors: dict[str, torch.Tensor]) -> None: ...

    def commit(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Serve ``tensors`` (every weight, the update's) from now on."""

    def abort(self) -> None:
        """Drop the update in progress; serve the weights served before it."""


class ViewStream(WeightStream, Protocol):
    """A stream that loads each bucket where it lies: ``feed_views(version, bucket, buffer, pieces, check)`` with
    ``pieces`` as (name, start, length, offset, shape, dtype) and ``check`` the bucket's (used bytes, checksum);
    returns once nothing reads the buffer any more."""

    def feed_views(self, version: int, bucket: int, buffer: int, pieces: list, check: tuple[int, int]) -> None: ...


def map_ipc(handle) -> tuple[torch.Tensor, object]:
    """Map one IPC buffer from ``CheckpointEngine.ipc_handles()``; returns (tensor, keep-alive)."""
    t = device_map_ipc(handle)
    return t, t


def check_plan(targets: dict[str, torch.Tensor], plan: BucketPlan, placements: Placements | None = None) -> None:
    """An unsharded engine must hold exactly the plan's tensors, with the same dtypes and shapes (or,
    through ``placements``, as runs of bytes that tile each of its tensors exactly once)."""
    placements = placements or {}
    runs: dict[str, list[tuple[int, int, str]]] = {}
    for name, spec in plan.tensors.items():
        target, offset = placements.get(name, (name, 0))
        if target not in targets:
            raise PlanMismatchError(f"inference engine has no tensor {target}" + (f" (for {name})" if target != name
                                                                                  else ""))
        t = targets[target]
        have = spec_of(name, t)
        if target == name and have != spec:
            raise PlanMismatchError(f"{name}: sender has {spec}, inference engine has {have}")
        if have.dtype != spec.dtype or offset + spec.nbytes > have.nbytes:
            raise PlanMismatchError(f"{name}: sender has {spec}, inference engine holds it at byte {offset} of "
                                    f"{target} {have}")
        runs.setdefault(target, []).append((offset, offset + spec.nbytes, name))
    for target, rs in runs.items():
        rs.sort()
        end = 0
        for lo, hi, name in rs:
            if lo != end:
                raise PlanMismatchError(f"{target}: bytes {end}..{lo} are not covered by the update" if lo > end else
                                        f"{target}: {name} overlaps another tensor of the update")
            end = hi
        if end != targets[target].numel() * targets[target].element_size():
            raise PlanMismatchError(f"{target}: the update covers {end} of its "
                                    f"{targets[target].numel() * targets[target].element_size()} bytes")
    missing = sorted(set(targets) - set(runs))
    if missing:
        raise PlanMismatchError(f"update does not cover inference tensors {missing[:5]}")


class WeightReceiver:
    """Verifies the buckets arriving in the IPC buffers and hands each to the replica's sink
    (``checkpoint_engine.sinks``: where the bytes go, how the previous weights are kept); owns the version of the
    weights the replica serves (``version``: the last complete update) and packs what the sink serves for a
    restarted peer (``pack``)."""

    def __init__(self, plan: BucketPlan, handles: list, sink) -> None:
        self.sink = sink
        self._loading: tuple[int, set[int]] | None = None
        self.set_plan(plan)
        mapped = [map_ipc(h) for h in handles]
        self.buffers = [m[0] for m in mapped]
        self._keep = [m[1] for m in mapped]
        self.version: int | None = None   # last complete update
        #: a sink that loads into a spare copy (``stages``) keeps a complete update there until ``commit_staged``,
        #: so the engine can serve the previous weights while an update arrives
        self.defer_commit = False
        self.staged: int | None = None    # the complete update waiting for commit_staged
        self.loads = 0                    # buckets applied, over the receiver's life

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the sink serves with (a ``TensorSink``'s tensors)."""
        return self.sink.tensors

    def set_plan(self, plan: BucketPlan, sink=None) -> None:
        """Load the buckets of another plan from now on (start-up reads the checkpoint's own layout), into another
        ``sink`` where given (a LoRA replica's start-up fills whole weights, its updates carry adapters)."""
        if self._loading is not None:
            raise RuntimeError("cannot change the plan in the middle of an update")
        sink = sink or self.sink
        sink.set_plan(plan)
        self.plan, self.sink = plan, sink

    @property
    def consistent(self) -> bool:
        """False while an update is partly applied (or, for a sink that keeps nothing, after one failed): the
        engine must not serve then. A sink that loads into a spare copy (``stages``) serves whole weights all along."""
        return (self._loading is None or self.sink.stages) and self.sink.intact

    @property
    def ready(self) -> bool:
        """Holds a complete set of weights that came through the engine."""
        return self.consistent and self.version is not None

    def load(self, bucket: int, buffer: int, version: int) -> None:
        """Verify bucket ``bucket`` of update ``version`` in IPC buffer ``buffer`` and apply it."""
        self.load_from(bucket, buffer, self.buffers[buffer], version)

    def load_from(self, bucket: int, buffer: int, src: torch.Tensor, version: int) -> None:
        """``load`` from ``src``, a buffer this receiver did not map at start (a point-to-point transport's)."""
        used = self.plan.used_bytes(bucket)
        got_version, got_bucket, got_sum = read_trailer(src, used)
        names = sorted({p.name for p in self.plan.buckets[bucket]})
        where = f"bucket {bucket} of update {version} (parameters {', '.join(names[:4])}) from worker " \
                f"{self.plan.owners[bucket]}"
        if got_bucket == ABORT:
            raise CorruptUpdateError(f"{where} was aborted by its owner")
        if (got_version, got_bucket) != (version, bucket):
            raise CorruptUpdateError(f"IPC buffer {buffer} holds bucket {got_bucket} of update {got_version}, "
                                     f"expected {where}")
        if checksum(src[:used]) != got_sum:
            raise CorruptUpdateError(f"{where} fails its checksum")
        if self._loading is None or self._loading[0] != version:
            self._begin(version)
        assert self._loading is not None
        self.sink.load(bucket, buffer, src, (used, got_sum), version)
        self.loads += 1
        self._loading[1].add(bucket)
        if len(self._loading[1]) == len(self.plan.buckets):
            if self.defer_commit and self.sink.stages:
                self.staged = version  # the engine serves the previous weights until commit_staged
            else:
                self._commit(version)

    def commit_staged(self, version: int) -> None:
        """Serve update ``version``, whose every bucket is loaded into the sink's spare copy (``defer_commit``)."""
        if self.staged != version:
            raise CorruptUpdateError(f"update {version} is not staged (staged: {self.staged})")
        self.staged = None
        self._commit(version)

    def pack(self, bucket: int, buffer: int) -> int:
        """Write bucket ``bucket`` of the weights this engine serves into IPC buffer ``buffer`` (as the
        checkpoint engine would have delivered it); returns their version."""
        if self.sink.cannot_pack:
            raise RuntimeError(self.sink.cannot_pack)
        if not self.ready:
            raise RuntimeError("this replica holds no complete update to send")
        assert self.version is not None
        buf = self.buffers[buffer]
        self.sink.pack(bucket, buf)
        write_trailer(buf, self.plan.used_bytes(bucket), self.version, bucket)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        return self.version

    def rollback(self) -> bool:
        """Undo a partly applied update; True if the previous weights are back in place."""
        self.staged = None
        if self._loading is None:
            return self.sink.intact
        ok = self.sink.rollback()
        if ok or self.sink.refills:  # else the engine stays half-updated: not consistent, and no update may start
            self._loading = None
        return ok

    def _begin(self, version: int) -> None:
        if self._loading is not None and not self.rollback() and not self.sink.refills:
            raise CorruptUpdateError(f"update {self._loading[0]} was left partly applied")
        self._loading = None
        self.sink.begin(version)
        self._loading = (version, set())

    def _commit(self, version: int) -> None:
        try:
            self.sink.commit(version)
        except BaseException:
            self.rollback()
            raise
        self.version, self._loading = version, None
        self.sink.serve()
