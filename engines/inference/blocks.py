"""Block bookkeeping of the paged KV cache: a free list, reference counts and a prefix table.

A sequence's keys and values live in fixed-size blocks listed in its block table; the table grows a
block at a time as the sequence does, so the cache holds as many sequences as their actual lengths
allow. Blocks are shared by reference count: the K samples of a prompt hold the prompt's blocks once,
and a block that is written while shared is first copied (copy-on-write). A full block is registered
under a hash of every token up to its end, so a later sequence with the same prefix (a multi-turn
context, a system prompt, a request resumed after a pause) takes the block instead of recomputing it.
A registered block that nobody holds stays cached until its memory is needed (least recently used
first). Registrations are dropped when the weights change: the cached keys were computed with the
old ones.

Everything here is host-side integers; ``engines.inference.kv_cache`` holds the tensors these indices address.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """No free block is left, even after evicting every cached one."""


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full block's tokens chained to the hash of everything before it."""
    return hash((parent, tuple(tokens)))


@dataclass
class SeqBlocks:
    """One sequence's block table: ``blocks[i]`` holds positions [i·block_size, (i+1)·block_size).

    ``computed`` counts the leading positions whose keys/values are written; ``hashes[i]`` is the
    chain hash of full block i once it is known (registered or matched)."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    hashes: list[int] = field(default_factory=list)


class BlockAllocator:
    """Allocation, sharing and prefix caching of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low block ids first
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unheld; oldest first
        #: prefix-cache counters, in tokens, kept by the scheduler: admitted and found, admitted and computed
        self.hits = 0
        self.misses = 0

    # ---- capacity -------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks that can be handed out now (free, or cached and unheld)."""
        return len(self._free) + len(self._evictable)

    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.available()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- one block ------------------------------------------------------------------------

    def allocate(self) -> int:
        """A block with reference count 1 (a free one, else the least recently used cached one)."""
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._unregister(b)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV-cache blocks are in use")
        self.ref[b] = 1
        return b

    def share(self, b: int) -> None:
        """One more holder of block ``b``."""
        if self.ref[b] == 0:
            self._evictable.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """One holder fewer; an unheld block is cached if registered, else free."""
        if self.ref[b] <= 0:
            raise RuntimeError(f"block {b} released more often than held")
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self._hash_of[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # ---- prefix table ---------------------------------------------------------------------

    def register(self, b: int, h: int) -> None:
        """Make full block ``b`` findable under chain hash ``h`` (the first block of a hash wins)."""
        if h not in self._by_hash and self._hash_of[b] is None:
            self._by_hash[h] = b
            self._hash_of[b] = h

    def lookup(self, h: int) -> int | None:
        return self._by_hash.get(h)

    def _unregister(self, b: int) -> None:
        h = self._hash_of[b]
        if h is not None:
            del self._by_hash[h]
            self._hash_of[b] = None

    def invalidate(self) -> None:
        """Forget every registration (the weights changed); cached unheld blocks become free."""
        for b in list(self._by_hash.values()):
            self._hash_of[b] = None
        self._by_hash.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()

    # ---- sequences ------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> SeqBlocks:
        """A new sequence of ``tokens`` holding every cached full block of its prefix.

        At least the last token is left to compute, since its logits are needed."""
        bs, seq, parent = self.block_size, SeqBlocks(), None
        for i in range((len(tokens) - 1) // bs):
            h = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            b = self.lookup(h)
            if b is None:
                break
            self.share(b)
            seq.blocks.append(b)
            seq.hashes.append(h)
            parent = h
        seq.computed = len(seq.blocks) * bs
        return seq

    def fork(self, seq: SeqBlocks) -> SeqBlocks:
        """Another holder of every block of ``seq`` (a sample that shares its prompt)."""
        for b in seq.blocks:
            self.share(b)
        return SeqBlocks(list(seq.blocks), seq.computed, list(seq.hashes))

    def free(self, seq: SeqBlocks) -> None:
        """Release every block of ``seq`` and empty it."""
        for b in seq.blocks:
            self.release(b)
        seq.blocks, seq.hashes, seq.computed = [], [], 0

    def reserve(self, seq: SeqBlocks, end: int) -> list[tuple[int, int]]:
        """Make positions [seq.computed, end) writable: new blocks as needed, and a private copy of a
        shared block about to be written. Returns the (source, destination) block copies to make.

        Raises OutOfBlocks (leaving ``seq`` as it was) when the blocks are not there."""
        bs = self.block_size
        first, need = seq.computed // bs, self.blocks_for(end) - len(seq.blocks)
        cow = first < len(seq.blocks) and seq.computed < end and self.ref[seq.blocks[first]] > 1
        if max(0, need) + cow > self.available():
            raise OutOfBlocks(f"{max(0, need) + cow} blocks needed, {self.available()} available")
        copies = []
        if cow:
            new = self.allocate()
            copies.append((seq.blocks[first], new))
            self.release(seq.blocks[first])
            seq.blocks[first] = new
        for _ in range(need):
            seq.blocks.append(self.allocate())
        return copies

    def commit(self, seq: SeqBlocks, tokens: Sequence[int], computed: int) -> None:
        """Record that positions up to ``computed`` are written (``tokens`` are the sequence's ids so far)
        and register the blocks that became full."""
        seq.computed = computed
        bs = self.block_size
        while len(seq.hashes) < computed // bs:
            i = len(seq.hashes)
            h = block_hash(seq.hashes[-1] if seq.hashes else None, tokens[i * bs:(i + 1) * bs])
            seq.hashes.append(h)
            self.register(seq.blocks[i], h)
