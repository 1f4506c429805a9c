"""Run the checkpoint engine across N local worker processes, each with its own inference process.

This is the weight-update path without the RL loop around it: N checkpoint-engine workers (one
torch.distributed group) own disjoint shards of a parameter set, and each worker's inference
process maps that worker's IPC buffers and loads what its sharding needs. A scenario is a list
of steps (updates, failures, replica restarts, catch-up, start-up from disk); the benchmark and
the tests use it, and every byte crosses real process boundaries.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from checkpoint_engine.buckets import BucketPlan, Piece, TensorSpec, as_bytes, plan_buckets
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.startup import SafetensorsShare, assign_files, checkpoint_files, read_index
from checkpoint_engine.transfer import WeightReceiver
from checkpoint_engine.update import free_port


def _dtype(name: str) -> torch.dtype:
    """The torch dtype a ``TensorSpec`` names (``spec_of`` writes it without the "torch." prefix)."""
    return getattr(torch, name)


def _el(dtype: str) -> int:
    return _dtype(dtype).itemsize


def synthetic_params(total_bytes: int, dtype: str = "bfloat16", width: int = 4096) -> list[TensorSpec]:
    """A model-like parameter set: [rows, width] matrices plus float32 norm vectors, ~total_bytes."""
    el, specs, used, i = _el(dtype), [], 0, 0
    while used < total_bytes:
        rows = max(1, min(width, (total_bytes - used) // (width * el)))
        specs.append(TensorSpec(f"layers.{i}.weight", (rows, width), dtype, rows * width * el))
        specs.append(TensorSpec(f"layers.{i}.norm", (width,), "float32", width * 4))
        used += rows * width * el + width * 4
        i += 1
    return specs


def make_tensor(spec: TensorSpec, version: int = 1) -> torch.Tensor:
    """Deterministic random bits for a parameter at a version (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{spec.name}@{version}".encode()))
    t = torch.empty(spec.shape, dtype=_dtype(spec.dtype))
    as_bytes(t).copy_(torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g))
    return t


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(as_bytes(t.contiguous()).numpy().tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Sharding:
    """Which rows of each 2-D parameter an inference engine keeps (tensor parallel on dim 0)."""

    rank: int = 0
    size: int = 1

    def rows(self, n: int) -> tuple[int, int]:
        per = -(-n // self.size)
        return min(n, self.rank * per), min(n, (self.rank + 1) * per)


class ShardedWeights:
    """An inference engine's weights under a sharding, and the per-parameter load hook into them."""

    def __init__(self, specs: list[TensorSpec], sharding: Sharding) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.ranges: dict[str, tuple[int, int]] = {}
        for s in specs:
            two_d = len(s.shape) == 2
            row_bytes = _el(s.dtype) * (s.shape[1] if two_d else 1)
            lo, hi = sharding.rows(s.shape[0]) if two_d else (0, s.shape[0])
            shape = (hi - lo, s.shape[1]) if two_d else s.shape
            self.tensors[s.name] = torch.zeros(shape, dtype=_dtype(s.dtype))
            self.ranges[s.name] = (lo * row_bytes, hi * row_bytes)

    def hook(self, piece: Piece) -> list[tuple[int, int, int]]:
        """Bytes of ``piece`` inside this shard: (offset in the shard, lo, hi) in the piece."""
        lo, hi = self.ranges[piece.name]
        a, b = max(lo, piece.start), min(hi, piece.start + piece.length)
        return [(a - lo, a - piece.start, b - piece.start)] if a < b else []

    def rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


def expected_digests(specs: list[TensorSpec], sharding: Sharding, version: int) -> dict[str, str]:
    """What an inference engine with ``sharding`` must hold after update ``version`` (0: zeros)."""
    out = {}
    for s in specs:
        t = make_tensor(s, version) if version else torch.zeros(s.shape, dtype=_dtype(s.dtype))
        if len(s.shape) == 2:
            t = t[slice(*sharding.rows(s.shape[0]))]
        out[s.name] = digest(t)
    return out


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


def answer_load(recv: WeightReceiver, conn, msg: tuple) -> None:
    """Apply a ("load", bucket, buffer, version) message and answer it as ``PipeReloader`` expects."""
    try:
        recv.load(msg[1], msg[2], msg[3])
        conn.send(("ack", msg[1]))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", msg[1]))


def _inference_main(conn, specs, sharding: Sharding, plan: BucketPlan, handles, threads: int,
                    rollback: str | None) -> None:
    """An inference engine's process: starts empty (zeros) and loads what the engine sends."""
    torch.set_num_threads(threads)
    weights = ShardedWeights(specs, sharding)
    recv = WeightReceiver(plan, handles, weights.tensors, weights.hook, rollback, on_commit=weights.rebind)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the worker died mid-update: fall back to the previous weights
            recv.rollback()
            return
        if msg[0] == "load":
            answer_load(recv, conn, msg)
        elif msg[0] == "plan":  # start-up reads the checkpoint's own layout
            recv.plan = msg[1]
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
    ``rank`` restarts empty), "catch_up" (only replica ``rank`` loads version), "startup" (read
    the checkpoint at ``path`` from disk and load every replica).
    """

    kind: str
    version: int = 0
    rank: int = -1
    path: str = ""


class _FailingShare(dict):
    """A worker's tensors where one is missing (``fail``) or whose lookup kills the process (``crash``)."""

    def __init__(self, tensors: dict, name: str, crash: bool) -> None:
        super().__init__(tensors)
        self.name, self.crash = name, crash

    def __contains__(self, key: object) -> bool:
        if key == self.name and self.crash:
            os._exit(3)
        return key != self.name and super().__contains__(key)


def _worker_main(rank: int, world: int, init: str, specs: list[TensorSpec], owners: dict[str, int],
                 bucket_bytes: int, name: str, sharding: Sharding, steps: list[Step], result, threads: int,
                 rollback: str | None) -> None:
    torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    out: dict = {"times": [], "errors": {}, "reads": {}}
    infer, conn = None, None
    try:
        plan = plan_buckets(specs, bucket_bytes, owners)
        engine = CheckpointEngine(rank, world, init, bucket_bytes, name)

        def start_inference():
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_inference_main, args=(child, specs, sharding, plan, engine.ipc_handles(), threads,
                                                                       rollback))
            p.start()
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
            step_plan = plan
            if step.kind == "startup":  # the files' owners read them; the plan follows the files
                index = read_index(checkpoint_files(step.path))
                file_owner = assign_files(index, world)
                step_plan = plan_buckets([spec for _, spec in index.values()], bucket_bytes,
                                         {n: file_owner[f] for n, (f, _) in index.items()})
                own: dict | SafetensorsShare = SafetensorsShare(index, [f for f, w in file_owner.items() if w == rank])
                conn.send(("plan", step_plan))
            else:
                own = {s.name: make_tensor(s, step.version) for s in specs if owners[s.name] == rank}
            if step.kind in ("fail", "crash") and rank == step.rank:
                # the tensor of this worker that starts latest: buckets before it get loaded first
                first = [p for k in range(len(plan.buckets)) if plan.owners[k] == rank
                         for p in plan.buckets[k] if p.start == 0]
                own = _FailingShare(own, first[-1].name, step.kind == "crash")
            loads = reloader if step.kind != "catch_up" or rank == step.rank else None
            torch.distributed.barrier()
            t0 = time.perf_counter()
            try:
                engine.update(step_plan, own, step.version, loads)
            except Exception as e:
                out["errors"][i] = f"{type(e).__name__}: {e}"
                if step.kind == "crash":
                    break
            torch.distributed.barrier()
            out["times"].append(time.perf_counter() - t0)
            if isinstance(own, SafetensorsShare):
                out["reads"] = dict(own.reads)
                conn.send(("plan", plan))
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


@dataclass
class LocalRun:
    """Per step, the slowest worker's time; per worker, what it recorded and its replica's state."""

    update_s: list[float]
    results: dict[int, dict] = field(default_factory=dict)


def run_scenario(specs: list[TensorSpec], world: int, bucket_bytes: int, steps: list[Step], *,
                 shard_inference: bool = False, threads: int = 1, rollback: str | None = None,
                 timeout_s: float = 600) -> LocalRun:
    """Run ``steps`` on ``world`` workers; parameter owners are round-robin, as a sharded trainer
    would hold them, and replica r keeps rows shard r of ``world`` if ``shard_inference``."""
    owners = {s.name: i % world for i, s in enumerate(specs)}
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    init, name = f"tcp://127.0.0.1:{free_port()}", f"cke-{os.getpid()}-{free_port()}"
    procs = [ctx.Process(target=_worker_main,
                         args=(r, world, init, specs, owners, bucket_bytes, name,
                               Sharding(r, world) if shard_inference else Sharding(), steps, result, threads,
                               rollback))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.time() + timeout_s
    try:
        while len(results) < world and time.time() < deadline:
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
        for f in Path("/dev/shm").glob(f"{name}-*"):  # buffers of a worker that died
            f.unlink(missing_ok=True)
    fatal = {r: res["fatal"] for r, res in results.items() if "fatal" in res}
    if fatal:
        raise RuntimeError("; ".join(f"worker {r}: {e}" for r, e in sorted(fatal.items())))
    done = [r for r in results.values() if r["times"]]
    n = min((len(r["times"]) for r in done), default=0)
    return LocalRun([max(r["times"][i] for r in done) for i in range(n)], results)


def save_checkpoint(specs: list[TensorSpec], version: int, directory: str | Path, files: int) -> list[Path]:
    """Write the parameters at ``version`` as ``files`` safetensors shards (a model directory)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        part = {s.name: make_tensor(s, version) for s in specs[i::files]}
        paths.append(d / f"model-{i + 1:05d}-of-{files:05d}.safetensors")
        save_file(part, str(paths[-1]))
    return paths
