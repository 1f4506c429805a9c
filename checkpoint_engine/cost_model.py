"""Predict a weight update's time and memory on a GPU cluster, calibrated on published measurements.

    rl plan-update                          # Kimi K2, FP8, 256 H800: time and memory
    rl plan-update --table                  # FP8/bf16 x replica layouts vs the 30 s target
    rl plan-update --validate               # the published runs, measured vs predicted
    rl plan-update --dtype bf16 --tp 32 --nodes 64 --bucket-gib 4

(the CLI lives in ``rl.setup.update_cost``: the run's own memory, the trainer's shard and the KV cache, is
the controller's model, ``rl.setup.memory``; it reaches this planner as a ``Footprint`` of plain numbers).

The cost model of the two-stage pipeline, for B bytes on W = nodes x G GPUs, TP GPUs per replica:
  h2d       B / W / PCIe                     stage 1: each GPU stages its share, synchronously
  deliver   max(B / r, B / NVLink, B (nodes-1)/nodes / (G NIC))
                                             stage 2: every GPU receives all of B; r is the per-GPU rate
                                             a broadcast + reload pipeline achieves (calibrated)
  reload    B / TP / HBM                     overlapped with deliver
  latency   ceil(B / bucket) x (W - 1) x hop one broadcast per bucket; its pipeline fills through
                                             W - 1 hops (calibrated)
  total = h2d + max(deliver, reload) + latency
``r`` and ``hop`` are fitted to MoonshotAI checkpoint-engine's two published Kimi K2 runs (FP8 on
16 and 256 H20, TP16); its four other published runs check the fit (``--validate``). Our engine
has the same structure (per-bucket NCCL broadcast into IPC buffers, then a reload), so its GPU
path is predicted with the same r and hop: an assumption until it is measured on a cluster.

Expert-parallel training (``trainer.expert_parallel``) changes none of these terms: each GPU still stages about
B / W (its trainer rank stores whole experts, at most ⌈E/W⌉ of a layer's E as under FSDP2's row shards, and sends
each one it stores, ``model_sender``), so it reaches this model only through the trainer's shard (the ``Footprint``).

Memory per GPU: the colocated trainer's shard and the KV cache (a ``Footprint``, given), the
replica's shard (bf16, or block-FP8 with its scales) and the engine's three buckets (H2D + two IPC)
from here. A layout that does not fit is refused, naming its largest part.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

GB, GiB = 1e9, 2**30


@dataclass(frozen=True)
class Gpu:
    """Per-GPU figures in GB/s (1e9 bytes/s, one direction) and usable memory in GiB."""

    name: str
    memory_gib: float
    nvlink_gbps: float
    pcie_gbps: float = 54.6    # pinned host-to-device, measured on an H100 (PCIe Gen5 x16, as H800 and H20)
    hbm_gbps: float = 1500.0   # bytes copied device-to-device per second, measured on an H100


GPUS = {
    # datasheets: NVLink 400 GB/s (H800) and 900 GB/s (H20) both directions; 80 and 96 GB of HBM, of
    # which CUDA shows about 99 % (79.2 GiB of an H100 80GB)
    "H800": Gpu("H800", 79.2, 200.0),
    "H20": Gpu("H20", 88.9, 450.0),
}


@dataclass(frozen=True)
class GpuCluster:
    gpu: Gpu
    nodes: int = 32
    gpus_per_node: int = 8
    nic_gbps: float = 50.0  # per GPU: 8 x 400 Gbps RoCE per node (the K2 report's H800 cluster)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Calibration:
    rate_gbps: float   # r: per-GPU delivery rate of broadcast + reload
    hop_s: float       # per rank and broadcast
    source: str


@dataclass(frozen=True, kw_only=True)
class Prediction:
    bytes: float
    gpus: int
    buckets: int
    h2d_s: float
    deliver_s: float
    reload_s: float
    latency_s: float
    total_s: float
    bound: str


def predict(nbytes: float, cluster: GpuCluster, tp: int, bucket_bytes: float, cal: Calibration) -> Prediction:
    """The pipeline's cost model (see the module docstring)."""
    w, g = cluster.gpus, cluster.gpu
    h2d = nbytes / w / (g.pcie_gbps * GB)
    links = {"delivery rate": nbytes / (cal.rate_gbps * GB), "NVLink": nbytes / (g.nvlink_gbps * GB),
             "the NICs": nbytes * (cluster.nodes - 1) / cluster.nodes / (cluster.gpus_per_node * cluster.nic_gbps * GB)}
    deliver = max(links.values())
    reload = nbytes / tp / (g.hbm_gbps * GB)
    buckets = math.ceil(nbytes / bucket_bytes)
    latency = buckets * (w - 1) * cal.hop_s
    parts = {"h2d": h2d, max(links, key=links.__getitem__): deliver, "reload": reload, "broadcast latency": latency}
    return Prediction(bytes=nbytes, gpus=w, buckets=buckets, h2d_s=h2d, deliver_s=deliver, reload_s=reload,
                      latency_s=latency, total_s=h2d + max(deliver, reload) + latency,
                      bound=max(parts, key=parts.__getitem__))


# ---- published runs and the calibration ---------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Run:
    """A published update: MoonshotAI checkpoint-engine's README (vLLM, broadcast mode)."""

    model: str
    nbytes: float
    gpus: int
    tp: int
    gpu: str
    bucket_gib: float
    seconds: float

    def predicted(self, cal: Calibration) -> Prediction:
        return predict(self.nbytes, GpuCluster(GPUS[self.gpu], self.gpus // 8), self.tp, self.bucket_gib * GiB, cal)


#: Bytes: Kimi K2 from its config (``K2_BYTES``; FP8 matrices, their scales, bf16 embeddings);
#: DeepSeek-V3.1 FP8 is the size of its checkpoint files (688.6 GB with the MTP layer); GLM-4.5-Air
#: (106 B parameters) and Qwen3-235B-A22B at 2 bytes a parameter.
PUBLISHED = (
    Run(model="Kimi-K2 FP8", nbytes=1.029173e12, gpus=16, tp=16, gpu="H20", bucket_gib=5.89, seconds=14.36),
    Run(model="Kimi-K2 FP8", nbytes=1.029173e12, gpus=256, tp=16, gpu="H20", bucket_gib=8.00, seconds=16.04),
    Run(model="DeepSeek-V3.1 FP8", nbytes=688.6e9, gpus=16, tp=16, gpu="H20", bucket_gib=5.39, seconds=10.19),
    Run(model="DeepSeek-V3.1 FP8", nbytes=688.6e9, gpus=256, tp=16, gpu="H20", bucket_gib=8.00, seconds=11.33),
    Run(model="GLM-4.5-Air BF16", nbytes=212e9, gpus=8, tp=8, gpu="H800", bucket_gib=3.02, seconds=3.47),
    Run(model="Qwen3-235B-A22B BF16", nbytes=470e9, gpus=8, tp=8, gpu="H800", bucket_gib=2.67, seconds=6.22),
)


def calibrate(runs: tuple[Run, ...] | list[Run]) -> Calibration:
    """Least-squares r and hop from measured runs (two or more): time - h2d = B / r + buckets (W-1) hop."""
    if len(runs) < 2:
        raise ValueError("calibration needs at least two measured runs")
    rows, ys = [], []
    for run in runs:
        h2d = run.nbytes / run.gpus / (GPUS[run.gpu].pcie_gbps * GB)
        rows.append([run.nbytes, math.ceil(run.nbytes / (run.bucket_gib * GiB)) * (run.gpus - 1)])
        ys.append(run.seconds - h2d)
    (inv_rate, hop), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    if inv_rate <= 0 or hop < 0:
        raise ValueError("the runs do not fit the model (a rate or latency came out negative)")
    names = ", ".join(f"{r.model} {r.gpus}x{r.gpu}" for r in runs)
    return Calibration(float(1 / inv_rate / GB), float(hop), f"fitted to {names}")


@cache
def k2_calibration() -> Calibration:
    """The default: fitted to the two published Kimi K2 runs."""
    return calibrate(PUBLISHED[:2])


# ---- model bytes and memory per GPU --------------------------------------------------------------

#: Kimi K2's architecture (its config.json); ``K2_BYTES``: its parameters and the bytes of a bf16 and of a
#: block-FP8 replica, from its shapes (tests/test_plan.py builds the model on meta and checks them)
K2_CONFIG = dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                 num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
                 n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                 routed_scaling_factor=2.827, max_position_embeddings=131072, bos_token_id=None, eos_token_id=None,
                 pad_token_id=None)
K2_BYTES = {"params": 1.026408209408e12, "bf16": 2.052817e12, "fp8": 1.029173e12}


def k2_arch():
    from engines.model.native.arch import make_config

    return make_config("kimi_k2", **K2_CONFIG)


@dataclass(frozen=True)
class Layout:
    """A replica layout: weights in ``dtype`` ("fp8" or "bf16"), ``tp`` GPUs per replica."""

    dtype: str
    tp: int
    nodes: int = 32
    bucket_gib: float | None = None  # None: the largest that fits (see ``plan``)


@dataclass(frozen=True)
class Memory:
    """GiB per GPU in the phase that needs most, by part."""

    parts: dict[str, float]
    limit: float

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def why(self) -> str:
        big = max(self.parts, key=self.parts.__getitem__)
        return (f"needs {self.total:.1f} GiB per GPU of {self.limit:.1f}; the largest part is {big} "
                f"({self.parts[big]:.1f} GiB)")


@dataclass(frozen=True)
class Footprint:
    """The run around the update, per GPU: its trainer's shard (weights, gradients, optimizer state) and
    KV cache in bytes; whether the trainer is offloaded while the engines generate, and how deep the
    replicas sleep while it trains (1: KV cache freed; 2: weights too)."""

    trainer_bytes: float
    kv_cache_bytes: float
    offload: bool = True
    sleep_level: int = 2


#: A run's footprint for a number of GPUs (the trainer's shard shrinks as they grow).
FootprintOf = Callable[[int], Footprint]


def memory(layout: Layout, cluster: GpuCluster, bucket_bytes: float, run: Footprint,
           model: dict[str, float] = K2_BYTES) -> Memory:
    """Memory per GPU of ``model`` in ``layout``: the larger of the rollout phase (replica shard, KV cache
    and the engine's buffers, during which updates happen) and the training phase. The replica's shard
    and the engine's buffers are this planner's; the trainer's shard and the KV cache are ``run``'s."""
    trainer, kv = run.trainer_bytes, run.kv_cache_bytes
    replica = model[layout.dtype] / layout.tp
    buffers = 3 * bucket_bytes  # H2D + two IPC buffers
    rollout = {"replica shard": replica, "KV cache": kv, "engine buffers (H2D + 2 IPC)": buffers}
    if not run.offload:
        rollout["trainer shard"] = trainer
    train = {"trainer shard": trainer, "engine buffers (H2D + 2 IPC)": buffers}
    if run.sleep_level < 2:
        train["replica shard"] = replica
    if run.sleep_level == 0:
        train["KV cache"] = kv
    peak = max((rollout, train), key=lambda p: sum(p.values()))
    return Memory({k: v / GiB for k, v in peak.items()}, cluster.gpu.memory_gib)


def plan(layout: Layout, footprint: FootprintOf, gpu: str = "H800", cal: Calibration | None = None
         ) -> tuple[Prediction | None, Memory, float]:
    """(prediction or None if it cannot fit, memory, bucket bytes) of K2 in ``layout`` on ``gpu`` nodes, in
    a run of ``footprint(gpus)``.
    Without a bucket size the largest that fits is taken (at most 8 GiB, in steps of 1/4 GiB): fewer
    broadcasts, less latency."""
    cluster = GpuCluster(GPUS[gpu], layout.nodes)
    cal = cal or k2_calibration()
    run = footprint(cluster.gpus)
    if layout.bucket_gib:
        bucket = layout.bucket_gib * GiB
    else:
        without = memory(layout, cluster, 0, run)
        spare = (without.limit - without.total) * GiB / 3  # the three buffers share what is left
        bucket = min(8 * GiB, max(0.25 * GiB, spare // (GiB / 4) * (GiB / 4)))
    mem = memory(layout, cluster, bucket, run)
    if not mem.fits:
        return None, mem, bucket
    return predict(K2_BYTES[layout.dtype], cluster, layout.tp, bucket, cal), mem, bucket


TABLE_LAYOUTS = [Layout(d, tp, nodes) for d in ("fp8", "bf16") for nodes in (32, 64) for tp in (8, 16, 32, 64)]


def table(footprint: FootprintOf, target_s: float = 30.0, gpu: str = "H800") -> str:
    """Markdown table of ``TABLE_LAYOUTS`` for K2: time, bound, memory, and the margin to ``target_s``."""
    cal = k2_calibration()
    lines = ["| weights | GPUs | TP | bucket GiB | GiB/GPU | predicted s | bound | 30 s target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for lay in TABLE_LAYOUTS:
        p, mem, bucket = plan(lay, footprint, gpu, cal)
        gpus = lay.nodes * 8
        if p is None:
            lines.append(f"| {lay.dtype} | {gpus} | {lay.tp} | - | {mem.total:.1f} | - | memory | refused: "
                         f"{mem.why()} |")
            continue
        verdict = f"meets, margin {target_s - p.total_s:.1f} s" if p.total_s <= target_s else \
            f"misses by {p.total_s - target_s:.1f} s"
        lines.append(f"| {lay.dtype} | {gpus} | {lay.tp} | {bucket / GiB:g} | {mem.total:.1f} | {p.total_s:.1f} | "
                     f"{p.bound} | {verdict} |")
    return "\n".join(lines)


def validation() -> str:
    """The published runs, measured against predicted with the K2 calibration."""
    cal = k2_calibration()
    lines = [f"r = {cal.rate_gbps:.1f} GB/s per GPU, hop = {cal.hop_s * 1e6:.1f} us ({cal.source})",
             "| run | GPUs | bucket GiB | measured s | predicted s | error |", "| --- | --- | --- | --- | --- | --- |"]
    for run in PUBLISHED:
        p = run.predicted(cal)
        lines.append(f"| {run.model} | {run.gpus}x{run.gpu} TP{run.tp} | {run.bucket_gib:g} | {run.seconds:.2f} | "
                     f"{p.total_s:.2f} | {100 * (p.total_s - run.seconds) / run.seconds:+.1f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit("error: the planner's command is now `rl plan-update` (same flags)")
