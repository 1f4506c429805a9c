"""Weight-update benchmark on one GPU: pinned host parameters, H2D buffer, CUDA IPC buffers.

    python -m benchmarks.weight_update_cuda --gib 4 --bucket-mb 256 1024 --json

One trainer process runs the checkpoint engine (world 1, NCCL) on parameters held in pinned host
memory, as an offloaded trainer holds them, so stage 1 is the H2D copy. One inference process maps
the engine's two IPC buffers through CUDA IPC handles and loads every parameter into its own
device tensors (journalling the bytes it overwrites unless ``--rollback none``; the journal runs
on a side stream one bucket ahead). ``update_s`` is the median of the timed updates after a cold
one, until the last bucket is loaded. ``floor_s`` is the bytes at this GPU's pinned host-to-device
bandwidth, measured in the same run: every byte must cross PCIe once. ``bitwise_equal`` compares
the inference tensors' digests with the trainer's (with ``--weights fp8``: with the reference block
quantisation of the trainer's bf16 weights, which the owner computes on the GPU while staging;
``wire_bytes`` is then about half of ``bytes``, and ``quantize_gb_per_s`` is the reference
quantisation's rate on this GPU, bf16 bytes in per second). The last line printed is one JSON
object per point.

    python -m benchmarks.weight_update_cuda --gib 8 --bucket-mb 1024 --rollback journal none --weights bf16 fp8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

from checkpoint_engine.buckets import as_bytes
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.local import PipeReloader, answer_load, digest, synthetic_params
from checkpoint_engine.synthetic import SyntheticModel
from checkpoint_engine.topology import free_port
from checkpoint_engine.transfer import WeightReceiver
from engines.model.fp8 import quantize


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


def _receiver(conn, specs, plan, handles, rollback: str) -> None:
    """The inference process: zeros on the device, then whatever the updates bring."""
    targets = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device="cuda") for s in specs}
    recv = WeightReceiver(plan, handles, targets, rollback=rollback)
    while True:
        msg = conn.recv()
        if msg[0] == "load":
            answer_load(recv, conn, msg)
        elif msg[0] == "digests":
            conn.send(("digests", {n: digest(t.cpu()) for n, t in recv.tensors.items()}, recv.version,
                       torch.cuda.max_memory_allocated()))
        elif msg[0] == "stop":
            return


def _host_versions(specs, n: int = 2, finite: bool = False) -> list[dict[str, torch.Tensor]]:
    """``n`` sets of parameters in pinned host memory (drawn on the GPU: fast): random bytes, or normal
    values with ``finite`` (what quantisation needs)."""
    sets = []
    for v in range(n):
        g = torch.Generator(device="cuda").manual_seed(v)
        out = {}
        for s in specs:
            host = torch.empty(s.shape, dtype=getattr(torch, s.dtype), pin_memory=True)
            if finite:
                host.copy_(torch.randn(s.shape, device="cuda", generator=g) * 0.05)
            else:
                as_bytes(host).copy_(torch.randint(0, 256, (s.nbytes,), dtype=torch.uint8, device="cuda",
                                                   generator=g))
            out[s.name] = host
        sets.append(out)
    return sets


def _reference(specs, tensors: dict[str, torch.Tensor], fp8: bool) -> dict[str, str]:
    """Digests of what the replica must hold: the tensors, or their block quantisation (computed on the GPU)."""
    want = {}
    for s in specs:
        t = tensors[s.name]
        if fp8 and t.ndim == 2:
            q, sc = quantize(t.cuda())
            want[s.name], want[s.name + "_scale_inv"] = digest(q.cpu()), digest(sc.cpu())
        else:
            want[s.name] = digest(t)
    return want


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


def measure(gib: float, bucket_mb: int, repeats: int = 3, rollback: str = "journal", fp8: bool = False) -> dict:
    """One benchmark point; returns the JSON record."""
    specs = synthetic_params(int(gib * (1 << 30)))
    nbytes = sum(s.nbytes for s in specs)
    sets = _host_versions(specs, finite=fp8)
    probe = min(nbytes, 1 << 30)
    h2d = _bandwidth(torch.empty(probe, dtype=torch.uint8, pin_memory=True),
                     torch.empty(probe, dtype=torch.uint8, device="cuda"))
    d2d = _bandwidth(torch.empty(probe, dtype=torch.uint8, device="cuda"),
                     torch.empty(probe, dtype=torch.uint8, device="cuda"))
    torch.cuda.empty_cache()
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
        for version in range(1, repeats + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.update(plan, sets[version % 2], version, reloader)
            times.append(time.perf_counter() - t0)
        parent.send(("digests",))
        _, got, got_version, receiver_peak = parent.recv()
        parent.send(("stop",))
    finally:
        proc.join(timeout=120)
        engine.close()
    want = _reference(specs, sets[(repeats + 1) % 2], fp8)
    update_s = statistics.median(times[1:])
    floor_s = wire / h2d
    extra = {"quantize_gb_per_s": round(quantize_gb_per_s(), 1)} if fp8 else {}
    return {"update_s": round(update_s, 4), "floor_s": round(floor_s, 4), "ratio": round(update_s / floor_s, 3),
            "weights": "fp8" if fp8 else "bf16", "wire_bytes": wire, **extra,
            "bytes": nbytes, "gb_per_s": round(nbytes / update_s / 1e9, 2), "bitwise_equal": got == want and
            got_version == repeats + 1, "first_update_s": round(times[0], 4), "bucket_mb": bucket_mb,
            "buckets": len(plan.buckets), "workers": 1, "rollback": rollback, "h2d_gb_per_s": round(h2d / 1e9, 2),
            "d2d_gb_per_s": round(d2d / 1e9, 1), "engine_device_buffers_mib": round(buffers / 2**20, 1),
            "receiver_peak_device_mib": round(receiver_peak / 2**20, 1), "repeats": repeats,
            "device": torch.cuda.get_device_name()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.weight_update_cuda", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="parameter bytes, in GiB (default 4)")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 1024], help="bucket MiB (several: a sweep)")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates after the cold one")
    ap.add_argument("--rollback", choices=["journal", "none"], nargs="+", default=["journal"],
                    help="how the inference side keeps the previous weights until commit")
    ap.add_argument("--weights", choices=["bf16", "fp8"], nargs="+", default=["bf16"],
                    help="replica weights: bf16, or block-FP8 quantised by the owner on the GPU")
    ap.add_argument("--json", action="store_true", help="print only JSON records, one per line")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.weight_update_cuda needs a CUDA GPU (see benchmarks.weight_update for CPU)")
    for weights in args.weights:
        for rollback in args.rollback:
            for mb in args.bucket_mb:
                _point(args, mb, rollback, weights == "fp8")


def _point(args, mb: int, rollback: str, fp8: bool) -> None:
    rec = measure(args.gib, mb, args.repeats, rollback, fp8)
    if not args.json:
        print(f"{rec['bytes'] / 2**30:.1f} GiB {rec['weights']}, bucket {mb} MiB, rollback {rollback}: "
              f"{rec['update_s']:.3f} s ({rec['gb_per_s']} GB/s), floor {rec['floor_s']:.3f} s "
              f"(H2D {rec['h2d_gb_per_s']} GB/s), ratio {rec['ratio']}, bitwise {rec['bitwise_equal']}")
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
