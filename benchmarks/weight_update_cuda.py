"""Weight-update benchmark on one GPU: pinned host parameters, H2D buffer, CUDA IPC buffers.

    python -m benchmarks.weight_update_cuda --gib 4 --bucket-mb 256 1024 --json

One trainer process runs the checkpoint engine (world 1, NCCL) on parameters held in pinned host
memory, as an offloaded trainer holds them, so stage 1 is the H2D copy. One inference process maps
the engine's two IPC buffers through CUDA IPC handles and loads every parameter into its own
device tensors (journalling the bytes it overwrites unless ``--rollback none``; the journal runs
on a side stream one bucket ahead). ``update_s`` is the median of the timed updates after a cold
one, until the last bucket is loaded. ``floor_s`` is the trainer's bytes (``source_bytes``: what
stage 1 copies) at this GPU's pinned host-to-device bandwidth, measured in the same run: every one
of them must cross PCIe once. ``bitwise_equal`` compares the inference tensors' digests with the
trainer's.

``--weights`` picks what the trainer holds and what the replica gets (``--gib`` is the replica's bytes):
``bf16`` both; ``fp32-to-bf16`` float32 master weights cast to a bf16 replica on the way (sent as
float32 and cast on the GPU: ``source_bytes`` is twice ``wire_bytes``; the replica must equal the
host's own ``to(torch.bfloat16)``); ``fp8`` bf16 weights block-quantised by the owner on the GPU
(compared with the reference quantisation; ``wire_bytes`` is about half, ``quantize_gb_per_s`` is the
reference quantisation's rate, bf16 bytes in per second). Progress goes to stderr as it happens; the
last line on stdout is one JSON object per point.

    python -m benchmarks.weight_update_cuda --gib 16 --bucket-mb 1024 --repeats 2 --weights bf16 fp32-to-bf16 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.multiprocessing as mp

from benchmarks import timing
from benchmarks.harness.ranks import PipeReloader, answer_load, digest, synthetic_params
from benchmarks.harness.synthetic import SyntheticModel
from checkpoint_engine.buckets import ALIGN, TensorSpec
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.sinks import TensorSink
from checkpoint_engine.topology import free_port
from checkpoint_engine.transfer import WeightReceiver
from engines.device import host_buffer
from engines.model.native.fp8 import quantize

WEIGHTS = ("bf16", "fp32-to-bf16", "fp8")


def say(msg: str) -> None:
    """One progress line on stderr (``benchmarks.timing.say``)."""
    timing.say("weight_update_cuda", msg)


def _bandwidth(src: torch.Tensor, dst: torch.Tensor, tries: int = 5) -> float:
    """Bytes per second of ``dst.copy_(src)``, best of ``tries``, timed with CUDA events."""
    dst.copy_(src)
    best = float("inf")
    for _ in range(tries):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / best


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Digests of (the host copies of) ``tensors``, hashed on every core."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(tensors, pool.map(lambda t: digest(t.cpu()), tensors.values()), strict=True))


def _receiver(conn, specs, plan, handles, rollback: str) -> None:
    """The inference process: zeros on the device, then whatever the updates bring."""
    targets = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device="cuda") for s in specs}
    recv = WeightReceiver(plan, handles, TensorSink(targets, rollback=rollback))
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "load":
            answer_load(recv, conn, msg)
        elif msg[0] == "digests":
            conn.send(("digests", _digests(recv.tensors), recv.version, torch.cuda.max_memory_allocated()))
        elif msg[0] == "stop":
            return


def source_dtype(spec: TensorSpec, weights: str) -> torch.dtype:
    """The dtype the trainer holds ``spec`` in: float32 masters with ``fp32-to-bf16``, else the replica's."""
    return torch.float32 if weights == "fp32-to-bf16" else getattr(torch, spec.dtype)


def _fill(slab: torch.Tensor, weights: str, chunk: int = 1 << 30) -> None:
    """Random bytes (bf16: every bit pattern), or normal values in the sources' dtype (a cast or a
    quantisation needs finite ones), drawn on the GPU a chunk at a time."""
    g = torch.Generator(device="cuda").manual_seed(0)
    finite = {"fp32-to-bf16": torch.float32, "fp8": torch.bfloat16}.get(weights)
    for lo in range(0, slab.numel(), chunk):
        n = min(chunk, slab.numel() - lo)
        if finite is None:
            part = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        else:
            part = (torch.randn(n // finite.itemsize, device="cuda", generator=g) * 0.05).to(finite).view(torch.uint8)
        slab[lo : lo + n].copy_(part)


def host_versions(specs: list[TensorSpec], weights: str) -> list[dict[str, torch.Tensor]]:
    """Two versions of the trainer's parameters: views of one pinned host slab of the exact size, ``ALIGN``
    bytes apart (different values, half the pinned memory of two sets, one registration)."""
    dtypes = [source_dtype(s, weights) for s in specs]
    sizes = [torch.Size(s.shape).numel() * d.itemsize for s, d in zip(specs, dtypes, strict=True)]
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    t0 = time.perf_counter()
    slab = host_buffer(at + ALIGN)
    say(f"pinned {slab.numel() / 2**30:.2f} GiB of host memory in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    _fill(slab, weights)
    say(f"filled it from the GPU in {time.perf_counter() - t0:.1f} s")
    return [{s.name: slab[o + v * ALIGN : o + v * ALIGN + n].view(d).view(s.shape)
             for s, d, o, n in zip(specs, dtypes, offsets, sizes, strict=True)} for v in range(2)]


def _reference(specs: list[TensorSpec], tensors: dict[str, torch.Tensor], weights: str) -> dict[str, str]:
    """Digests of what the replica must hold: the tensors cast on the host to the replica's dtype, or
    their block quantisation (computed on the GPU)."""
    def one(s: TensorSpec) -> dict[str, str]:
        t = tensors[s.name]
        if weights == "fp8" and t.ndim == 2:
            q, sc = quantize(t.cuda())
            return {s.name: digest(q.cpu()), s.name + "_scale_inv": digest(sc.cpu())}
        return {s.name: digest(t.to(getattr(torch, s.dtype)))}

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return {k: v for d in pool.map(one, specs) for k, v in d.items()}


def quantize_gb_per_s(nbytes: int = 1 << 30) -> float:
    """bf16 bytes per second the reference block quantisation turns into FP8 on this GPU."""
    w = torch.randn(nbytes // 2 // 7168, 7168, device="cuda").to(torch.bfloat16)
    quantize(w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    quantize(w)
    end.record()
    end.synchronize()
    return nbytes / (start.elapsed_time(end) / 1e3) / 1e9


def _probe() -> tuple[float, float]:
    """(pinned host-to-device, device-to-device) bytes per second, over 1 GiB."""
    probe = 1 << 30
    host = host_buffer(probe)
    h2d = _bandwidth(host, torch.empty(probe, dtype=torch.uint8, device="cuda"))
    d2d = _bandwidth(torch.empty(probe, dtype=torch.uint8, device="cuda"),
                     torch.empty(probe, dtype=torch.uint8, device="cuda"))
    torch.cuda.empty_cache()
    return h2d, d2d


def measure(gib: float, bucket_mb: int, repeats: int = 3, rollback: str = "journal", weights: str = "bf16") -> dict:
    """One benchmark point; returns the JSON record."""
    fp8 = weights == "fp8"
    specs = synthetic_params(int(gib * (1 << 30)))
    nbytes = sum(s.nbytes for s in specs)
    say(f"{weights}, bucket {bucket_mb} MiB, rollback {rollback}: {len(specs)} tensors, {nbytes / 2**30:.2f} GiB")
    sets = host_versions(specs, weights)
    source = sum(t.numel() * t.element_size() for t in sets[0].values())
    h2d, d2d = _probe()
    say(f"H2D {h2d / 1e9:.1f} GB/s, D2D {d2d / 1e9:.0f} GB/s")
    before = torch.cuda.memory_allocated()
    engine = CheckpointEngine(0, 1, f"tcp://127.0.0.1:{free_port()}", bucket_mb << 20, "bench-cuda", device="cuda")
    buffers = torch.cuda.memory_allocated() - before
    plan = SyntheticModel(tuple(specs), 1, fp8=fp8).plan(bucket_mb << 20)
    wire = sum(t.nbytes for t in plan.tensors.values())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, list(plan.tensors.values()), plan, engine.ipc_handles(),
                                               rollback))
    proc.start()
    reloader = PipeReloader(parent)
    times = []
    try:
        if parent.recv() != ("ready",):
            raise RuntimeError("the inference process did not start")
        say(f"engine and inference process up ({len(plan.buckets)} buckets)")
        for version in range(1, repeats + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.update(plan, sets[version % 2], version, reloader)
            times.append(time.perf_counter() - t0)
            say(f"update {version}/{repeats + 1}: {times[-1]:.3f} s" + (" (cold)" if version == 1 else ""))
        parent.send(("digests",))
        _, got, got_version, receiver_peak = parent.recv()
        say("replica's digests taken")
        parent.send(("stop",))
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
        engine.close()
    want = _reference(specs, sets[(repeats + 1) % 2], weights)
    say("reference digests taken")
    update_s = statistics.median(times[1:])
    floor_s = source / h2d
    extra = {"quantize_gb_per_s": round(quantize_gb_per_s(), 1)} if fp8 else {}
    return {"update_s": round(update_s, 4), "floor_s": round(floor_s, 4), "ratio": round(update_s / floor_s, 3),
            "weights": weights, "wire_bytes": wire, "source_bytes": source, **extra,
            "bytes": nbytes, "gb_per_s": round(nbytes / update_s / 1e9, 2), "bitwise_equal": got == want and
            got_version == repeats + 1, "first_update_s": round(times[0], 4), "bucket_mb": bucket_mb,
            "buckets": len(plan.buckets), "workers": 1, "rollback": rollback, "h2d_gb_per_s": round(h2d / 1e9, 2),
            "d2d_gb_per_s": round(d2d / 1e9, 1), "engine_device_buffers_mib": round(buffers / 2**20, 1),
            "receiver_peak_device_mib": round(receiver_peak / 2**20, 1), "repeats": repeats,
            "device": torch.cuda.get_device_name()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.weight_update_cuda", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="the replica's parameter bytes, in GiB (default 4)")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 1024], help="bucket MiB (several: a sweep)")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates after the cold one")
    ap.add_argument("--rollback", choices=["journal", "none"], nargs="+", default=["journal"],
                    help="how the inference side keeps the previous weights until commit")
    ap.add_argument("--weights", choices=WEIGHTS, nargs="+", default=["bf16"],
                    help="bf16; fp32-to-bf16: float32 masters cast on the GPU; fp8: block-FP8 quantised on the GPU")
    ap.add_argument("--json", action="store_true", help="print only JSON records, one per line")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.weight_update_cuda needs a CUDA GPU (see benchmarks.weight_update for CPU)")
    for weights in args.weights:
        for rollback in args.rollback:
            for mb in args.bucket_mb:
                _point(args, mb, rollback, weights)


def _point(args, mb: int, rollback: str, weights: str) -> None:
    rec = measure(args.gib, mb, args.repeats, rollback, weights)
    if not args.json:
        print(f"{rec['bytes'] / 2**30:.1f} GiB {rec['weights']}, bucket {mb} MiB, rollback {rollback}: "
              f"{rec['update_s']:.3f} s ({rec['gb_per_s']} GB/s), floor {rec['floor_s']:.3f} s "
              f"(H2D {rec['h2d_gb_per_s']} GB/s), ratio {rec['ratio']}, bitwise {rec['bitwise_equal']}")
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
