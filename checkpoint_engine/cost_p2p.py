"""Predict a point-to-point weight update (``checkpoint_engine.p2p``): trainer ranks send their shards' buckets
straight to rollout replicas on GPUs (or CPU processes) of their own.

For B bytes, S sending trainer ranks, R replicas of TP ranks each (a replica rank receives the buckets of its own
shard), per-party rates in bytes/s and a per-message latency:

  stage     B / S · (1/stage_rate + 1/sum_rate)    each sender copies (casts, quantises) its shard into its slots
                                                   and checksums each bucket (the trailer)
  send      R · B / S / link_rate        each sender's link carries its shard once per replica
  receive   B / TP / link_rate           each replica rank's link carries its share
  load      B / TP · (1/load_rate + 1/sum_rate)    each replica rank verifies the checksum and copies its share
                                                   into its spare weights
  fill      one bucket through every stage but the slowest (the pipeline filling)
  latency   buckets / S · message latency (each sender's messages, one per bucket and replica, are pipelined)
  total = max(stage, send, receive, load) + fill + latency

On one node over shared memory nothing crosses a link (``shared``): send and receive are zero.
The GPU prediction for Kimi K2 assumes links at ``LINK_EFFICIENCY`` of the NIC's line rate (RDMA or NCCL
send/recv into the other GPUs, one NIC per GPU) and the GPUs' copy rate for staging and loading; the CPU
prediction takes the rates a benchmark measured on the same machine (``benchmarks.p2p_update``), which
checks it against the measured update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from checkpoint_engine.cost_model import GB, GPUS, K2_BYTES, GiB

LINK_EFFICIENCY = 0.8  # of a NIC's line rate that point-to-point sends of GiB buckets reach (an assumption)
GPU_MESSAGE_S = 20e-6  # per message on RDMA/NCCL (an assumption)


@dataclass(frozen=True)
class Rates:
    """Bytes per second of one party's staging copy, link, load copy and checksum pass; seconds per message."""

    stage: float
    link: float
    load: float
    message_s: float
    checksum: float = float("inf")


@dataclass(frozen=True, kw_only=True)
class P2PPrediction:
    bytes: float
    senders: int
    replicas: int
    tp: int
    buckets: int
    stage_s: float
    send_s: float
    receive_s: float
    load_s: float
    fill_s: float
    latency_s: float
    total_s: float
    bound: str


def predict_p2p(nbytes: float, senders: int, replicas: int, tp: int, bucket_bytes: float, rates: Rates,
                shared: bool = False) -> P2PPrediction:
    """The point-to-point pipeline's cost model (see the module docstring)."""
    stage, load = 1 / rates.stage + 1 / rates.checksum, 1 / rates.load + 1 / rates.checksum  # seconds per byte
    parts = {"stage": nbytes / senders * stage,
             "send": 0.0 if shared else replicas * nbytes / senders / rates.link,
             "receive": 0.0 if shared else nbytes / tp / rates.link,
             "load": nbytes / tp * load}
    bound = max(parts, key=parts.__getitem__)
    bucket = min(bucket_bytes, nbytes / senders)
    per_bucket = {"stage": bucket * stage, "send": 0.0 if shared else bucket / rates.link,
                  "receive": 0.0 if shared else bucket / rates.link, "load": bucket * load}
    fill = sum(v for k, v in per_bucket.items() if k != bound)
    buckets = math.ceil(nbytes / bucket_bytes)
    latency = math.ceil(buckets / senders) * replicas * rates.message_s
    return P2PPrediction(bytes=nbytes, senders=senders, replicas=replicas, tp=tp, buckets=buckets,
                         stage_s=parts["stage"], send_s=parts["send"], receive_s=parts["receive"],
                         load_s=parts["load"], fill_s=fill, latency_s=latency,
                         total_s=parts[bound] + fill + latency, bound=bound)


def k2_p2p(gpus: int = 256, trainer_gpus: int | None = None, tp: int = 32, gpu: str = "H800",
           nic_gbps: float = 50.0, bucket_gib: float = 1.0, dtype: str = "fp8") -> tuple[P2PPrediction, dict]:
    """Kimi K2 updated point to point on ``gpus`` GPUs, ``trainer_gpus`` of them training (default half) and the
    rest serving replicas of ``tp`` GPUs; returns the prediction and the assumptions, with each rollout GPU's
    memory for a double-buffered replica (its shard twice, plus two receive buffers)."""
    trainer_gpus = trainer_gpus or gpus // 2
    rollout_gpus = gpus - trainer_gpus
    if rollout_gpus < tp or rollout_gpus % tp:
        raise ValueError(f"{rollout_gpus} rollout GPUs do not make whole replicas of TP {tp}")
    g, nbytes = GPUS[gpu], K2_BYTES[dtype]
    rates = Rates(stage=g.hbm_gbps * GB, link=LINK_EFFICIENCY * nic_gbps * GB, load=g.hbm_gbps * GB,
                  message_s=GPU_MESSAGE_S, checksum=2 * g.hbm_gbps * GB)  # a checksum reads, a copy reads and writes
    p = predict_p2p(nbytes, trainer_gpus, rollout_gpus // tp, tp, bucket_gib * GiB, rates)
    replica_gib = 2 * nbytes / tp / GiB + 2 * bucket_gib
    return p, {"trainer_gpus": trainer_gpus, "replicas": rollout_gpus // tp, "tp": tp, "gpu": gpu,
               "link_gbps": rates.link / GB, "copy_gbps": g.hbm_gbps, "message_us": GPU_MESSAGE_S * 1e6,
               "bucket_gib": bucket_gib, "rollout_gpu_weights_gib": round(replica_gib, 1),
               "rollout_gpu_memory_gib": g.memory_gib}
