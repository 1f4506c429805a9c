"""The trainer's side of a weight update in a child process, for an inference engine held in this one.

``ChildSender`` starts one checkpoint-engine worker (rank 0 of a group of one) in a spawned process. For
each update it reads the new weights from a directory of safetensors files and sends them through the
checkpoint engine's shared-memory IPC buffers, bucket by bucket, with its two-stage pipeline; this process
holds the inference engine and its ``WeightReceiver`` and answers each bucket as a rollout worker does.
``benchmarks.harness.ranks`` is the other way round (the replicas in child processes); this one serves
an engine whose start-up is slow (vLLM) and that a test or benchmark keeps for many updates. Faults are
injected in the child, after a bucket is staged: a flipped byte, or another version than the staged one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

from benchmarks.harness.ranks import PipeReloader, answer_load, stop_child
from checkpoint_engine.buckets import BucketPlan, TensorSpec, plan_buckets
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.sinks import WeightSink
from checkpoint_engine.topology import free_port
from checkpoint_engine.transfer import WeightReceiver
from engines.model.io.hf_io import read_tensors


class _FaultyReloader(PipeReloader):
    """A ``PipeReloader`` that damages bucket ``corrupt`` in its IPC buffer or announces ``claim`` as the
    update's version, after the checkpoint engine has staged it correctly."""

    def __init__(self, conn, buffers: list[torch.Tensor], corrupt: int | None, claim: int | None) -> None:
        super().__init__(conn)
        self.buffers, self.corrupt, self.claim = buffers, corrupt, claim

    def start(self, bucket: int, buffer: int, version: int) -> None:
        if bucket == self.corrupt:
            self.buffers[buffer][:1].bitwise_xor_(1)
        super().start(bucket, buffer, version if self.claim is None else self.claim)


def _sender_main(conn, init: str, name: str, plan: BucketPlan, threads: int) -> None:
    torch.set_num_threads(threads)
    engine = CheckpointEngine(0, 1, init, plan.bucket_bytes, name)
    try:
        conn.send(("handles", engine.ipc_handles()))
        while (msg := conn.recv())[0] == "update":
            _, directory, version, claim, corrupt = msg
            tensors = read_tensors(directory)  # read before the clock starts: the trainer holds its weights
            reloader = _FaultyReloader(conn, engine.ipc, corrupt, claim)
            error = None
            t0 = time.perf_counter()
            try:
                engine.update(plan, tensors, version, reloader)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            conn.send(("done", time.perf_counter() - t0, error))
    finally:
        engine.close()


class ChildSender:
    """A checkpoint-engine worker in a child process that sends updates of tensors ``specs`` (in this order,
    in buckets of ``bucket_bytes``) to receivers in this process through shared memory."""

    def __init__(self, specs: list[TensorSpec], bucket_bytes: int, *, threads: int = 1,
                 timeout_s: float = 120) -> None:
        self.plan = plan_buckets(specs, bucket_bytes)
        self.timeout_s = timeout_s
        self.name = f"cks-{os.getpid()}-{free_port()}"
        ctx = mp.get_context("spawn")  # a forked child would inherit this process's threads mid-flight
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sender_main, daemon=True,
                                args=(child, f"tcp://127.0.0.1:{free_port()}", self.name, self.plan, threads))
        self.proc.start()
        self.handles = self._recv("handles")[1]

    def receiver(self, sink: WeightSink) -> WeightReceiver:
        """A receiver of this sender's buckets into ``sink`` (``checkpoint_engine.sinks``)."""
        return WeightReceiver(self.plan, self.handles, sink)

    def update(self, receiver: WeightReceiver, directory: str | Path, version: int, *, claim: int | None = None,
               corrupt: int | None = None) -> tuple[float, str | None]:
        """Send the weights in ``directory`` as update ``version`` and load them with ``receiver``; returns the
        sender's seconds from its first bucket to the last acknowledgement, and its error (None: it went
        through). ``corrupt``: flip a byte of that bucket; ``claim``: announce that version instead."""
        self.conn.send(("update", str(directory), version, claim, corrupt))
        while True:
            msg = self._recv()
            if msg[0] == "load":
                answer_load(receiver, self.conn, msg)
            elif msg[0] == "abort":
                self.conn.send(("aborted", receiver.rollback()))
            elif msg[0] == "done":
                return msg[1], msg[2]

    def _recv(self, kind: str | None = None) -> tuple:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the checkpoint-engine worker said nothing for {self.timeout_s} s")
        msg = self.conn.recv()
        if kind is not None and msg[0] != kind:
            raise RuntimeError(f"checkpoint-engine worker: expected {kind!r}, got {msg!r}")
        return msg

    def close(self) -> None:
        """Stop the worker and remove its shared memory."""
        stop_child(self.conn, self.proc, self.name)

    def __enter__(self) -> ChildSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
