"""CUDA graphs of the inference engine's decode step: the forward and the plain sampler.

A decode step of a small batch is a few hundred tiny kernels: on a GPU their launches, not the arithmetic, set the
pace. A graph replays the whole step with one launch. Its batch is one of the capture sizes (``capture_sizes``:
1, 2, 4, 8, then steps of 8 up to 256 and of 16 past it, ending at ``max_num_seqs``, as vLLM's list goes), the
smallest at least the running batch (``capture_size``). Its attention width depends on the decode backend: a
backend that reads each row's keys up to that row's own position (``kv_cache.decode_reads_in_place``: the triton
kernel) gives the same step at any width, so its graphs take the block table's full width and are keyed by batch
size alone; the others (torch gathers and masks every key of the width, flex sizes its block mask by it) are keyed
by (batch, width), each rounded up to a power of two (the width to at least ``MIN_WIDTH``), which keeps the pairs
they capture lazily few.

A graph holds the decode forward (``ModelRunner.decode_logits``) and, after it, the sampler of rows without top-k,
top-p or a grammar (``sampling.sample_plain``: one log-softmax at each row's temperature and the inverse-CDF draw of
the counter-based uniform, the tokens ``sampling.sample`` draws), so one replay gives every row's logits, token and
token log-prob. Every decode-only step replays one; when each of its rows samples plainly, the runner takes the
replay's tokens and log-probs (``sampled``), and otherwise it samples the replay's logits eagerly as before (the
graph's own draw is then unused). Advancing the rows (last token, counters, positions) and the stop checks stay
outside, in the runner, shared by both ways: a graph changes no per-row state but the KV cache.

A graph reads the model runner's persistent state (last tokens, positions, counters, temperatures and seeds, block
tables, the KV pool, the weights) in place; rows past the running batch are padding, pointed before each replay at
position 0 of the engine's scratch block (which no sequence is given), so their key and value writes never land in
a live sequence's blocks (``capture_all`` points every row there while it captures, and gives the rows their state
back after); what they sample is ignored. Only decode-only steps replay a graph (a step with prefill chunks runs
eagerly). Every graph copies its logits, tokens and log-probs into three buffers of ``max_num_seqs`` rows shared by
all graphs, so their outputs cost one batch's, not one per graph (with 50-odd graphs and a 150k vocabulary the
logits alone would be gigabytes), and their temporaries share one memory pool: the largest graph's forward, then
its sampler's two float32 [rows, vocabulary] buffers (``sample_plain`` exponentiates and sums in place).

Keyed by batch size alone, the graphs are few enough to capture all at once: by default the engine does so as it
starts (``capture_all``, largest first, so the smaller ones reuse the pool's memory), and no capture is left for a
timed decode loop; ``capture_at_start=False`` leaves them to first use, as graphs keyed by width always are. They
are kept while the memory they point at stays: the engine's weights and pool live in arenas whose addresses
survive sleep; they are dropped when an address moves (weights rebound to other tensors, no arena on this device)
or the engine changes what a step computes (LoRA deltas), and captured again, all of them, at the next decode step.
Capture runs on the engine's device and on a stream of it, whatever device is current on the calling thread. If
a capture fails, the engine decodes eagerly from then on (same tokens, slower) after one warning, and its
``stats()`` say so (``cuda_graphs_fallback``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engines.inference.kv_cache import decode_reads_in_place
from engines.inference.sampling import sample_plain

if TYPE_CHECKING:
    from engines.inference.model_runner import ModelRunner
    from engines.model.native.arch import ModelConfig

log = logging.getLogger(__name__)

MIN_WIDTH = 64  # the smallest attention-width bucket (tokens)
#: Capture sizes step by 8 up to here, then by 16: past it a batch's padding is a small share of it.
FINE_STEPS_UP_TO = 256


def graphs_supported(device: torch.device, cfg: ModelConfig) -> bool:
    """Whether decode steps of this model on this device can be captured: a CUDA device, and no mixture of
    experts (its layers size each expert's batch on the host)."""
    return device.type == "cuda" and not cfg.is_moe


def bucket(n: int, limit: int, least: int = 1) -> int:
    """The power of two ≥ n (at least ``least``), capped at ``limit``."""
    b = max(least, 1)
    while b < n:
        b *= 2
    return min(b, limit)


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for, ascending: 1, 2, 4, 8, every multiple of 8 up to 256, every multiple
    of 16 past it, each below ``max_batch``, then ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError(f"a batch holds at least one row, got max_batch={max_batch}")
    steps = itertools.chain((1, 2, 4), range(8, FINE_STEPS_UP_TO, 8), itertools.count(FINE_STEPS_UP_TO, 16))
    return [*itertools.takewhile(lambda s: s < max_batch, steps), max_batch]


def capture_size(n: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` (ascending) that holds a batch of ``n`` rows."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"a batch of {n} rows is over the largest capture size {sizes[-1]}")
    return sizes[i]


def graph_key(n: int, width: int, sizes: Sequence[int], full_width: int, in_place: bool) -> tuple[int, int]:
    """(rows, width) of the graph that decodes ``n`` rows whose longest sequence has ``width`` tokens: where attention
    reads in place, the smallest capture size ≥ n and the table's ``full_width`` (one graph per batch size); else
    the power-of-two buckets of both, so that the lazily captured (batch, width) pairs stay a few dozen."""
    if in_place:
        return capture_size(n, sizes), full_width
    return bucket(n, sizes[-1]), bucket(width, full_width, MIN_WIDTH)


class DecodeGraphs:
    """Captured decode steps of one engine's model runner, keyed by (batch size, width): the width is the table's
    full width for every graph where the attention reads in place (see the module's docstring).

    ``capture_at_start``: capture every batch size at once (``capture_all``) rather than each at first use; None
    means so wherever the key is the batch size alone, and True where it is not raises ValueError."""

    def __init__(self, runner: ModelRunner, capture_at_start: bool | None = None) -> None:
        # a weak reference: no cycle, so a dropped engine gives its KV pool and graph pool back at once
        self.runner = weakref.proxy(runner)
        self.sizes = capture_sizes(runner.max_num_seqs)
        self.full_width = runner.max_blocks * runner.block_size
        self.in_place = decode_reads_in_place(runner.attention, runner.model.config, runner.dtype, runner.device)
        if capture_at_start and not self.in_place:
            raise ValueError(f"graphs are captured at start only where decode attention reads the cache in place "
                             f"(attention 'triton', on layers its kernel takes), not with {runner.attention!r}: "
                             "their widths are only known as sequences grow")
        self.at_start = self.in_place if capture_at_start is None else capture_at_start
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        # [max_num_seqs, V] logits, [max_num_seqs] tokens and log-probs: every graph's outputs, copied in by its replay
        self._out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._replayed: int | None = None  # the rows of the last replay, until ``sampled`` hands its draw over
        self._where: tuple[int, ...] = ()
        self._stream: torch.cuda.Stream | None = None  # capture stream, on the engine's device
        self.captures = 0  # over the engine's life (tests and benchmarks read it)
        self.failed: str | None = None  # why a capture failed: the engine then decodes eagerly

    def clear(self) -> None:
        """Drop every graph, the memory pool they share and their output buffers."""
        self.graphs.clear()
        self.pool = None
        self._out = None
        self._replayed = None

    def key(self, n: int, width: int) -> tuple[int, int]:
        """The key of the graph that decodes ``n`` rows whose longest sequence has ``width`` tokens."""
        return graph_key(n, width, self.sizes, self.full_width, self.in_place)

    def plan(self) -> list[tuple[int, int]]:
        """The keys ``capture_all`` captures, in its order: every capture size, largest first (none when lazy)."""
        return [(rows, self.full_width) for rows in reversed(self.sizes)] if self.at_start else []

    def capture_all(self) -> int:
        """Capture each key of ``plan`` not captured yet; returns how many. Every row decodes at the scratch block
        meanwhile (a row that looks idle may still be due to move into a live one) and gets its table and position
        back after."""
        self._check_addresses()
        todo = [k for k in self.plan() if k not in self.graphs]
        if not todo or self.failed is not None:
            return 0
        e = self.runner
        rows = max(r for r, _ in todo)
        saved = e.block_table[:rows].clone(), e.pos[:rows].clone()
        self._pad(0, rows)
        try:
            for key in todo:
                self.graphs[key] = self._capture(*key)
        except Exception as err:
            self._give_up(err)
            return 0
        finally:
            e.block_table[:rows].copy_(saved[0])
            e.pos[:rows].copy_(saved[1])
        return len(todo)

    def logits(self, n: int, width: int) -> torch.Tensor:
        """Next-token logits [n, V] of decoding rows 0..n-1 whose longest sequence has ``width`` tokens,
        as the eager decode step computes them; a replay also samples each row plainly (see ``sampled``)."""
        e = self.runner
        self._replayed = None
        self._check_addresses()
        if self.at_start and not self.graphs:  # dropped since the start: all again, before this step's replay
            self.capture_all()
            if self.failed is not None:
                return e.decode_logits(n, width)
        key = self.key(n, width)
        self._pad(n, key[0])
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(*key)
            except Exception as err:
                self._give_up(err)
                return e.decode_logits(n, width)
        graph, out = self.graphs[key]
        graph.replay()
        self._replayed = n
        return out[:n]

    def sampled(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tokens [n] and log-probs [n] that ``sampling.sample_plain`` drew for rows 0..n-1 in the last
        replay, handed over once (None: no replay of n rows since ``logits`` was last called)."""
        rows, self._replayed = self._replayed, None
        if rows != n or self._out is None:
            return None
        return self._out[1][:n], self._out[2][:n]

    def _check_addresses(self) -> None:
        """Drop the graphs when anything they read has moved since they were captured."""
        where = self._addresses()
        if where != self._where:
            self.clear()
            self._where = where

    def _pad(self, n: int, rows: int) -> None:
        """Send rows n..rows-1 to the scratch block: they hold whatever rows finished there last."""
        e = self.runner
        if rows > n:
            e.block_table[n: rows].fill_(e.scratch_block)
            e.pos[n: rows].zero_()

    def _addresses(self) -> tuple[int, ...]:
        e = self.runner
        kv = e.cache()
        # buffers too: FP8 weights and their scales are buffers, and RoPE tables move with the model
        weights = itertools.chain(e.model.parameters(), e.model.buffers())
        state = (e.last, e.pos, e.gen, e.rows.temperature, e.rows.seed, e.block_table, kv.k)
        return (*(t.data_ptr() for t in state),
                kv.v.data_ptr() if kv.v is not None else 0, *(t.data_ptr() for t in weights))

    def _give_up(self, err: Exception) -> None:
        """Drop every graph and decode eagerly from now on, saying so once."""
        self.clear()
        self.failed = f"{type(err).__name__}: {err}".splitlines()[0]
        log.warning("CUDA graph capture failed on %s (%s); decoding eagerly from now on", self.runner.device,
                    self.failed)

    def _step(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a graph computes: the logits of rows 0..rows-1 and each row's plain draw (token, log-prob) from its
        temperature, seed and counter, all read in place."""
        e = self.runner
        logits = e.decode_logits(rows, width)
        return (logits, *sample_plain(logits, e.rows.temperature[:rows], e.rows.seed[:rows], e.gen[:rows]))

    def _lay_out(self, warm: tuple[torch.Tensor, ...]) -> None:
        """The shared output buffers, shaped as a warm-up's outputs, made at the first capture since ``clear``."""
        if self._out is None:
            self._out = tuple(torch.empty(self.runner.max_num_seqs, *t.shape[1:], dtype=t.dtype, device=t.device)
                              for t in warm)

    def _write(self, rows: int, width: int) -> None:
        """The captured step: ``_step`` into the first ``rows`` rows of the shared buffers."""
        # the step's own outputs go back to the pool when the capture ends, for the next capture's use
        for buf, t in zip(self._out, self._step(rows, width), strict=True):
            buf[:rows].copy_(t)

    def _capture(self, rows: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        dev = self.runner.device
        # the engine's device, not the thread's current one: streams, the graph and its pool belong to it
        with torch.cuda.device(dev):
            if self._stream is None:
                self._stream = torch.cuda.Stream(dev)
            # warm-up on the capture stream, as capture requires; its cache writes are the ones the replay makes
            self._stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self._stream):
                warm = self._step(rows, width)
            torch.cuda.current_stream(dev).wait_stream(self._stream)
            self._lay_out(warm)  # outside the graph's pool, on the engine's stream: they outlive every graph
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self._stream):
                self._write(rows, width)
        self.pool = graph.pool()
        self.captures += 1
        return graph, self._out[0][:rows]
