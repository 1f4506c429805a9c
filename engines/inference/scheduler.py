"""Which tokens the inference engine computes in a step, and where their keys and values go.

A step has a token budget. Every decoding request takes one token of it (its next query); what is
left goes to prompt chunks: first the prefills already under way, then new requests admitted from the
waiting queue, oldest first. A long prompt is cut into chunks over several steps, so it never stalls
the sequences that are decoding. Requests with the very same tokens (the K samples of a prompt) are
admitted together: one prefill, whose blocks the others then share. A new request first takes every
cached block of its prefix (``engines.inference.blocks``), so only the rest is computed.

Decoding requests sit in rows 0..n-1 of the engine's per-row state; a row freed by a finished or
preempted request is refilled by moving the last row into it (``moves`` tell the engine). When a
decoding request needs a block and none is left, the newest request is preempted: its blocks are
released (their full blocks stay cached) and it goes back to the front of the queue with the tokens
it has, to be recomputed when blocks free up.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from engines.inference.blocks import BlockAllocator, OutOfBlocks
from engines.inference.requests import Request


@dataclass
class StepPlan:
    """One step: rows 0..decode-1 decode a token; ``chunks`` (request, start, end) prefill those positions
    of their sequence. ``copies`` (source, destination) blocks must be copied and ``moves`` (source,
    destination) rows moved, in order, before the forward; ``dirty`` rows have new block tables."""

    decode: int
    chunks: list[tuple[Request, int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    dirty: set[int] = field(default_factory=set)
    preempted: int = 0


class Scheduler:
    """Queues, rows and KV blocks of one engine (host-side bookkeeping only)."""

    def __init__(self, allocator: BlockAllocator, max_rows: int, token_budget: int) -> None:
        self.alloc, self.max_rows, self.token_budget = allocator, max_rows, token_budget
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prefill under way (leaders; followers ride along)
        self.running: list[Request] = []     # decoding, running[i] in row i
        self._order = itertools.count()
        self.preemptions = 0

    # ---- queues ---------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.running or self.prefilling or self.waiting)

    def rows_committed(self) -> int:
        """Rows decoding now plus those the prefills under way will take."""
        return len(self.running) + sum(1 + len(p.followers) for p in self.prefilling)

    # ---- planning -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Reserve blocks for this step's tokens (preempting if need be) and choose the prefill chunks."""
        plan = StepPlan(decode=0)
        bs, ref = self.alloc.block_size, self.alloc.ref
        i = 0
        while i < len(self.running):
            r = self.running[i]
            c, blocks = r.seq.computed, r.seq.blocks
            if c % bs and ref[blocks[c // bs]] == 1:  # the next position is in a block of its own: nothing to do
                i += 1
                continue
            before = len(r.seq.blocks)
            try:
                copies = self.alloc.reserve(r.seq, r.seq.computed + 1)
            except OutOfBlocks:
                self._preempt_newest(plan)
                i = 0  # rows moved; reserving is idempotent, so start over
                continue
            if copies or len(r.seq.blocks) != before:
                plan.dirty.add(i)
            plan.copies += copies
            i += 1
        plan.decode = len(self.running)
        budget = self.token_budget - plan.decode
        for r in self.prefilling:
            if budget <= 0:
                break
            budget -= self._chunk(plan, r, budget)
        while budget > 0 and self._admit():
            budget -= self._chunk(plan, self.prefilling[-1], budget)
        return plan

    def _chunk(self, plan: StepPlan, r: Request, budget: int) -> int:
        """Add the next chunk of ``r``'s prefill (at most ``budget`` tokens) if its blocks are there."""
        start = r.seq.computed
        end = min(r.context_len, start + budget)
        try:
            plan.copies += self.alloc.reserve(r.seq, end)
        except OutOfBlocks:
            return budget  # nothing more fits this step
        plan.chunks.append((r, start, end))
        return end - start

    def _admit(self) -> bool:
        """Move the oldest waiting request (and its identical followers) to prefilling, if rows and blocks
        allow."""
        if not self.waiting:
            return False
        head = self.waiting[0]
        room = self.max_rows - self.rows_committed()
        if room < 1:
            return False
        context = head.context
        seq = self.alloc.match_prefix(context)
        need = self.alloc.blocks_for(len(context)) - len(seq.blocks)
        # the prefills already admitted must be able to finish, and the running sequences need a little
        # room to grow (unless nothing else is in flight)
        outstanding = sum(self.alloc.blocks_for(p.context_len) - len(p.seq.blocks) for p in self.prefilling)
        busy = self.running or self.prefilling
        if need + outstanding + (max(1, self.alloc.num_blocks // 100) if busy else 0) > self.alloc.available():
            self.alloc.free(seq)
            return False
        self.waiting.popleft()
        head.seq, head.order = seq, next(self._order)
        self.alloc.hits += seq.computed
        self.alloc.misses += len(context) - seq.computed
        head.followers = [r for r in self.waiting if r.prompt == head.prompt and r.tokens == head.tokens][:room - 1]
        if head.followers:
            taken = set(map(id, head.followers))
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        self.prefilling.append(head)
        return True

    # ---- rows -----------------------------------------------------------------------------

    def place(self, leader: Request) -> list[int]:
        """A finished prefill: rows for the leader and its followers, which share its blocks."""
        self.prefilling.remove(leader)
        rows = []
        for r in [leader, *leader.followers]:
            if r is not leader:  # its whole context came from the leader's prefill
                r.seq, r.order = self.alloc.fork(leader.seq), leader.order
                self.alloc.hits += r.context_len
            rows.append(len(self.running))
            self.running.append(r)
        leader.followers = []
        return rows

    def release(self, row: int) -> tuple[int, int] | None:
        """Free row ``row``'s request and its blocks; returns the (source, destination) row move that keeps
        the rows contiguous, or None."""
        self._free(self.running[row])
        last = len(self.running) - 1
        self.running[row] = self.running[last]
        self.running.pop()
        return (last, row) if last != row else None

    def _free(self, r: Request) -> None:
        """Give ``r``'s blocks back (its full blocks stay in the prefix cache)."""
        self.alloc.free(r.seq)
        r.seq = None

    def _preempt_newest(self, plan: StepPlan) -> None:
        """Put the most recently admitted request back at the front of the queue, freeing its blocks."""
        candidates = self.running + self.prefilling
        if len(candidates) <= 1 and not self.prefilling:
            raise OutOfBlocks("the KV cache cannot hold even one running sequence")
        victim = max(candidates, key=lambda r: r.order)
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            self._free(victim)
            followers, victim.followers = victim.followers, []
            self.waiting.extendleft(reversed(followers))
        else:
            move = self.release(self.running.index(victim))
            if move is not None:
                plan.moves.append(move)
                plan.dirty.add(move[1])
        self.waiting.appendleft(victim)
        self.preemptions += 1
        plan.preempted += 1

    def clear(self) -> list[Request]:
        """Take every request out (running, prefilling with followers, waiting), releasing their blocks."""
        out = []
        for r in self.running:
            self._free(r)
            out.append(r)
        for p in self.prefilling:
            self._free(p)
            out += [p, *p.followers]
            p.followers = []
        out += self.waiting
        self.running, self.prefilling = [], []
        self.waiting.clear()
        return out
