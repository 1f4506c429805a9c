"""Weight-update benchmark: checkpoint-engine update time against the machine's copy floor.

    python -m benchmarks.weight_update --json                 # 1 GiB bf16, 2 workers
    python -m benchmarks.weight_update --workers 1 2 4 --bucket-mb 16 64 256   # a sweep

N checkpoint-engine worker processes own round-robin shares of a model-like parameter set; each
has its own inference process that maps its IPC buffers and loads every parameter (or its row
shard with ``--shard-inference``). ``update_s`` is the median over ``--repeats`` updates after a
first, cold one (reported as ``first_update_s``), from the start barrier to the last replica's
commit. ``floor_s`` is the minimal sequence of plain copies the bytes must make, timed at this
machine's single-stream memcpy bandwidth measured in the same run:

    stage (1 pass) + deliver to every other worker (N - 1) + load into the replicas (sum of shares)

``ratio_all_cores`` is the same ratio against a floor timed with a copy using every core, the
stricter view when the pipeline's copies overlap. ``bitwise_equal`` compares every replica's
tensors with the trainer's, by digest. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from checkpoint_engine.local import Sharding, Step, expected_digests, run_scenario, synthetic_params


def copy_bandwidth(threads: int = 1, nbytes: int = 256 << 20, tries: int = 5) -> float:
    """Bytes per second of a copy by ``threads`` threads, best of ``tries``, beyond the caches."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(before)
    return nbytes / best


def measure(gib: float, workers: int, bucket_mb: int, *, dtype: str = "bfloat16", repeats: int = 3,
            shard_inference: bool = False, rollback: str | None = None) -> dict:
    """One benchmark point; returns the JSON record."""
    specs = synthetic_params(int(gib * (1 << 30)), dtype)
    nbytes = sum(s.nbytes for s in specs)
    bw, bw_all = copy_bandwidth(1), copy_bandwidth(os.cpu_count() or 1)
    steps = [Step("update", v) for v in range(1, repeats + 2)]
    run = run_scenario(specs, workers, bucket_mb << 20, steps, shard_inference=shard_inference, rollback=rollback)
    errors = {r: res["errors"] for r, res in run.results.items() if res["errors"]}
    if errors:
        raise RuntimeError(f"update failed: {errors}")
    final = len(steps)
    expected: dict[Sharding, dict[str, str]] = {}  # unsharded replicas all expect the same digests
    equal = True
    for r, res in run.results.items():
        sharding = Sharding(r, workers) if shard_inference else Sharding()
        if sharding not in expected:
            expected[sharding] = expected_digests(specs, sharding, final)
        equal = equal and res["digests"] == expected[sharding] and res["version"] == final
    load_passes = 1 if shard_inference else workers
    passes = 1 + (workers - 1) + load_passes
    update_s = statistics.median(run.update_s[1:])
    floor_s = passes * nbytes / bw
    return {"update_s": round(update_s, 4), "floor_s": round(floor_s, 4), "ratio": round(update_s / floor_s, 3),
            "bytes": nbytes, "gb_per_s": round(nbytes / update_s / 1e9, 3), "bitwise_equal": equal,
            "first_update_s": round(run.update_s[0], 4), "workers": workers, "bucket_mb": bucket_mb,
            "buckets": run.results[0]["buckets"], "dtype": dtype, "shard_inference": shard_inference,
            "rollback": rollback or "swap", "floor_passes": passes, "copy_gb_per_s": round(bw / 1e9, 3),
            "ratio_all_cores": round(update_s / (passes * nbytes / bw_all), 3),
            "copy_gb_per_s_all_cores": round(bw_all / 1e9, 3), "repeats": repeats}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.weight_update", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="parameter bytes, in GiB (default 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="checkpoint-engine workers (several: a sweep)")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[16], help="bucket MiB (several: a sweep)")
    ap.add_argument("--repeats", type=int, default=5, help="timed updates after the cold one")
    ap.add_argument("--shard-inference", action="store_true", help="replica r loads only row shard r of N")
    ap.add_argument("--rollback", choices=["swap", "journal", "none"], default=None,
                    help="how replicas keep the previous weights during an update (default swap on CPU)")
    ap.add_argument("--json", action="store_true", help="print only JSON records, one per line")
    args = ap.parse_args(argv)
    if args.gib <= 0 or min(args.workers) < 1 or min(args.bucket_mb) < 1 or args.repeats < 1:
        ap.error("--gib must be > 0 and --workers, --bucket-mb, --repeats at least 1")
    records: list[dict] = []
    for w in args.workers:
        for b in args.bucket_mb:
            rec = measure(args.gib, w, b, dtype=args.dtype, repeats=args.repeats,
                          shard_inference=args.shard_inference, rollback=args.rollback)
            records.append(rec)
            if args.json:
                print(json.dumps(rec), flush=True)
            else:
                print(f"workers {w}  bucket {b:>4} MiB  update {rec['update_s']:.3f} s  floor {rec['floor_s']:.3f} s  "
                      f"ratio {rec['ratio']:.2f}  {rec['gb_per_s']:.2f} GB/s  bitwise_equal {rec['bitwise_equal']}",
                      flush=True)
    if not args.json:
        print(json.dumps(records[-1]))

if __name__ == "__main__":
    main()
