"""Point-to-point weight update between two processes (``checkpoint_engine.p2p``) against the copy floor, and the
planner's prediction (``checkpoint_engine.cost_p2p``) against the measured time.

    python -m benchmarks.p2p_update                     # 512 MiB bf16, 64 MiB buckets, shared memory and wire
    python -m benchmarks.p2p_update --mb 256 --repeats 3

A trainer-rank process sends every bucket to a replica in this process, which loads it into its spare copy
(``WeightReceiver.defer_commit``) and then swaps it in. ``update_s`` is the median over ``--repeats`` updates after a
cold one, from the command to the replica's last load; ``swap_s`` the swap that follows (the replica's pause).

``floor_s`` is the minimal sequence of plain copies the bytes must make, at this machine's single-stream memcpy rate
measured in the same run (as ``benchmarks.weight_update`` defines it): over shared memory the sender's staging copy
and the replica's load (2 passes); over the wire, as between nodes, also the delivery (3 passes). ``ratio`` is
``update_s / floor_s``. The prediction takes the copy and checksum rates measured here for staging and loading and,
for the wire, the rate of one raw transfer of the same bytes over the same link. The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

from benchmarks.weight_update import copy_seconds
from checkpoint_engine.buckets import TensorSpec, plan_buckets
from checkpoint_engine.cost_p2p import Rates, predict_p2p
from checkpoint_engine.p2p import DATA, P2PReceiver, P2PSender
from checkpoint_engine.sinks import TensorSink
from checkpoint_engine.transfer import WeightReceiver

TENSORS = 32


def specs(total_mb: int) -> list[TensorSpec]:
    """``TENSORS`` bf16 matrices of ``total_mb`` MiB in all."""
    rows = (total_mb << 20) // TENSORS // 2 // 1024
    return [TensorSpec(f"layer{i}.weight", (rows, 1024), "bfloat16", rows * 1024 * 2) for i in range(TENSORS)]


def weights(spec: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """The sender's weights, made again by the replica to check what it serves."""
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in spec}


def _sender(spec: list[TensorSpec], bucket: int, shm: bool, out, cmds) -> None:
    torch.set_num_threads(1)
    plan = plan_buckets(spec, bucket)
    sender = P2PSender(0, bucket, f"p2pbench-{os.getpid()}", shm=shm)
    out.put(sender.endpoint)
    sender.connect(0, shared=shm)
    tensors = weights(spec)
    raw = torch.ones(sum(s.nbytes for s in spec), dtype=torch.uint8)
    for cmd in iter(cmds.get, None):
        if cmd == "raw":
            sender.links[0].isend(raw, DATA).wait()
        else:
            sender.update(plan, tensors, cmd)
        out.put("done")
    sender.close()


def measure(total_mb: int, bucket_mb: int, shm: bool, repeats: int) -> dict:
    """One sender process and a replica here: the update's time, its floor, and the planner's prediction."""
    torch.set_num_threads(1)
    spec, bucket = specs(total_mb), bucket_mb << 20
    nbytes = sum(s.nbytes for s in spec)
    plan = plan_buckets(spec, bucket)
    ctx = mp.get_context("spawn")
    out, cmds = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender, args=(spec, bucket, shm, out, cmds), daemon=True)
    proc.start()
    p2p = P2PReceiver(plan)
    p2p.connect(0, out.get(timeout=120), replica=0)
    receiver = WeightReceiver(plan, [], TensorSink({s.name: torch.zeros(s.shape, dtype=torch.bfloat16)
                                                     for s in spec}))
    receiver.defer_commit = True
    floors = copy_seconds(1, nbytes, 3)
    times, swaps = [], []
    for version in range(1, repeats + 2):
        t = time.perf_counter()
        cmds.put(version)
        p2p.receive(plan, version, receiver)
        times.append(time.perf_counter() - t)
        out.get(timeout=120)
        t = time.perf_counter()
        receiver.commit_staged(version)
        swaps.append(time.perf_counter() - t)
    link_s = None
    if not shm:  # the link's own rate: one raw transfer of the same bytes
        got = torch.empty(nbytes, dtype=torch.uint8)
        t = time.perf_counter()
        cmds.put("raw")
        p2p.links[0].irecv(got, DATA).wait()
        link_s = time.perf_counter() - t
        out.get(timeout=120)
    cmds.put(None)
    proc.join(60)
    floors += copy_seconds(1, nbytes, 3)
    copy_s = statistics.median(floors)
    update_s = statistics.median(times[1:])
    copy_rate = nbytes / copy_s
    words = torch.ones(nbytes // 8, dtype=torch.int64)
    t = time.perf_counter()
    words.sum()
    sum_rate = nbytes / (time.perf_counter() - t)
    rates = Rates(stage=copy_rate, link=nbytes / link_s if link_s else copy_rate, load=copy_rate, message_s=0.0,
                  checksum=sum_rate)
    predicted = predict_p2p(nbytes, 1, 1, 1, bucket, rates, shared=shm)
    floor_s = copy_s * (2 if shm else 3)
    return {"bench": "p2p_update", "channel": "shared memory" if shm else "wire (gloo)", "mb": total_mb,
            "bucket_mb": bucket_mb, "buckets": len(plan.buckets), "first_update_s": _seconds(times[0]),
            "update_s": _seconds(update_s), "swap_s": round(statistics.median(swaps[1:]), 6),
            "copy_gbps": round(copy_rate / 1e9, 3), "checksum_gbps": round(sum_rate / 1e9, 3),
            "link_gbps": round(nbytes / link_s / 1e9, 3) if link_s else None,
            "floor_s": _seconds(floor_s), "ratio": round(update_s / floor_s, 3),
            "predicted_s": _seconds(predicted.total_s), "predicted_bound": predicted.bound,
            "predicted_error": round((predicted.total_s - update_s) / update_s, 3),
            "bitwise_equal": all(torch.equal(receiver.tensors[n], t) for n, t in weights(spec).items()),
            "cpus": os.cpu_count()}


def _seconds(x: float) -> float:
    """Four significant figures: a 2 ms update rounded to 4 decimals would be off by 2 %."""
    return float(f"{x:.4g}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.p2p_update", description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="MiB of bf16 weights (default 512)")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--channel", choices=["shm", "wire", "both"], default="both")
    a = ap.parse_args(argv)
    records = [measure(a.mb, a.bucket_mb, shm, a.repeats) for shm in
               ((True, False) if a.channel == "both" else (a.channel == "shm",))]
    for rec in records[:-1]:
        print(json.dumps(rec), flush=True)
    print(json.dumps(records[-1]), flush=True)


if __name__ == "__main__":
    main()
