"""Rank processes that form a gloo group on loopback, for the tests of sharded code."""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness.ranks import rank_context, rank_process


def run_ranks(target: Callable, out_dir: Path, *args, world: int = 2, timeout_s: float = 300) -> list:
    """Run ``target(rank, world, port, out_dir, *args)`` in ``world`` processes (forked with torch loaded); each writes
    ``rank{r}.pt`` (or ``rank{r}.err`` with its traceback). Returns what the ranks saved, in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    procs = [rank_process(ctx, target, (r, world, port, str(out_dir), *args)) for r in range(world)]
    [p.start() for p in procs]
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():  # a hung collective: fail rather than wait forever
            p.kill()
            p.join()
    errors = "\n".join(e.read_text() for e in sorted(Path(out_dir).glob("*.err")))
    assert all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


@contextmanager
def rank_body(rank: int, out_dir: str | Path) -> Iterator[None]:
    """The body of one spawned rank: a failure leaves its traceback in ``rank{r}.err`` for ``run_ranks`` to
    show, and the process group is destroyed however the body ends."""
    try:
        yield
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
