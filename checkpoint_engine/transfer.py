"""The inference side of a weight update: map the IPC buffers, verify and load buckets.

The receiver lives in the inference engine's process. It maps the checkpoint engine's IPC
buffers without a copy (POSIX shared memory on CPU, CUDA IPC handles on GPU), checks each
bucket's trailer (update version, bucket index, checksum) and copies each piece to where the
engine's per-parameter load hook says it goes, so a sharded engine takes only its shard.

Before a byte of the engine's weights is overwritten, its old value is saved in a host-memory
journal; if the update fails midway the journal is written back, so the engine keeps serving
the previous weights instead of a half-updated model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from checkpoint_engine.buckets import BucketPlan, Piece, as_bytes, spec_of
from checkpoint_engine.engine import ABORT, checksum, read_trailer
from checkpoint_engine.shm import SharedBuffer


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


def map_ipc(handle) -> tuple[torch.Tensor, object]:
    """Map one IPC buffer from ``CheckpointEngine.ipc_handles()``; returns (tensor, keep-alive)."""
    if handle[0] == "shm":
        buf = SharedBuffer.attach(handle[1], handle[2])
        return buf.tensor, buf
    rebuild, args = handle[1]
    t = rebuild(*args)
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
    update (in "swap" mode they are new objects the engine must rebind to).
    """

    def __init__(self, plan: BucketPlan, handles: list, tensors: dict[str, torch.Tensor],
                 load_hook: LoadHook | None = None, rollback: str | None = None,
                 on_commit: Callable[[dict[str, torch.Tensor]], None] | None = None,
                 placements: Placements | None = None) -> None:
        self.placements = dict(placements or {})
        if load_hook is None:
            check_plan(tensors, plan, self.placements)
        if rollback is None:
            rollback = "journal" if any(t.is_cuda for t in tensors.values()) else "swap"
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {rollback!r}")
        self.plan, self.rollback_mode, self.on_commit = plan, rollback, on_commit
        self.load_hook = load_hook or _full_tensor
        self.tensors = tensors            # what the engine serves with
        self._shadow: dict[str, torch.Tensor] | None = None
        mapped = [map_ipc(h) for h in handles]
        self.buffers = [m[0] for m in mapped]
        self._keep = [m[1] for m in mapped]
        self.version: int | None = None   # last complete update
        self.loads = 0                    # buckets applied, over the receiver's life
        self._loading: tuple[int, set[int]] | None = None
        self._written: dict[str, int] = {}
        self._journal: list[tuple[torch.Tensor, int, int]] = []  # (destination, journal offset, bytes)
        self._journal_buf: torch.Tensor | None = None
        self._journal_used = 0
        self._dest: dict[str, torch.Tensor] = {}

    @property
    def consistent(self) -> bool:
        """False while an update is partly applied: the engine must not serve then."""
        return self._loading is None

    @property
    def ready(self) -> bool:
        """Holds a complete set of weights that came through the engine."""
        return self.consistent and self.version is not None

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
        dest = self._dest
        for p in self.plan.buckets[bucket]:
            piece = src[p.offset : p.offset + p.length]
            target, base = self.placements.get(p.name, (p.name, 0))
            raw = dest[target]
            for at, lo, hi in self.load_hook(p):
                dst = raw[base + at : base + at + hi - lo]
                if self.rollback_mode == "journal":
                    self._save(dst)
                dst.copy_(piece[lo:hi])
                self._written[target] = self._written.get(target, 0) + hi - lo
        if src.is_cuda:  # the sender overwrites this buffer once we return: our copies must be done
            torch.cuda.current_stream(src.device).synchronize()
        self.loads += 1
        self._loading[1].add(bucket)
        if len(self._loading[1]) == len(self.plan.buckets):
            self._commit(version)

    def rollback(self) -> bool:
        """Undo a partly applied update; True if the previous weights are back in place."""
        if self._loading is None:
            return True
        if self.rollback_mode == "none":
            return False
        for dst, at, n in reversed(self._journal):
            dst.copy_(self._journal_buf[at : at + n])
        self._loading, self._journal, self._journal_used = None, [], 0
        return True

    def _begin(self, version: int) -> None:
        if self._loading is not None and not self.rollback():
            raise CorruptUpdateError(f"update {self._loading[0]} was left partly applied")
        self._loading, self._written = (version, set()), {}
        if self.rollback_mode == "swap" and self._shadow is None:
            self._shadow = {n: torch.empty_like(t) for n, t in self.tensors.items()}
        into = self._shadow if self.rollback_mode == "swap" else self.tensors
        self._dest = {n: as_bytes(t) for n, t in into.items()}

    def _commit(self, version: int) -> None:
        if self.rollback_mode == "swap":
            assert self._shadow is not None
            short = [n for n, t in self._shadow.items() if self._written.get(n, 0) != t.numel() * t.element_size()]
            if short:  # a byte not written would serve weights from two updates ago
                self._loading = None
                raise CorruptUpdateError(f"update {version} did not cover every byte of {short[:4]}")
            self.tensors, self._shadow = self._shadow, self.tensors
        self.version, self._loading = version, None
        self._journal, self._journal_used = [], 0
        if self.on_commit is not None:
            self.on_commit(self.tensors)

    def _save(self, dst: torch.Tensor) -> None:
        """Journal the bytes about to be overwritten, in one host buffer grown geometrically."""
        n = dst.numel()
        if self._journal_buf is None or self._journal_used + n > self._journal_buf.numel():
            grown = torch.empty(max(2 * (self._journal_used + n), 1 << 20), dtype=torch.uint8,
                                pin_memory=dst.is_cuda)
            if self._journal_buf is not None:
                grown[: self._journal_used].copy_(self._journal_buf[: self._journal_used])
            self._journal_buf = grown
        self._journal_buf[self._journal_used : self._journal_used + n].copy_(dst)
        self._journal.append((dst, self._journal_used, n))
        self._journal_used += n
