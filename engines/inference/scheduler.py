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

The hand-off to the model runner is one way: ``schedule`` returns a ``StepPlan`` (what to compute and where,
including the rows whose prefill ends this step and which start decoding), the runner executes it and
returns the step's tokens, and the engine then records them (``written``, ``place``, ``release``). Row moves
made while recording (a finished request's row refilled) reach the runner with the next plan.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from engines.inference.blocks import BlockAllocator, OutOfBlocks
from engines.inference.requests import Request


@dataclass(frozen=True)
class Chunk:
    """Positions [start, end) of ``request``'s sequence, prefilled this step; ``last``: the prefill ends here."""

    request: Request
    start: int
    end: int
    last: bool


@dataclass(frozen=True)
class RowStart:
    """A request whose prefill ends this step: it decodes in ``row`` from now on, and its first token is sampled
    from the logits of the last position of ``chunk`` (an index into the plan's chunks). ``blocks`` is its block
    table (the samples sharing a prefill share its blocks)."""

    row: int
    chunk: int
    request: Request
    blocks: list[int]


@dataclass
class StepPlan:
    """One step, for the model runner: rows 0..decode-1 decode a token (the longest of their sequences has
    ``width`` tokens); ``chunks`` prefill positions of their sequences; ``starts`` are rows that begin decoding
    with this step's sample. ``moves`` (source, destination) rows must be moved and ``copies`` (source,
    destination) blocks copied, in order, before the forward; ``tables`` are the new block tables of decoding
    rows. ``sampled`` lists the requests that get a token this step, in row order (decode rows, then starts).
    The runner reads the requests and never changes them."""

    decode: int
    width: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    starts: list[RowStart] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    sampled: list[Request] = field(default_factory=list)
    preempted: int = 0

    @property
    def computes(self) -> bool:
        """Whether the step has tokens to compute (else only its moves and copies are made)."""
        return self.decode > 0 or bool(self.chunks)


class Scheduler:
    """Queues, rows and KV blocks of one engine (host-side bookkeeping only)."""

    def __init__(self, allocator: BlockAllocator, max_rows: int, token_budget: int) -> None:
        self.alloc, self.max_rows, self.token_budget = allocator, max_rows, token_budget
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prefill under way (leaders; followers ride along)
        self.running: list[Request] = []     # decoding, running[i] in row i
        self._order = itertools.count()
        self._moves: list[tuple[int, int]] = []  # row moves the runner has not been told of yet, in order
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
        plan, dirty = StepPlan(decode=0), set()
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
                self._preempt_newest(plan, dirty)
                i = 0  # rows moved; reserving is idempotent, so start over
                continue
            if copies or len(r.seq.blocks) != before:
                dirty.add(i)
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
        return self._finish(plan, dirty)

    def reserve_ahead(self, plan: StepPlan, steps: int) -> int:
        """Reserve blocks for ``steps`` decode steps of decode-only ``plan``'s rows (the first is reserved already),
        preempting no one; returns ``steps``, or 1 where some row's blocks cannot be had (the rows served before
        keep theirs, for the steps to come). New block tables and copies go into the plan."""
        for row, r in enumerate(self.running):
            before = len(r.seq.blocks)
            try:
                plan.copies += self.alloc.reserve(r.seq, r.seq.computed + steps)
            except OutOfBlocks:
                return 1
            finally:
                if len(r.seq.blocks) != before:
                    plan.tables[row] = r.seq.blocks
        return steps

    def _finish(self, plan: StepPlan, dirty: set[int]) -> StepPlan:
        """Fill in what the runner reads besides the chunks: moves, tables, width, the rows that start."""
        n = plan.decode
        plan.moves, self._moves = self._moves, []  # the last record's, then this plan's preemptions
        plan.tables = {row: self.running[row].seq.blocks for row in sorted(dirty) if row < n}
        plan.width = max((r.context_len for r in self.running), default=0)
        plan.sampled = self.running[:n]
        row = n
        for j, c in enumerate(plan.chunks):
            if c.last:
                for r in (c.request, *c.request.followers):
                    plan.starts.append(RowStart(row, j, r, c.request.seq.blocks))
                    plan.sampled.append(r)
                    row += 1
        return plan

    def _chunk(self, plan: StepPlan, r: Request, budget: int) -> int:
        """Add the next chunk of ``r``'s prefill (at most ``budget`` tokens) if its blocks are there."""
        start = r.seq.computed
        end = min(r.context_len, start + budget)
        try:
            plan.copies += self.alloc.reserve(r.seq, end)
        except OutOfBlocks:
            return budget  # nothing more fits this step
        plan.chunks.append(Chunk(r, start, end, end == r.context_len))
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

    # ---- recording a step ----------------------------------------------------------------

    def written(self, r: Request, computed: int) -> None:
        """Positions up to ``computed`` of ``r`` now have their keys/values; full blocks get registered."""
        seq = r.seq
        seq.computed = computed
        if computed // self.alloc.block_size > len(seq.hashes):
            self.alloc.commit(seq, r.context, computed)

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
        the rows contiguous, or None (the next plan carries it to the runner)."""
        self._free(self.running[row])
        last = len(self.running) - 1
        self.running[row] = self.running[last]
        self.running.pop()
        if last == row:
            return None
        self._moves.append((last, row))
        return last, row

    def _free(self, r: Request) -> None:
        """Give ``r``'s blocks back (its full blocks stay in the prefix cache)."""
        self.alloc.free(r.seq)
        r.seq = None

    def _preempt_newest(self, plan: StepPlan, dirty: set[int]) -> None:
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
                dirty.add(move[1])
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
        self.running, self.prefilling, self._moves = [], [], []
        self.waiting.clear()
        return out
