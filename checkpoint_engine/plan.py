"""Predict a weight update's time on a cluster from the two-stage pipeline's cost model.

    python -m checkpoint_engine.plan                       # Kimi K2 on H800 (report figures)
    python -m checkpoint_engine.plan --nodes 64 --bucket-gib 1 --calibration bench.jsonl

The model, per GPU (one checkpoint-engine worker each), for B parameter bytes on W = nodes x G:
  h2d        B / W over PCIe, synchronous (stage 1: every worker stages its own share)
  broadcast  every GPU receives all of B: over NVLink inside a node, and each node's missing
             (nodes-1)/nodes of B over its G NICs; the slower of the two
  reload     each inference GPU copies its shard of every bucket from the IPC buffer (HBM)
  steps      one synchronisation per pipeline step of W buckets
Stage 2 overlaps broadcast and reload, so
  total = (h2d + max(broadcast, reload)) / efficiency + steps x step latency.
``efficiency`` (how close the pipeline gets to its bandwidth bounds) and the step latency are
calibrated from the weight-update benchmark's JSON records when given; otherwise the printed
defaults are assumptions and say so.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """Per-GPU bandwidths in GB/s (1e9 bytes per second), one direction."""

    nodes: int = 32
    gpus_per_node: int = 8
    pcie_gbps: float = 54.6     # pinned host-to-device, measured on an H100 (PCIe Gen5 x16, 64 GB/s raw)
    nvlink_gbps: float = 200.0  # H800: 400 GB/s NVLink, bidirectional
    nic_gbps: float = 50.0      # 8 x 400 Gbps RoCE per node = 400 Gbps per GPU
    hbm_gbps: float = 1500.0    # bytes copied device-to-device per second, measured on an H100


@dataclass(frozen=True)
class Calibration:
    efficiency: float = 0.8     # achieved / bound
    step_latency_s: float = 1e-3
    source: str = "assumed (no benchmark figures given)"


@dataclass(frozen=True)
class Prediction:
    bytes: float
    workers: int
    buckets_per_worker: int
    h2d_s: float
    broadcast_s: float
    reload_s: float
    steps_s: float
    total_s: float
    bound: str
    why: str


def predict(params: float, bytes_per_param: float, cluster: Cluster, bucket_bytes: float, inference_gpus: int,
            cal: Calibration) -> Prediction:
    """The pipeline's cost model (see the module docstring)."""
    b = params * bytes_per_param
    w = cluster.nodes * cluster.gpus_per_node
    h2d = b / w / (cluster.pcie_gbps * GB)
    intra = b / (cluster.nvlink_gbps * GB)
    inter = b * (cluster.nodes - 1) / cluster.nodes / (cluster.gpus_per_node * cluster.nic_gbps * GB)
    broadcast = max(intra, inter)
    reload = b / inference_gpus / (cluster.hbm_gbps * GB)
    steps = -(-b // (w * bucket_bytes))
    stage2 = max(broadcast, reload)
    total = (h2d + stage2) / cal.efficiency + steps * cal.step_latency_s
    parts = {"h2d": h2d, "broadcast": broadcast, "reload": reload, "step latency": steps * cal.step_latency_s}
    bound = max(parts, key=lambda k: parts[k])
    if bound == "broadcast":
        link = "NVLink" if intra >= inter else "the inter-node NICs"
        why = (f"every GPU must receive all {b / 1e12:.2f} TB; {link} carries it at "
               f"{(cluster.nvlink_gbps if intra >= inter else cluster.gpus_per_node * cluster.nic_gbps):.0f} GB/s")
    elif bound == "h2d":
        why = f"each GPU stages {b / w / GB:.1f} GB over PCIe at {cluster.pcie_gbps:.0f} GB/s, not overlapped"
    elif bound == "reload":
        why = f"each inference GPU copies {b / inference_gpus / GB:.1f} GB inside HBM"
    else:
        why = f"{steps} pipeline steps of {cal.step_latency_s * 1e3:.2f} ms each; use larger buckets"
    return Prediction(b, w, int(steps), h2d, broadcast, reload, steps * cal.step_latency_s, total, bound, why)


def calibrate(records: list[dict]) -> Calibration:
    """Fit efficiency and per-step latency from benchmark records (one JSON object per line).

    Only the records with the most workers are used. On the benchmark's machine the bound is its
    copy floor, so efficiency = floor_s / update_s, taken from the largest bucket (least latency);
    the step latency is the least-squares slope of the time beyond that floor against the number
    of buckets (zero if smaller buckets were no slower).
    """
    if not records:
        raise ValueError("no benchmark records to calibrate from")
    # the engine's own rollback modes (swap on CPU, journal on GPU), not the "none" comparison runs
    records = [r for r in records if r.get("rollback", "swap") != "none"] or records
    most = max(r.get("workers", 1) for r in records)  # the most cluster-like: broadcast carries the most
    records = [r for r in records if r.get("workers", 1) == most]
    best = max(records, key=lambda r: r["bucket_mb"])
    eff = min(1.0, best["floor_s"] / best["update_s"])
    xs = [r["buckets"] for r in records]
    ys = [r["update_s"] - r["floor_s"] / eff for r in records]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    src = f"fitted to {len(records)} benchmark records with {most} workers"
    return Calibration(efficiency=eff, step_latency_s=max(slope, 0.0), source=src)


def load_records(path: str | Path) -> list[dict]:
    """JSON objects, one per line, as ``benchmarks.weight_update --json`` prints them."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON record ({e})") from e
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m checkpoint_engine.plan",
                                 description="Predict the checkpoint engine's update time on a cluster.")
    c = Cluster()
    ap.add_argument("--params", type=float, default=1.04e12, help="parameters (default: Kimi K2, 1.04e12)")
    ap.add_argument("--bytes-per-param", type=float, default=2.0, help="2 for bf16 (default)")
    ap.add_argument("--nodes", type=int, default=c.nodes)
    ap.add_argument("--gpus-per-node", type=int, default=c.gpus_per_node)
    ap.add_argument("--pcie-gbps", type=float, default=c.pcie_gbps, help="host-to-device GB/s per GPU")
    ap.add_argument("--nvlink-gbps", type=float, default=c.nvlink_gbps, help="NVLink GB/s per GPU, one way")
    ap.add_argument("--nic-gbps", type=float, default=c.nic_gbps, help="inter-node GB/s per GPU (400 Gbps = 50)")
    ap.add_argument("--hbm-gbps", type=float, default=c.hbm_gbps)
    ap.add_argument("--bucket-gib", type=float, default=2.0, help="bucket size per worker")
    ap.add_argument("--inference-gpus", type=int, default=16, help="GPUs one inference replica spans")
    ap.add_argument("--calibration", help="benchmark JSON lines to fit efficiency and step latency from")
    ap.add_argument("--target-s", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sizes = (a.params, a.bytes_per_param, a.nodes, a.gpus_per_node, a.pcie_gbps, a.nvlink_gbps, a.nic_gbps,
             a.hbm_gbps, a.bucket_gib, a.inference_gpus)
    if min(sizes) <= 0:
        ap.error("sizes, counts and bandwidths must be positive")
    cluster = Cluster(a.nodes, a.gpus_per_node, a.pcie_gbps, a.nvlink_gbps, a.nic_gbps, a.hbm_gbps)
    cal = calibrate(load_records(a.calibration)) if a.calibration else Calibration()
    p = predict(a.params, a.bytes_per_param, cluster, a.bucket_gib * (1 << 30), a.inference_gpus, cal)
    holds = p.total_s <= a.target_s
    if a.json:
        print(json.dumps({**asdict(p), "target_s": a.target_s, "holds": holds, "cluster": asdict(cluster),
                          "calibration": asdict(cal)}))
        return
    print(f"{a.params:.3g} parameters x {a.bytes_per_param:g} B = {p.bytes / 1e12:.2f} TB on {p.workers} GPUs "
          f"({a.nodes} nodes x {a.gpus_per_node}); bucket {a.bucket_gib:g} GiB, {p.buckets_per_worker} steps")
    print(f"  stage 1  h2d        {p.h2d_s:8.2f} s")
    print(f"  stage 2  broadcast  {p.broadcast_s:8.2f} s   (overlapped with reload)")
    print(f"           reload     {p.reload_s:8.2f} s")
    print(f"  steps    latency    {p.steps_s:8.2f} s")
    print(f"  efficiency {cal.efficiency:.2f}, step latency {cal.step_latency_s * 1e3:.2f} ms: {cal.source}")
    print(f"predicted update: {p.total_s:.1f} s; bound by {p.bound}: {p.why}")
    print(f"{a.target_s:g} s target {'holds' if holds else 'does NOT hold'} "
          f"({'margin' if holds else 'over by'} {abs(a.target_s - p.total_s):.1f} s)")


if __name__ == "__main__":
    main()
