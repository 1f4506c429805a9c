"""Run the checkpoint engine across N local worker processes, each with its own inference process.

This is the weight-update path without the RL loop around it: N checkpoint-engine workers (one
torch.distributed group) own disjoint shards of a parameter set, and each worker's inference
process maps that worker's IPC buffers and loads what its sharding needs. A scenario is a list
of steps (updates, failures, replica restarts, catch-up, start-up from disk); the benchmark and
the tests use it, and every byte crosses real process boundaries.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.harness.synthetic import (  # noqa: F401  (the harness's public names)
    ShardedWeights,
    Sharding,
    SyntheticModel,
    digest,
    expected_digests,
    make_tensor,
    save_checkpoint,
    shard_digests,
    synthetic_params,
)
from checkpoint_engine.buckets import BucketPlan, TensorSpec
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.sinks import TensorSink
from checkpoint_engine.startup import SafetensorsShare, ShardTap, plan_startup
from checkpoint_engine.topology import free_port
from checkpoint_engine.transfer import WeightReceiver

#: what the server that forks ranks imports once (a spawned rank spends seconds importing torch again)
RANK_PRELOAD = ["torch", "torch.distributed"]


def rank_context() -> mp.context.ForkServerContext:
    """Processes for ranks, forked from a server that has imported torch (nothing else: no threads, no CUDA)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def rank_process(ctx: mp.context.BaseContext, target, args: tuple) -> mp.process.BaseProcess:
    """A process running ``target(*args)`` in this process's environment and directory now, as a spawned one would
    (a forked server's children otherwise keep the server's, from when it started)."""
    return ctx.Process(target=_as_spawned, args=(dict(os.environ), os.getcwd(), target, args))


def _as_spawned(env: dict[str, str], cwd: str, target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


class PipeReloader:
    """Talks to a local inference process over a pipe; loads run in order, acks come in order."""

    def __init__(self, conn) -> None:
        self.conn, self.acked = conn, -1

    def start(self, bucket: int, buffer: int, version: int) -> None:
        if bucket == 0:
            self.acked = -1
        self.conn.send(("load", bucket, buffer, version))

    def wait(self, bucket: int) -> None:
        while self.acked < bucket:
            msg = self.conn.recv()
            if msg[0] == "error":
                self.acked = msg[2]
                raise RuntimeError(f"inference process: {msg[1]}")
            self.acked = msg[1]

    def abort(self, version: int) -> bool:
        """Ask the replica to roll back; True if it serves the previous weights again."""
        self.conn.send(("abort", version))
        while (msg := self.conn.recv())[0] != "aborted":
            pass
        return msg[1]

    def state(self) -> dict:
        self.conn.send(("state",))
        while (msg := self.conn.recv())[0] != "state":
            pass
        return msg[1]

    def pack(self, bucket: int, buffer: int) -> int:
        """Have the replica write bucket ``bucket`` of its weights into IPC buffer ``buffer``."""
        self.conn.send(("pack", bucket, buffer))
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"inference process: {msg[1]}")
        return msg[1]


def answer_load(recv: WeightReceiver, conn, msg: tuple) -> None:
    """Apply a ("load", bucket, buffer, version) message and answer it as ``PipeReloader`` expects."""
    try:
        recv.load(msg[1], msg[2], msg[3])
        conn.send(("ack", msg[1]))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", msg[1]))


def stop_child(conn, proc: mp.Process, shm_prefix: str) -> None:
    """Ask a child process to stop, kill it if it does not within 30 s, and remove the shared memory named
    ``shm_prefix-*`` it made (a child that died leaves its buffers)."""
    try:
        conn.send(("stop",))
    except OSError:
        pass
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
    for f in Path("/dev/shm").glob(f"{shm_prefix}-*"):
        f.unlink(missing_ok=True)


def _inference_main(conn, specs, sharding: Sharding, plan: BucketPlan, handles, threads: int,
                    rollback: str | None) -> None:
    """An inference engine's process: starts empty (zeros) and loads what the engine sends."""
    torch.set_num_threads(threads)
    weights = ShardedWeights(specs, sharding)
    recv = WeightReceiver(plan, handles, TensorSink(weights.tensors, weights.hook, rollback, on_commit=weights.rebind))
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the worker died mid-update: fall back to the previous weights
            recv.rollback()
            return
        if msg[0] == "load":
            answer_load(recv, conn, msg)
        elif msg[0] == "pack":
            try:
                conn.send(("packed", recv.pack(msg[1], msg[2])))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}", msg[1]))
        elif msg[0] == "plan":  # start-up reads the checkpoint's own layout
            recv.set_plan(msg[1])
        elif msg[0] == "abort":
            conn.send(("aborted", recv.rollback()))
        elif msg[0] == "state":
            conn.send(("state", {"digests": {n: digest(t) for n, t in weights.tensors.items()},
                                 "consistent": recv.consistent, "version": recv.version, "loads": recv.loads}))
        elif msg[0] == "stop":
            return


@dataclass(frozen=True)
class Step:
    """One step of a scenario, run by every worker.

    kind: "update" (all replicas load version), "fail" (worker ``rank`` cannot stage one of its
    later buckets), "crash" (worker ``rank`` dies mid-update; must be last), "restart" (replica
    ``rank`` restarts empty), "catch_up" (replica ``rank`` copies replica ``peer``'s weights, point
    to point; the other workers do nothing), "startup" (read the checkpoint at ``path`` from disk
    into every replica, and into each worker's rows of the trainer when ``trainer``).
    """

    kind: str
    version: int = 0
    rank: int = -1
    path: str = ""
    peer: int = -1
    trainer: bool = False


class _FailingShare(dict):
    """A worker's tensors where one is missing (``fail``) or whose lookup kills the process (``crash``)."""

    def __init__(self, tensors: dict, name: str, crash: bool) -> None:
        super().__init__(tensors)
        self.name, self.crash = name, crash

    def __contains__(self, key: object) -> bool:
        if key == self.name and self.crash:
            os._exit(3)
        return key != self.name and super().__contains__(key)


@dataclass(frozen=True)
class _Setup:
    model: SyntheticModel
    bucket_bytes: int
    name: str
    nodes: int
    shard_inference: bool
    threads: int
    rollback: str | None
    device: str = "cpu"  # "cuda": worker r's engine on GPU r (NCCL, CUDA IPC buffers)


def _worker_main(rank: int, init: str, setup: _Setup, steps: list[Step], result) -> None:
    torch.set_num_threads(setup.threads)
    ctx = rank_context()
    model, world = setup.model, setup.model.world
    out: dict = {"times": [], "errors": {}, "reads": {}}
    infer, conn = None, None
    sharding = Sharding(rank, world) if setup.shard_inference else Sharding()
    try:
        plan = model.plan(setup.bucket_bytes)
        device = torch.device("cuda", rank) if setup.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's barriers use the current device
        engine = CheckpointEngine(rank, world, init, setup.bucket_bytes, setup.name, device=str(device),
                                  node=f"node{rank * setup.nodes // world}")

        def start_inference():
            parent, child = ctx.Pipe()
            p = rank_process(ctx, _inference_main, (child, list(plan.tensors.values()), sharding, plan,
                                                    engine.ipc_handles(), setup.threads, setup.rollback))
            p.start()
            if parent.recv() != ("ready",):  # it has mapped the buffers
                raise RuntimeError("inference process did not start")
            return p, parent

        infer, conn = start_inference()
        reloader = PipeReloader(conn)
        for i, step in enumerate(steps):
            if step.kind == "restart":
                if rank == step.rank:
                    conn.send(("stop",))
                    infer.join()
                    infer, conn = start_inference()
                    reloader = PipeReloader(conn)
                continue
            if step.kind == "catch_up":  # only the two replicas' workers take part: no barrier
                t0 = time.perf_counter()
                try:
                    if rank == step.rank:
                        engine.catch_up(plan, step.peer, reloader)
                    elif rank == step.peer:
                        engine.serve_catch_up(plan, step.rank, reloader)
                except Exception as e:
                    out["errors"][i] = f"{type(e).__name__}: {e}"
                out["times"].append(time.perf_counter() - t0 if rank == step.rank else 0.0)
                continue
            step_plan, offsets, tap = plan, {}, None
            if step.kind == "startup":  # the files' owners read them; the plan follows the files
                step_plan, file_owner, index = plan_startup(step.path, world, setup.bucket_bytes, block=model.block)
                own: dict | SafetensorsShare = SafetensorsShare(index, [f for f, w in file_owner.items() if w == rank])
                conn.send(("plan", step_plan))
                if step.trainer:
                    tap = _trainer_rows(model, rank).bind(step_plan)
            else:
                own, offsets = model.sources(rank, step.version)
            if step.kind in ("fail", "crash") and rank == step.rank:
                # the tensor of this worker that starts latest: buckets before it get loaded first
                first = [p for k in range(len(plan.buckets)) if plan.owners[k] == rank
                         for p in plan.buckets[k] if p.start == 0 and p.name in own]
                own = _FailingShare(own, first[-1].name, step.kind == "crash")
            torch.distributed.barrier()
            t0 = time.perf_counter()
            try:
                engine.update(step_plan, own, step.version, reloader, offsets, tap=tap)
            except Exception as e:
                out["errors"][i] = f"{type(e).__name__}: {e}"
                if step.kind == "crash":
                    break
            torch.distributed.barrier()
            out["times"].append(time.perf_counter() - t0)
            if isinstance(own, SafetensorsShare):
                out["reads"] = dict(own.reads)
                conn.send(("plan", plan))
            if tap is not None:
                tap.finish()
                out["trainer"] = {n: digest(t) for n, t in tap.tensors.items()}
        out.update(reloader.state(), buckets=len(plan.buckets))
        conn.send(("stop",))
        engine.close()
    except Exception:
        out["fatal"] = traceback.format_exc()
    finally:
        result.put((rank, out))
        if infer is not None:
            infer.join(timeout=30)
            if infer.is_alive():
                infer.kill()


def _trainer_rows(model: SyntheticModel, rank: int) -> ShardTap:
    """A trainer's rows of every tensor, in float32, empty until start-up fills them."""
    tensors, offsets = model.sources(rank, 1)
    return ShardTap({n: torch.zeros_like(t, dtype=torch.float32) for n, t in tensors.items()}, offsets)


@dataclass
class LocalRun:
    """Per step, the slowest worker's time; per worker, what it recorded and its replica's state."""

    update_s: list[float]
    results: dict[int, dict] = field(default_factory=dict)


def run_ranks(target, args: list[tuple], shm_name: str, timeout_s: float) -> dict[int, dict]:
    """Start ``target(*args[r], queue)`` in one process per rank and collect the ``(rank, result)`` each
    puts on the queue, until all have or ``timeout_s`` passes (or every process died); then join (kill a stuck
    one) and remove the shared buffers named ``shm_name-*`` that a dead worker left in /dev/shm."""
    ctx = rank_context()
    result = ctx.Queue()
    procs = [rank_process(ctx, target, (*a, result)) for a in args]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.time() + timeout_s
    try:
        while len(results) < len(procs) and time.time() < deadline:
            try:
                rank, res = result.get(timeout=1)
                results[rank] = res
            except Exception:
                if all(not p.is_alive() for p in procs) and result.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for f in Path("/dev/shm").glob(f"{shm_name}-*"):
            f.unlink(missing_ok=True)
    return results


def run_scenario(specs: list[TensorSpec], world: int, bucket_bytes: int, steps: list[Step], *,
                 shard_inference: bool = False, threads: int = 1, rollback: str | None = None,
                 timeout_s: float = 600, nodes: int = 1, split_rows: bool = False, fp8: bool = False,
                 block: int = 128, device: str = "cpu") -> LocalRun:
    """Run ``steps`` on ``world`` workers; parameter owners are round-robin (or, with ``split_rows``,
    each matrix's rows split over all workers, as FSDP2 shards them); replica r keeps rows shard r of
    ``world`` if ``shard_inference``. ``nodes``: the workers form that many nodes (shared IPC buffers
    inside one, gloo between them). ``fp8``: the replicas hold block-FP8 matrices. ``device="cuda"``:
    worker r's buffers are on GPU r and the group is NCCL (the replicas still hold host tensors)."""
    setup = _Setup(SyntheticModel(tuple(specs), world, split_rows, fp8, block), bucket_bytes,
                   f"cke-{os.getpid()}-{free_port()}", nodes, shard_inference, threads, rollback, device)
    init = f"tcp://127.0.0.1:{free_port()}"
    results = run_ranks(_worker_main, [(r, init, setup, steps) for r in range(world)], setup.name, timeout_s)
    fatal = {r: res["fatal"] for r, res in results.items() if "fatal" in res}
    if fatal:
        raise RuntimeError("; ".join(f"worker {r}: {e}" for r, e in sorted(fatal.items())))
    done = [r for r in results.values() if r["times"]]
    n = min((len(r["times"]) for r in done), default=0)
    return LocalRun([max(r["times"][i] for r in done) for i in range(n)], results)
