"""CUDA graphs of the inference engine's decode step.

A decode step of a small batch is a few hundred tiny kernels: on a GPU their launches, not the
arithmetic, set the pace. One graph per (batch bucket, attention width bucket) replays the whole
step with one launch. A graph reads the model runner's persistent state (last tokens, positions, block
tables, the KV pool, the weights) in place; rows past the running batch are padding, pointed before
each replay at position 0 of the engine's scratch block (which no sequence is given), so their key and
value writes never land in a live sequence's blocks. Only decode-only steps replay a graph (a step with
prefill chunks runs eagerly). Graphs are captured on first use and kept while the memory they point at
stays: the engine's weights and pool live in arenas whose addresses survive sleep; they are dropped
when an address moves (weights rebound to other tensors, no arena on this device). Capture runs on the
engine's device and on a stream of it, whatever device is current on the calling thread. If a capture
fails, the engine decodes eagerly from then on (same tokens, slower) after one warning, and its
``stats()`` say so (``cuda_graphs_fallback``).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engines.inference.model_runner import ModelRunner
    from engines.model.native.arch import ModelConfig

log = logging.getLogger(__name__)

MIN_WIDTH = 64  # the smallest attention-width bucket (tokens)


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


class DecodeGraphs:
    """Captured decode steps of one engine's model runner, keyed by (batch bucket, width bucket)."""

    def __init__(self, runner: ModelRunner) -> None:
        # a weak reference: no cycle, so a dropped engine gives its KV pool and graph pool back at once
        self.runner = weakref.proxy(runner)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self._where: tuple[int, ...] = ()
        self._stream: torch.cuda.Stream | None = None  # capture stream, on the engine's device
        self.captures = 0  # over the engine's life (tests and benchmarks read it)
        self.failed: str | None = None  # why a capture failed: the engine then decodes eagerly

    def clear(self) -> None:
        """Drop every graph and the memory pool they share."""
        self.graphs.clear()
        self.pool = None

    def logits(self, n: int, width: int) -> torch.Tensor:
        """Next-token logits [n, V] of decoding rows 0..n-1 whose longest sequence has ``width`` tokens,
        as the eager decode step computes them."""
        e = self.runner
        where = self._addresses()
        if where != self._where:
            self.clear()
            self._where = where
        key = (bucket(n, e.max_num_seqs), bucket(width, e.max_blocks * e.block_size, MIN_WIDTH))
        if key[0] > n:  # padding rows hold whatever rows finished there last: send them to the scratch block
            e.block_table[n: key[0]].fill_(e.scratch_block)
            e.pos[n: key[0]].zero_()
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(*key)
            except Exception as err:
                self._give_up(err)
                return e.decode_logits(n, width)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n]

    def _addresses(self) -> tuple[int, ...]:
        e = self.runner
        kv = e.cache()
        # buffers too: FP8 weights and their scales are buffers, and RoPE tables move with the model
        weights = itertools.chain(e.model.parameters(), e.model.buffers())
        return (e.last.data_ptr(), e.pos.data_ptr(), e.block_table.data_ptr(), kv.k.data_ptr(),
                kv.v.data_ptr() if kv.v is not None else 0, *(t.data_ptr() for t in weights))

    def _give_up(self, err: Exception) -> None:
        """Drop every graph and decode eagerly from now on, saying so once."""
        self.clear()
        self.failed = f"{type(err).__name__}: {err}".splitlines()[0]
        log.warning("CUDA graph capture failed on %s (%s); decoding eagerly from now on", self.runner.device,
                    self.failed)

    def _capture(self, rows: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        dev = self.runner.device
        # the engine's device, not the thread's current one: streams, the graph and its pool belong to it
        with torch.cuda.device(dev):
            if self._stream is None:
                self._stream = torch.cuda.Stream(dev)
            # warm-up on the capture stream, as capture requires; its cache writes are the ones the replay makes
            self._stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self._stream):
                self.runner.decode_logits(rows, width)
            torch.cuda.current_stream(dev).wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self._stream):
                out = self.runner.decode_logits(rows, width)
        self.pool = graph.pool()
        self.captures += 1
        return graph, out
