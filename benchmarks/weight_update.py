"""Weight-update benchmark: checkpoint-engine update time against the machine's copy floor.

    python -m benchmarks.weight_update --json                 # 1 GiB bf16, 2 workers
    python -m benchmarks.weight_update --workers 1 2 4 --bucket-mb 16 64 256   # a sweep
    python -m benchmarks.weight_update --fp8 --json           # FP8 replicas (owners quantise)
    python -m benchmarks.weight_update --engine vllm --json   # into vLLM (benchmarks.weight_update_vllm)
    python -m benchmarks.weight_update --lora 8 --json        # LoRA rank 8 against full (benchmarks.weight_update_lora)

N checkpoint-engine worker processes own round-robin shares of a model-like parameter set; each
has its own inference process that maps the IPC buffers and loads every parameter (or its row
shard with ``--shard-inference``). The workers of a node share their IPC buffers (``--nodes``
splits them into that many nodes, joined by gloo). ``update_s`` is the median over ``--repeats``
updates after a first, cold one (reported as ``first_update_s``), from the start barrier to the last
replica's commit. ``floor_s`` is the minimal sequence of plain copies the bytes must make, timed at
this machine's single-stream memcpy bandwidth measured in the same run:

    stage (1 pass) + deliver to every other node (nodes - 1) + load into the replicas (sum of shares)

The copy is timed ``--floor-repeats`` times, half before and half after the updates; ``floor_s``
is the median and ``floor_spread`` (max - min) / median says how much the machine moved meanwhile.
``ratio_all_cores`` divides by a floor timed with a copy on every core instead, the stricter view
when the pipeline's copies overlap. After the updates the last replica restarts empty and copies
replica 0's weights point to point: ``catch_up_s`` (floor: one pack and one load, plus a delivery
between nodes). ``bitwise_equal`` compares every replica's tensors with the reference, by digest.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.harness.ranks import Sharding, Step, run_scenario, shard_digests, synthetic_params
from benchmarks.harness.synthetic import SyntheticModel
from engines.model.native.fp8 import quantize


def copy_seconds(threads: int, nbytes: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` copies of ``nbytes`` by ``threads`` threads, beyond the caches."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    torch.set_num_threads(before)
    return out


def quantize_gb_per_s(nbytes: int = 64 << 20) -> float:
    """bf16 bytes per second that the reference block quantisation turns into FP8 on this CPU."""
    w = torch.randn(nbytes // 2 // 4096, 4096).to(torch.bfloat16)
    quantize(w)
    t0 = time.perf_counter()
    quantize(w)
    return nbytes / (time.perf_counter() - t0) / 1e9


def measure(gib: float, workers: int, bucket_mb: int, *, dtype: str = "bfloat16", repeats: int = 3,
            shard_inference: bool = False, rollback: str | None = None, nodes: int = 1, fp8: bool = False,
            floor_repeats: int = 20, probe_bytes: int = 256 << 20) -> dict:
    """One benchmark point; returns the JSON record."""
    specs = synthetic_params(int(gib * (1 << 30)), dtype)
    model = SyntheticModel(tuple(specs), workers, fp8=fp8)
    plan = model.plan(bucket_mb << 20)
    nbytes = sum(s.nbytes for s in specs)
    wire = sum(t.nbytes for t in plan.tensors.values())
    one, every = [], []
    for half in range(2):
        if half:
            steps = [Step("update", v) for v in range(1, repeats + 2)]
            catch_up = workers > 1
            if catch_up:
                steps += [Step("restart", rank=workers - 1), Step("catch_up", rank=workers - 1, peer=0)]
            run = run_scenario(specs, workers, bucket_mb << 20, steps, shard_inference=shard_inference,
                               rollback=rollback, nodes=nodes, fp8=fp8)
        one += copy_seconds(1, probe_bytes, floor_repeats // 2)
        every += copy_seconds(os.cpu_count() or 1, probe_bytes, floor_repeats // 2)
    errors = {r: res["errors"] for r, res in run.results.items() if res["errors"]}
    if errors:
        raise RuntimeError(f"update failed: {errors}")
    final = repeats + 1
    ref = model.reference(final)
    equal = all(res["digests"] == shard_digests(ref, Sharding(r, workers) if shard_inference else Sharding())
                and res["version"] == final for r, res in run.results.items())
    load_passes = 1 if shard_inference else workers
    passes = 1 + (nodes - 1) + load_passes
    floors = sorted(passes * wire * t / probe_bytes for t in one)
    floor_s = statistics.median(floors)
    updates = run.update_s[1:final]
    update_s = statistics.median(updates)
    rec = {"update_s": round(update_s, 6), "floor_s": round(floor_s, 6), "ratio": round(update_s / floor_s, 3),
           "floor_spread": round((floors[-1] - floors[0]) / floor_s, 3), "floor_min_s": round(floors[0], 6),
           "floor_max_s": round(floors[-1], 6), "floor_repeats": len(floors),
           "bytes": nbytes, "wire_bytes": wire, "gb_per_s": round(nbytes / update_s / 1e9, 3), "bitwise_equal": equal,
           "first_update_s": round(run.update_s[0], 4),
           "update_spread": round((max(updates) - min(updates)) / update_s, 3),
           "workers": workers, "nodes": nodes, "bucket_mb": bucket_mb, "buckets": len(plan.buckets), "dtype": dtype,
           "fp8": fp8, "shard_inference": shard_inference, "rollback": rollback or "swap", "floor_passes": passes,
           "copy_gb_per_s": round(probe_bytes / statistics.median(one) / 1e9, 3),
           "ratio_all_cores": round(update_s / (passes * wire * statistics.median(every) / probe_bytes), 3),
           "copy_gb_per_s_all_cores": round(probe_bytes / statistics.median(every) / 1e9, 3), "repeats": repeats}
    if workers > 1:
        # the catch-up moves one replica's bytes: packed once, delivered between nodes if apart, loaded once
        catch_floor = (2 + (1 if nodes > 1 else 0)) * wire * statistics.median(one) / probe_bytes
        rec.update(catch_up_s=round(run.update_s[-1], 4), catch_up_ratio=round(run.update_s[-1] / catch_floor, 3))
    if fp8:
        rec["quantize_gb_per_s_cpu"] = round(quantize_gb_per_s(), 3)
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.weight_update", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="parameter bytes, in GiB (default 1)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="replica dtype (default bfloat16; float32 with --engine vllm, where tokens compare exactly)")
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="checkpoint-engine workers (several: a sweep)")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[16], help="bucket MiB (several: a sweep)")
    ap.add_argument("--repeats", type=int, default=5, help="timed updates after the cold one")
    ap.add_argument("--floor-repeats", type=int, default=20,
                    help="timed copies for the floor (half before the updates, half after)")
    ap.add_argument("--nodes", type=int, default=1, help="split the workers into this many nodes (gloo between them)")
    ap.add_argument("--fp8", action="store_true", help="replicas hold block-FP8 matrices; owners quantise")
    ap.add_argument("--shard-inference", action="store_true", help="replica r loads only row shard r of N")
    ap.add_argument("--rollback", choices=["swap", "journal", "none"], default=None,
                    help="how replicas keep the previous weights during an update (default swap on CPU)")
    ap.add_argument("--json", action="store_true", help="print only JSON records, one per line")
    ap.add_argument("--engine", choices=["native", "vllm"], default="native",
                    help="the replicas: synthetic tensors as the native engine loads them (default), or one vLLM "
                         "engine on a saved model (--vllm-model, --dtype, --bucket-mb, --repeats apply)")
    ap.add_argument("--vllm-model", default="100m", help="with --engine vllm: small or 100m (default)")
    ap.add_argument("--lora", type=int, metavar="RANK", help="a LoRA update of this rank against a full one on the "
                    "same model, at the native replica (--lora-model, --dtype, --repeats apply)")
    ap.add_argument("--lora-model", default="100m", choices=["demo", "100m"],
                    help="with --lora: the quick-start model (demo) or the ~88 M one (100m, default)")
    args = ap.parse_args(argv)
    if args.lora is not None:
        from benchmarks.weight_update_lora import measure_lora

        if args.lora < 1:
            ap.error("--lora RANK must be at least 1")
        rec = measure_lora(args.lora_model, args.lora, args.dtype or "bfloat16", args.repeats)
        if not args.json:
            print(f"{rec['model']} rank {rec['rank']}: full {rec['full_bytes']:,} B in {rec['full_s']:.4f} s, LoRA "
                  f"{rec['lora_bytes']:,} B ({rec['bytes_ratio']:.2%}) in {rec['lora_s']:.4f} s", flush=True)
        print(json.dumps(rec), flush=True)
        return
    if args.engine == "vllm":
        from benchmarks.weight_update_vllm import measure_vllm

        for b in args.bucket_mb:
            print(json.dumps(measure_vllm(args.vllm_model, b, dtype=args.dtype or "float32", repeats=args.repeats,
                                          floor_repeats=args.floor_repeats)), flush=True)
        return
    if args.gib <= 0 or min(args.workers) < 1 or min(args.bucket_mb) < 1 or args.repeats < 1 or \
            args.floor_repeats < 2 or not 1 <= args.nodes <= min(args.workers):
        ap.error("--gib must be > 0, --workers, --bucket-mb, --repeats at least 1, --floor-repeats at least 2 and "
                 "--nodes between 1 and the fewest workers")
    records: list[dict] = []
    for w in args.workers:
        for b in args.bucket_mb:
            rec = measure(args.gib, w, b, dtype=args.dtype or "bfloat16", repeats=args.repeats,
                          shard_inference=args.shard_inference, rollback=args.rollback, nodes=args.nodes,
                          fp8=args.fp8, floor_repeats=args.floor_repeats)
            records.append(rec)
            if args.json:
                print(json.dumps(rec), flush=True)
            else:
                print(f"workers {w}  bucket {b:>4} MiB  update {rec['update_s']:.3f} s  floor {rec['floor_s']:.3f} s "
                      f"(spread {rec['floor_spread']:.2f})  ratio {rec['ratio']:.2f}  {rec['gb_per_s']:.2f} GB/s  "
                      f"bitwise_equal {rec['bitwise_equal']}", flush=True)
    if not args.json:
        print(json.dumps(records[-1]))


if __name__ == "__main__":
    main()
