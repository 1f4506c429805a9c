"""Where a verified bucket goes on the inference side: the sinks a ``WeightReceiver`` calls.

A weight update is a transport (``checkpoint_engine.engine.CheckpointEngine`` today: the trainers' broadcast into
two IPC buffers per worker) times a sink. The receiver (``checkpoint_engine.transfer.WeightReceiver``) maps the IPC
buffers, verifies each bucket's trailer and owns the update's version; the sink, chosen once per replica by
``make_sink`` from what the engine declares, puts the bucket's bytes where the engine serves them from:

- ``TensorSink`` ("swap"): into the engine's own tensors (``named_tensors``, through ``weight_placements``), in a
  spare host copy swapped in at the commit on CPU, or in place with a host journal of the overwritten bytes on a
  device (a failed update writes them back); the engine rebinds at the commit (``swap_weights``);
- ``StreamSink`` ("stream"): into a host copy of the checkpoint's tensors as a ``TensorSink``, each bucket's
  completed tensors handed on to the engine's running load (``begin``/``feed``/``commit``/``abort``: vLLM);
- ``ViewSink`` ("views"): nothing is copied: the engine loads each bucket from the IPC buffer where it lies
  (``feed_views``: vLLM on a GPU), and keeps no copy to roll back to or to pack for a peer;
- ``AdapterSink`` ("adapters merged", "adapters as deltas"): the update carries LoRA adapters, staged in full
  and served at the commit on top of the base the replica keeps (``merge_adapters``: W0 + s·B·A written into the
  served weights; ``load_adapter_deltas``: low-rank deltas beside them).

A sink's contract: ``set_plan`` checks a plan against what it holds; ``begin(version)`` before the first bucket of an
update; ``load`` one verified bucket; ``commit(version)`` once every bucket is in (raises: the receiver rolls the
update back); ``serve()`` right after the commit; ``rollback()`` undoes a partly applied update (True: the previous
weights serve again); ``pack`` writes a bucket of what it serves for a restarted peer (refused where nothing is
kept); ``intact``: it holds a complete set of weights (False only after a failed update that could not be undone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from checkpoint_engine.buckets import BucketPlan, Piece, as_bytes
from checkpoint_engine.transfer import (
    ROLLBACK_MODES,
    CorruptUpdateError,
    LoadHook,
    Placements,
    ViewStream,
    WeightStream,
    check_plan,
)
from engines.device import host_buffer


def _full_tensor(piece: Piece) -> list[tuple[int, int, int]]:
    return [(piece.start, 0, piece.length)]


class WeightSink:
    """Where a receiver puts verified buckets (see the module docstring for the contract)."""

    #: a new update may start over one that failed midway (it rewrites every byte the engine serves)
    refills: bool = False
    #: why nothing can be packed for a restarted peer (None: ``pack`` works)
    cannot_pack: str | None = None
    #: the updates carry no base: a replica that the trainers fill reads it elsewhere first (``AdapterSink``)
    needs_base: bool = False
    #: loads go to a spare copy and the served weights change only at the commit: the engine may serve meanwhile
    stages: bool = False

    def set_plan(self, plan: BucketPlan) -> None:
        self.plan = plan

    def begin(self, version: int) -> None: ...

    def load(self, bucket: int, buffer: int, src: torch.Tensor, check: tuple[int, int], version: int) -> None:
        raise NotImplementedError

    def commit(self, version: int) -> None: ...

    def serve(self) -> None: ...

    def rollback(self) -> bool:
        return False

    def pack(self, bucket: int, dst: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def intact(self) -> bool:
        return True


class TensorSink(WeightSink):
    """Bytes into named tensors. ``load_hook`` maps a piece to byte ranges of the engine's own (possibly sharded)
    tensor (None: every tensor whole); ``placements`` says where a plan tensor lives in an engine with another
    layout (fused q/k/v, stacked experts); ``rollback`` is how the previous weights are kept until the commit
    (``ROLLBACK_MODES``; default "journal" for device tensors, else "swap"); ``on_commit`` receives the tensors to
    serve with after a complete update (in "swap" mode new objects the engine must rebind to)."""

    def __init__(self, tensors: dict[str, torch.Tensor], load_hook: LoadHook | None = None,
                 rollback: str | None = None, on_commit: Callable[[dict[str, torch.Tensor]], None] | None = None,
                 placements: Placements | None = None) -> None:
        if rollback is None:
            rollback = "journal" if any(t.is_cuda for t in tensors.values()) else "swap"
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {rollback!r}")
        self.rollback_mode, self.on_commit = rollback, on_commit
        self.placements = dict(placements or {})
        self.load_hook = load_hook or _full_tensor
        self._hooked = load_hook is not None
        self.tensors = tensors            # what the engine serves with
        self._shadow: dict[str, torch.Tensor] | None = None
        self._written: dict[str, int] = {}
        self._into = self.tensors         # the typed tensors an update writes (the shadow in "swap" mode)
        self._dest: dict[str, torch.Tensor] = {}
        self._journal_buf: torch.Tensor | None = None
        self._journal: dict[int, list[tuple[torch.Tensor, int, int]]] = {}  # bucket -> (destination, at, bytes)
        self._journal_used = 0
        cuda = any(t.is_cuda for t in tensors.values())
        self._side = torch.cuda.Stream() if cuda and rollback == "journal" else None
        self._ready: dict[int, object] = {}  # bucket -> event: its journal copy is done (side stream)
        self._active = False

    @property
    def stages(self) -> bool:  # type: ignore[override]
        return self.rollback_mode == "swap"

    def set_plan(self, plan: BucketPlan) -> None:
        """An unhooked engine must hold exactly the plan's tensors (``check_plan``)."""
        if not self._hooked:
            check_plan(self.tensors, plan, self.placements)
        self.plan = plan

    def _targets(self, bucket: int, dest: dict[str, torch.Tensor]):
        """(bytes of the engine's tensor, bytes of the bucket) for every run of bucket ``bucket``."""
        for p in self.plan.buckets[bucket]:
            target, base = self.placements.get(p.name, (p.name, 0))
            raw = dest[target]
            for at, lo, hi in self.load_hook(p):
                yield target, raw[base + at : base + at + hi - lo], p.offset + lo, p.offset + hi

    def begin(self, version: int) -> None:
        self._written, self._active = {}, True
        if self.rollback_mode == "swap" and self._shadow is None:
            self._shadow = {n: torch.empty_like(t) for n, t in self.tensors.items()}
        self._into = self._shadow if self.rollback_mode == "swap" else self.tensors
        self._dest = {n: as_bytes(t) for n, t in self._into.items()}
        if self._side is not None:  # the journal must read the weights as the last update left them
            self._side.wait_stream(torch.cuda.current_stream())

    def load(self, bucket: int, buffer: int, src: torch.Tensor, check: tuple[int, int], version: int) -> None:
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
        self.completed(version, bucket, completed)

    def completed(self, version: int, bucket: int, tensors: dict[str, torch.Tensor]) -> None:
        """The tensors bucket ``bucket`` completed (a stream hands them on)."""

    def commit(self, version: int) -> None:
        if self.rollback_mode == "swap":
            assert self._shadow is not None
            short = [n for n, t in self._shadow.items() if self._written.get(n, 0) != t.numel() * t.element_size()]
            if short:  # a byte not written would serve weights from two updates ago
                raise CorruptUpdateError(f"update {version} did not cover every byte of {short[:4]}")
        self.committing(version)
        if self.rollback_mode == "swap":
            self.tensors, self._shadow = self._shadow, self.tensors
        self._active = False
        self._reset_journal()

    def committing(self, version: int) -> None:
        """Every bucket is in, before the swap (a stream ends its load here; raising rolls the update back)."""

    def serve(self) -> None:
        if self.on_commit is not None:
            self.on_commit(self.tensors)

    def rollback(self) -> bool:
        if not self._active:
            return True
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
        self._active = False
        self._reset_journal()
        return True

    def pack(self, bucket: int, dst: torch.Tensor) -> None:
        serving = {n: as_bytes(t) for n, t in self.tensors.items()}
        for _, src, lo, hi in self._targets(bucket, serving):
            dst[lo:hi].copy_(src)

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


class StreamSink(TensorSink):
    """A ``TensorSink`` over the stream engine's host copy (whole tensors under the plan's names, kept in a spare
    copy until the commit), each bucket's completed tensors handed on to its running load."""

    def __init__(self, stream: WeightStream, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.stream = stream

    stages = False  # type: ignore[assignment]  # each bucket's tensors go on into the running engine's load

    def begin(self, version: int) -> None:
        self.stream.begin(version)  # first: an engine that refuses the version leaves nothing begun
        super().begin(version)

    def completed(self, version: int, bucket: int, tensors: dict[str, torch.Tensor]) -> None:
        self.stream.feed(version, bucket, tensors)  # our copies, never the IPC buffer the sender reuses

    def committing(self, version: int) -> None:
        self.stream.commit(version, self._into)

    def rollback(self) -> bool:
        active = self._active
        ok = super().rollback()
        if active:
            self.stream.abort()
        return ok


class ViewSink(WeightSink):
    """The engine loads each bucket from the IPC buffer where it lies (``ViewStream.feed_views``); ``tensors`` only
    describe what it holds (meta tensors will do). Nothing of the previous weights is kept, so a failed update leaves
    it without weights (``intact`` False) until a complete one arrives."""

    refills = True
    cannot_pack = ("this replica keeps no copy of its weights to send (it loads updates from the IPC buffers on its "
                   "device): fill the restarted replica from the trainers")

    def __init__(self, stream: ViewStream, tensors: dict[str, torch.Tensor]) -> None:
        self.stream, self.tensors = stream, tensors
        self._empty = False
        self._active = False

    def set_plan(self, plan: BucketPlan) -> None:
        check_plan(self.tensors, plan)
        self.plan = plan

    def begin(self, version: int) -> None:
        self.stream.begin(version)
        self._active = True

    def load(self, bucket: int, buffer: int, src: torch.Tensor, check: tuple[int, int], version: int) -> None:
        specs = self.plan.tensors
        pieces = [(p.name, p.start, p.length, p.offset, specs[p.name].shape, specs[p.name].dtype)
                  for p in self.plan.buckets[bucket]]
        self.stream.feed_views(version, bucket, buffer, pieces, check)

    def commit(self, version: int) -> None:
        self.stream.commit(version, self.tensors)
        self._active, self._empty = False, False

    def rollback(self) -> bool:
        if not self._active:
            return not self._empty
        self._active, self._empty = False, True
        self.stream.abort()
        return False


    @property
    def intact(self) -> bool:
        return not self._empty


class AdapterSink(TensorSink):
    """A LoRA update: the adapters (the plan's tensors) staged in full on the engine's device, served at the commit
    on top of the base the replica keeps: ``serve_adapters(adapters, scaling)`` is the engine's ``merge_adapters``
    or ``load_adapter_deltas``. A failed update never reaches the engine. Nothing of the served weights can be
    packed for a peer: they are merged ones, and the updates carry no base."""

    cannot_pack = ("a LoRA replica serves merged weights and the updates carry no base: a restarted replica reads the "
                   "base from the run's starting checkpoint and the trainers send the adapters")
    needs_base = True

    def __init__(self, specs: Mapping, device: torch.device,
                 serve_adapters: Callable[[dict[str, torch.Tensor], float], None], scaling: float) -> None:
        staged = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device=device) for n, t in specs.items()}
        super().__init__(staged, on_commit=lambda adapters: serve_adapters(adapters, scaling))



@dataclass(frozen=True)
class AdapterUpdates:
    """What a LoRA run's updates carry: the adapters alone (the base stays where the replicas keep it), served at
    ``scaling`` = alpha / rank, merged into the served weights or (``unmerged``) as low-rank deltas beside them."""

    scaling: float
    unmerged: bool = False


def whole_sink(engine) -> WeightSink:
    """The sink of whole weights in the checkpoint's names for ``engine`` (a ``RolloutEngine``), from what it
    declares: views of the IPC buffers (``ipc_views``), a stream into its running load (``weight_update``
    "stream"), or its own tensors, swapped in at the commit ("swap")."""
    if engine.ipc_views:
        return ViewSink(engine, engine.named_tensors())
    if engine.weight_update == "stream":
        return StreamSink(engine, engine.named_tensors())
    return TensorSink(engine.named_tensors(), on_commit=engine.swap_weights,
                      placements=engine.weight_placements() or None)


def make_sink(engine, plan: BucketPlan, adapters: AdapterUpdates | None = None) -> WeightSink:
    """The one place a replica's update sink is chosen: whole weights (``whole_sink``), or, where the updates of
    ``plan`` carry ``adapters``, an ``AdapterSink`` serving them merged or as deltas on the base the engine keeps."""
    if adapters is None:
        return whole_sink(engine)
    engine.keep_adapter_base()  # the updates carry no base: a level-2 sleep keeps it on the host
    serve = engine.load_adapter_deltas if adapters.unmerged else engine.merge_adapters
    return AdapterSink(plan.tensors, engine.device, serve, adapters.scaling)


def fill_sink(engine, sink: WeightSink) -> WeightSink:
    """The sink of a start-up fill (whole weights in the checkpoint's names): the updates' ``sink`` itself unless it
    takes adapters."""
    return whole_sink(engine) if sink.needs_base else sink
