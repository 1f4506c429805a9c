"""Weight-update benchmark on one GPU: pinned host parameters, H2D buffer, CUDA IPC buffers.

    python -m benchmarks.weight_update_cuda --gib 4 --bucket-mb 256 1024 --json

One trainer process runs the checkpoint engine (world 1, NCCL) on parameters held in pinned host
memory, as an offloaded trainer holds them, so stage 1 is the H2D copy. One inference process maps
the engine's two IPC buffers through CUDA IPC handles and loads every parameter into its own
device tensors (journalling the bytes it overwrites unless ``--rollback none``). ``update_s`` is
the median of the timed updates after a cold one, until the last bucket is loaded. ``floor_s`` is
the bytes at this GPU's pinned host-to-device bandwidth, measured in the same run: every byte must
cross PCIe once. ``bitwise_equal`` compares the inference tensors' digests with the trainer's.
The last line printed is one JSON object per point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

from checkpoint_engine.buckets import as_bytes, plan_buckets
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.local import PipeReloader, answer_load, digest, synthetic_params
from checkpoint_engine.transfer import WeightReceiver
from checkpoint_engine.update import free_port


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


def _host_versions(specs, n: int = 2) -> list[dict[str, torch.Tensor]]:
    """``n`` sets of random parameter bytes in pinned host memory (drawn on the GPU: fast)."""
    sets = []
    for v in range(n):
        g = torch.Generator(device="cuda").manual_seed(v)
        out = {}
        for s in specs:
            host = torch.empty(s.shape, dtype=getattr(torch, s.dtype), pin_memory=True)
            as_bytes(host).copy_(torch.randint(0, 256, (s.nbytes,), dtype=torch.uint8, device="cuda", generator=g))
            out[s.name] = host
        sets.append(out)
    return sets


def measure(gib: float, bucket_mb: int, repeats: int = 3, rollback: str = "journal") -> dict:
    """One benchmark point; returns the JSON record."""
    specs = synthetic_params(int(gib * (1 << 30)))
    nbytes = sum(s.nbytes for s in specs)
    sets = _host_versions(specs)
    probe = min(nbytes, 1 << 30)
    h2d = _bandwidth(torch.empty(probe, dtype=torch.uint8, pin_memory=True),
                     torch.empty(probe, dtype=torch.uint8, device="cuda"))
    d2d = _bandwidth(torch.empty(probe, dtype=torch.uint8, device="cuda"),
                     torch.empty(probe, dtype=torch.uint8, device="cuda"))
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    engine = CheckpointEngine(0, 1, f"tcp://127.0.0.1:{free_port()}", bucket_mb << 20, "bench-cuda", device="cuda")
    buffers = torch.cuda.memory_allocated() - before
    plan = plan_buckets(specs, bucket_mb << 20)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, specs, plan, engine.ipc_handles(), rollback))
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
    want = {n: digest(t) for n, t in sets[(repeats + 1) % 2].items()}
    update_s = statistics.median(times[1:])
    floor_s = nbytes / h2d
    return {"update_s": round(update_s, 4), "floor_s": round(floor_s, 4), "ratio": round(update_s / floor_s, 3),
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
    ap.add_argument("--json", action="store_true", help="print only JSON records, one per line")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.weight_update_cuda needs a CUDA GPU (see benchmarks.weight_update for CPU)")
    for rollback in args.rollback:
        for mb in args.bucket_mb:
            rec = measure(args.gib, mb, args.repeats, rollback)
            if not args.json:
                print(f"{rec['bytes'] / 2**30:.1f} GiB, bucket {mb} MiB, rollback {rollback}: "
                      f"{rec['update_s']:.3f} s ({rec['gb_per_s']} GB/s), floor {rec['floor_s']:.3f} s "
                      f"(H2D {rec['h2d_gb_per_s']} GB/s), ratio {rec['ratio']}, bitwise {rec['bitwise_equal']}")
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
