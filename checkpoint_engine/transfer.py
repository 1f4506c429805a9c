"""The inference side of a weight update: map the IPC buffers, verify and load buckets.

The receiver lives in the inference engine's process. It maps the checkpoint engine's IPC
buffers without a copy (POSIX shared memory on CPU, CUDA IPC handles on GPU), checks each
bucket's trailer (update version, bucket index, checksum) and copies each piece to where the
engine's per-parameter load hook says it goes, so a sharded engine takes only its shard.

Before a byte of the engine's weights is overwritten, its old value is saved in a host-memory
journal; if the update fails midway the journal is written back, so the engine keeps serving
the previous weights instead of a half-updated model. On GPU the journal copies run on a side
stream, one bucket ahead: bucket k+1's old bytes go to host memory while bucket k+1 is still
travelling, and loading it only waits for that copy.

An engine that cannot be written byte by byte (vLLM re-packs its weights for its kernels) takes the
update as a stream instead (``WeightStream``): the receiver loads each bucket into its host copy and
hands the engine the tensors that bucket completed, before it acknowledges the bucket. Or, with ``views``,
the receiver copies nothing: it verifies each bucket and tells the engine where the bucket's tensors lie in
the IPC buffer (``ViewStream.feed_views``), and the engine loads them from there (vLLM's workers, each from its
own GPU's buffer); nothing of the previous weights is kept, so a failed update leaves the engine without weights
(``consistent`` stays false) until a complete one arrives.

A live receiver also packs its weights into a bucket (``pack``): that is how a restarted replica
catches up from it, point to point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Protocol

import torch

from checkpoint_engine.buckets import BucketPlan, Piece, as_bytes, spec_of
from checkpoint_engine.trailer import ABORT, checksum, read_trailer, write_trailer
from engines.device import cuda_handle, device_uuid, host_buffer, local_device, remap_device  # noqa: F401 (re-exported)
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


def _full_tensor(piece: Piece) -> list[tuple[int, int, int]]:
    return [(piece.start, 0, piece.length)]


class WeightReceiver:
    """Loads buckets from the IPC buffers into the inference engine's tensors.

    ``load_hook`` maps a piece to byte ranges of the engine's own (possibly sharded) tensor; None
    means the engine holds every tensor whole. ``placements`` says where a plan tensor lives in an
    engine with another layout. ``on_commit`` receives the tensors to serve with after a complete
    update (in "swap" mode they are new objects the engine must rebind to). ``stream`` also receives the
    update bucket by bucket (``WeightStream``); with it the tensors must be held whole (no hook, no
    placements) and a rollback ends with ``stream.abort()``. ``views``: the stream loads each bucket from the
    IPC buffer itself (``ViewStream``); ``tensors`` then only describe what it holds (meta tensors will do),
    nothing is written or kept here and the rollback mode is "none".
    """

    def __init__(self, plan: BucketPlan, handles: list, tensors: dict[str, torch.Tensor],
                 load_hook: LoadHook | None = None, rollback: str | None = None,
                 on_commit: Callable[[dict[str, torch.Tensor]], None] | None = None,
                 placements: Placements | None = None, stream: WeightStream | None = None,
                 views: bool = False) -> None:
        moved = any(n != t or o for n, (t, o) in (placements or {}).items())
        if stream is not None and (load_hook is not None or moved):
            raise ValueError("a weight stream takes whole tensors under the plan's names: no load hook or placements")
        if views and (stream is None or rollback not in (None, "none")):
            raise ValueError("views need a stream that loads from the IPC buffer, and keep nothing to roll back to")
        self.stream, self.views = stream, views
        self._empty = False  # views: an update failed midway and the engine holds no complete weights
        if views:
            rollback = "none"
        self.placements = dict(placements or {})
        self.load_hook = load_hook or _full_tensor
        if rollback is None:
            rollback = "journal" if any(t.is_cuda for t in tensors.values()) else "swap"
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {rollback!r}")
        self.rollback_mode, self.on_commit = rollback, on_commit
        self.tensors = tensors            # what the engine serves with
        self._hooked = load_hook is not None
        self.set_plan(plan)
        self._shadow: dict[str, torch.Tensor] | None = None
        mapped = [map_ipc(h) for h in handles]
        self.buffers = [m[0] for m in mapped]
        self._keep = [m[1] for m in mapped]
        self.version: int | None = None   # last complete update
        self.loads = 0                    # buckets applied, over the receiver's life
        self._loading: tuple[int, set[int]] | None = None
        self._written: dict[str, int] = {}
        self._dest: dict[str, torch.Tensor] = {}
        self._into: dict[str, torch.Tensor] = {}  # the typed tensors behind _dest
        self._journal_buf: torch.Tensor | None = None
        self._journal: dict[int, list[tuple[torch.Tensor, int, int]]] = {}  # bucket -> (destination, at, bytes)
        self._journal_used = 0
        cuda = any(t.is_cuda for t in tensors.values())
        self._side = torch.cuda.Stream() if cuda and rollback == "journal" else None
        self._into = self.tensors
        self._ready: dict[int, object] = {}  # bucket -> event: its journal copy is done (side stream)

    def set_plan(self, plan: BucketPlan) -> None:
        """Load the buckets of another plan from now on (start-up reads the checkpoint's own layout)."""
        if getattr(self, "_loading", None) is not None:
            raise RuntimeError("cannot change the plan in the middle of an update")
        if not self._hooked:
            check_plan(self.tensors, plan, self.placements)
        self.plan = plan

    @property
    def consistent(self) -> bool:
        """False while an update is partly applied (or, with ``views``, after one failed): the engine must not
        serve then."""
        return self._loading is None and not self._empty

    @property
    def ready(self) -> bool:
        """Holds a complete set of weights that came through the engine."""
        return self.consistent and self.version is not None

    def _targets(self, bucket: int, dest: dict[str, torch.Tensor]):
        """(bytes of the engine's tensor, bytes of the bucket) for every run of bucket ``bucket``."""
        for p in self.plan.buckets[bucket]:
            target, base = self.placements.get(p.name, (p.name, 0))
            raw = dest[target]
            for at, lo, hi in self.load_hook(p):
                yield target, raw[base + at : base + at + hi - lo], p.offset + lo, p.offset + hi

    def load(self, bucket: int, buffer: int, version: int) -> None:
        """Verify bucket ``bucket`` of update ``version`` in IPC buffer ``buffer`` and apply it."""
        used = self.plan.used_bytes(bucket)
        src = self.buffers[buffer]
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
        if self.views:
            self._feed_views(bucket, buffer, version, used, got_sum)
            return
        if self.rollback_mode == "journal":
            self._journal_ahead(bucket)
            if self._side is not None:
                torch.cuda.current_stream(src.device).wait_event(self._ready.pop(bucket))
        completed: dict[str, torch.Tensor] = {}
        for target, dst, lo, hi in self._targets(bucket, self._dest):
            dst.copy_(src[lo:hi])
            self._written[target] = self._written.get(target, 0) + hi - lo
            if self._written[target] == self._dest[target].numel():  # a split tensor: with its last piece
                completed[target] = self._into[target]
        if self.rollback_mode == "journal":
            self._journal_ahead(bucket + 1)  # on GPU: overlaps with the next bucket's way here
        if src.is_cuda:  # the sender overwrites this buffer once we return: our copies must be done
            torch.cuda.current_stream(src.device).synchronize()
        if self.stream is not None:  # the engine holds our copies, never the IPC buffer the sender reuses
            self.stream.feed(version, bucket, completed)
        self.loads += 1
        self._loading[1].add(bucket)
        if len(self._loading[1]) == len(self.plan.buckets):
            self._commit(version)

    def _feed_views(self, bucket: int, buffer: int, version: int, used: int, checksum_: int) -> None:
        """Hand the stream bucket ``bucket`` where it lies (``views``)."""
        assert self._loading is not None and self.stream is not None
        specs = self.plan.tensors
        pieces = [(p.name, p.start, p.length, p.offset, specs[p.name].shape, specs[p.name].dtype)
                  for p in self.plan.buckets[bucket]]
        self.stream.feed_views(version, bucket, buffer, pieces, (used, checksum_))  # type: ignore[attr-defined]
        self.loads += 1
        self._loading[1].add(bucket)
        if len(self._loading[1]) == len(self.plan.buckets):
            self._commit(version)

    def pack(self, bucket: int, buffer: int) -> int:
        """Write bucket ``bucket`` of the weights this engine serves into IPC buffer ``buffer`` (as the
        checkpoint engine would have delivered it); returns their version."""
        if self.views:
            raise RuntimeError("this replica keeps no copy of its weights to send (it loads updates from the IPC "
                               "buffers on its device): fill the restarted replica from the trainers")
        if not self.ready:
            raise RuntimeError("this replica holds no complete update to send")
        assert self.version is not None
        buf = self.buffers[buffer]
        serving = {n: as_bytes(t) for n, t in self.tensors.items()}
        for _, src, lo, hi in self._targets(bucket, serving):
            buf[lo:hi].copy_(src)
        write_trailer(buf, self.plan.used_bytes(bucket), self.version, bucket)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        return self.version

    def rollback(self) -> bool:
        """Undo a partly applied update; True if the previous weights are back in place."""
        if self._loading is None:
            return not self._empty
        if self.views:  # nothing was kept: the engine serves nothing until a complete update
            self._loading, self._empty = None, True
            self.stream.abort()  # type: ignore[union-attr]
            return False
        if self.rollback_mode == "none":
            return False
        if self._side is not None:
            self._side.synchronize()
        assert self._journal_buf is not None or not self._journal
        for k in sorted(self._journal, reverse=True):
            for dst, at, n in reversed(self._journal[k]):
                dst.copy_(self._journal_buf[at : at + n])
        if self._side is not None:
            torch.cuda.synchronize()
        self._loading = None
        self._reset_journal()
        if self.stream is not None:
            self.stream.abort()
        return True

    def _begin(self, version: int) -> None:
        if self._loading is not None and not self.rollback() and not self.views:
            raise CorruptUpdateError(f"update {self._loading[0]} was left partly applied")
        if self.stream is not None:  # first: an engine that refuses the version leaves nothing begun
            self.stream.begin(version)
        self._loading, self._written = (version, set()), {}
        if self.views:
            return
        if self.rollback_mode == "swap" and self._shadow is None:
            self._shadow = {n: torch.empty_like(t) for n, t in self.tensors.items()}
        self._into = self._shadow if self.rollback_mode == "swap" else self.tensors
        self._dest = {n: as_bytes(t) for n, t in self._into.items()}
        if self._side is not None:  # the journal must read the weights as the last update left them
            self._side.wait_stream(torch.cuda.current_stream())

    def _commit(self, version: int) -> None:
        if self.rollback_mode == "swap":
            assert self._shadow is not None
            short = [n for n, t in self._shadow.items() if self._written.get(n, 0) != t.numel() * t.element_size()]
            if short:  # a byte not written would serve weights from two updates ago
                self.rollback()
                raise CorruptUpdateError(f"update {version} did not cover every byte of {short[:4]}")
        if self.stream is not None:
            try:
                self.stream.commit(version, self._into)
            except BaseException:
                self.rollback()
                raise
        if self.rollback_mode == "swap":
            self.tensors, self._shadow = self._shadow, self.tensors
        self.version, self._loading, self._empty = version, None, False
        self._reset_journal()
        if self.on_commit is not None:
            self.on_commit(self.tensors)

    def _reset_journal(self) -> None:
        if self._side is not None:
            self._side.synchronize()
        self._journal, self._journal_used, self._ready = {}, 0, {}

    def _journal_ahead(self, bucket: int) -> None:
        """Save the bytes bucket ``bucket`` will overwrite (once; on GPU asynchronously, on the side stream)."""
        if bucket >= len(self.plan.buckets) or bucket in self._journal:
            return
        runs = [dst for _, dst, _, _ in self._targets(bucket, self._dest)]
        need = self._journal_used + sum(d.numel() for d in runs)
        if self._journal_buf is None or need > self._journal_buf.numel():
            self._grow_journal(need)
        assert self._journal_buf is not None
        entries = []
        with torch.cuda.stream(self._side) if self._side is not None else nullcontext():
            for dst in runs:
                n = dst.numel()
                self._journal_buf[self._journal_used : self._journal_used + n].copy_(dst, non_blocking=True)
                entries.append((dst, self._journal_used, n))
                self._journal_used += n
            if self._side is not None:
                event = torch.cuda.Event()
                event.record(self._side)
                self._ready[bucket] = event
        self._journal[bucket] = entries

    def _grow_journal(self, need: int) -> None:
        """One host buffer for a whole update's journal: sized for every bucket of the plan at once, so
        copies in flight never move."""
        total = sum(dst.numel() for k in range(len(self.plan.buckets)) for _, dst, _, _ in self._targets(k, self._dest))
        cuda = self._side is not None
        grown = host_buffer(max(total, need, 1 << 20), pinned=cuda)  # exact size: the replica's bytes, once
        if self._journal_buf is not None and self._journal_used:
            if cuda:
                self._side.synchronize()
            grown[: self._journal_used].copy_(self._journal_buf[: self._journal_used])
        self._journal_buf = grown

