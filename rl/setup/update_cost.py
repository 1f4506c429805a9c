"""`rl plan-update`: Kimi K2's weight-update time and memory on a GPU cluster, for the run K2 trains.

The cost model and its calibration are ``checkpoint_engine.cost_model``'s; what the run around the update
holds per GPU (the trainer's shard, the KV cache) is this package's memory model, ``rl.setup.memory``.

``--expert-parallel`` e (``trainer.expert_parallel``) changes the trainer's shard only: a GPU computes E/e of each
MoE layer's E experts but stores whole experts, at most ⌈E/GPUs⌉ of them whatever e is (the GPUs / e computing the
same ones split them, as FSDP2's row shards split the stacked experts), and 1/GPUs of the rest. Each expert is stored,
and so sent (``checkpoint_engine.model_sender``), by one rank: what each GPU stages and sends stays about 1/GPUs of
the update, so the time is the same as without.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from functools import cache

from checkpoint_engine.cost_model import (
    GPUS,
    TABLE_LAYOUTS,
    Footprint,
    GiB,
    Layout,
    k2_arch,
    k2_calibration,
    plan,
    table,
    validation,
)
from checkpoint_engine.cost_p2p import k2_p2p
from rl.config import Config, parse_config
from rl.errors import UserError
from rl.settings import sleep_level


def run_config(overrides: dict | None = None) -> Config:
    """The run whose memory is planned: K2 as the report trains it, colocated: bf16 master weights,
    Muon, the trainer offloaded while the engines generate, the replica's weights and KV cache freed
    while it trains (sleep level 2: the next update refills them), 8 GiB of KV cache per GPU."""
    raw = {"model": {"dtype": "bfloat16"},
           "trainer": {"param_dtype": "bfloat16", "master_dtype": "bfloat16", "offload": True},
           "optimizer": {"kind": "muon"}, "rollout": {"kv_cache_mb": 8192, "sleep_level": 2}}
    for k, v in (overrides or {}).items():
        raw.setdefault(k, {}).update(v)
    return parse_config(raw)


@cache
def _footprint(gpus: int, overrides_json: str) -> Footprint:
    from rl.setup.memory import estimate

    cfg = run_config(json.loads(overrides_json))
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"workers": gpus})})
    est = estimate(cfg, k2_arch(), 4096)
    return Footprint(float(est.trainer_weights + est.trainer_grads + est.optimizer), float(est.kv_cache),
                     cfg.trainer.offload, sleep_level(cfg)[0])


def k2_footprint(gpus: int, overrides: dict | None = None) -> Footprint:
    """Per GPU, K2's trainer shard (weights, gradients, optimizer state) over ``gpus`` workers and the paged
    cache's whole budget (``rl.setup.memory.estimate`` of ``run_config(overrides)``)."""
    return _footprint(gpus, json.dumps(overrides or {}, sort_keys=True))


def check_ep(ep: int, gpus: list[int]) -> None:
    """Refuse an expert-parallel size K2 on ``gpus`` GPUs cannot take, in one line."""
    from rl.setup.memory import check_expert_layout

    try:
        for n in gpus:
            check_expert_layout(k2_arch(), ep, n)
    except ValueError as e:
        raise UserError(f"rl plan-update: {e}") from None


def expert_parallel_note(ep: int, gpus: int) -> dict | None:
    """What expert parallel ``ep`` changes in K2's update on ``gpus`` GPUs (None at 1): the experts a GPU computes
    and stores, the trainer's shard per GPU in GiB against FSDP2 alone; the time does not change (see the module)."""
    from rl.setup.memory import stored_experts

    if ep == 1:
        return None
    shard, flat = k2_footprint(gpus, {"trainer": {"expert_parallel": ep}}).trainer_bytes, \
        k2_footprint(gpus).trainer_bytes
    return {"ep": ep, "experts_computed": 384 // ep, "experts_stored": stored_experts(384, ep, gpus),
            "trainer_shard_gib": round(shard / GiB, 2),
            "trainer_shard_gib_ep1": round(flat / GiB, 2), "time_changes": False}


def main(argv: list[str] | None = None) -> None:
    """The planner's command line (``rl plan-update``)."""
    ap = argparse.ArgumentParser(prog="rl plan-update",
                                 description="Predict Kimi K2's weight-update time and memory on a GPU cluster.")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="replica weights (default fp8)")
    ap.add_argument("--tp", type=int, default=16, help="GPUs per inference replica (default 16)")
    ap.add_argument("--nodes", type=int, default=32, help="nodes of 8 GPUs (default 32: 256 GPUs)")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="H800")
    ap.add_argument("--bucket-gib", type=float, default=None, help="bucket per GPU (default: largest that fits)")
    ap.add_argument("--target-s", type=float, default=30.0)
    ap.add_argument("--table", action="store_true", help="print the table of FP8/bf16 replica layouts")
    ap.add_argument("--validate", action="store_true", help="published runs: measured against predicted")
    ap.add_argument("--p2p-tp", type=int, default=32,
                    help="point to point (disaggregated): GPUs per replica of the half of the GPUs that serve (default "
                         "32: a double-buffered K2 FP8 replica shard fits an H800 from TP32)")
    ap.add_argument("--expert-parallel", type=int, default=1, metavar="EP",
                    help="trainer.expert_parallel of the run: GPUs splitting each MoE layer's 384 experts, each "
                         "computing 1/EP of them and storing about 1/GPUs of them whole (default 1: FSDP2 shards "
                         "everything over all GPUs)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.tp < 1 or a.nodes < 1 or (a.bucket_gib is not None and a.bucket_gib <= 0) or a.target_s <= 0:
        ap.error("--tp, --nodes, --bucket-gib and --target-s must be positive")
    ep = a.expert_parallel
    check_ep(ep, sorted({lay.nodes * 8 for lay in TABLE_LAYOUTS}) if a.table else [a.nodes * 8])
    overrides = {"trainer": {"expert_parallel": ep}} if ep > 1 else None
    footprint = lambda gpus: k2_footprint(gpus, overrides)  # noqa: E731
    if a.table:
        print(table(footprint, a.target_s, a.gpu))
        return
    if a.validate:
        print(validation())
        return
    layout = Layout(a.dtype, a.tp, a.nodes, a.bucket_gib)
    p, mem, bucket = plan(layout, footprint, a.gpu)
    experts = expert_parallel_note(ep, a.nodes * 8)
    if p is None:
        raise SystemExit(f"error: Kimi K2 ({a.dtype}, TP{a.tp}, {a.nodes * 8} {a.gpu}"
                         f"{f', expert parallel {ep}' if ep > 1 else ''}) does not fit: {mem.why()}"
                         + (f"; at expert parallel {ep} a GPU stores {experts['experts_stored']} of every MoE "
                            f"layer's 384 experts whole and 1/{a.nodes * 8} of the rest (trainer shard at EP 1: "
                            f"{experts['trainer_shard_gib_ep1']:.1f} GiB); more GPUs (--nodes) store less"
                            if experts else ""))
    holds = bool(p.total_s <= a.target_s)
    cal = k2_calibration()
    try:
        p2p, assumed = k2_p2p(a.nodes * 8, tp=a.p2p_tp, gpu=a.gpu, dtype=a.dtype)
    except ValueError as e:
        ap.error(f"--p2p-tp: {e}")
    if a.json:
        print(json.dumps({**asdict(p), "target_s": a.target_s, "holds": holds, "layout": asdict(replace(
            layout, bucket_gib=bucket / GiB)), "memory_gib": mem.parts, "calibration": asdict(cal),
            "p2p": {**asdict(p2p), "assumptions": assumed}, **({"expert_parallel": experts} if experts else {})}))
        return
    print(f"Kimi K2, {a.dtype}: {p.bytes / 1e12:.3f} TB on {p.gpus} {a.gpu} ({a.nodes} nodes x 8), TP{a.tp}; "
          f"bucket {bucket / GiB:g} GiB, {p.buckets} broadcasts")
    print(f"  stage 1  h2d        {p.h2d_s:7.2f} s")
    print(f"  stage 2  deliver    {p.deliver_s:7.2f} s   (overlapped with reload)")
    print(f"           reload     {p.reload_s:7.2f} s")
    print(f"  broadcast latency   {p.latency_s:7.2f} s")
    print("  memory per GPU: " + ", ".join(f"{k} {v:.1f}" for k, v in mem.parts.items()) +
          f" = {mem.total:.1f} of {mem.limit:.1f} GiB")
    if experts:
        print(f"  expert parallel {ep}: a GPU computes {384 // ep} of every MoE layer's 384 experts and stores at "
              f"most {experts['experts_stored']} of them whole, and 1/{p.gpus} of the rest: trainer shard "
              f"{experts['trainer_shard_gib']:.1f} GiB per GPU ({experts['trainer_shard_gib_ep1']:.1f} at EP 1), what "
              "its H2D stages from, in pinned host memory while offloaded")
        print(f"  time as at EP 1: each GPU still stages and sends about 1/{p.gpus} of the update (each expert from "
              "the one GPU that stores it)")
    print(f"  r {cal.rate_gbps:.1f} GB/s per GPU, hop {cal.hop_s * 1e6:.1f} us: {cal.source}")
    print(f"predicted update: {p.total_s:.1f} s; bound by {p.bound}")
    print(f"{a.target_s:g} s target {'holds' if holds else 'does NOT hold'} "
          f"({'margin' if holds else 'over by'} {abs(a.target_s - p.total_s):.1f} s)")

    fits = assumed["rollout_gpu_weights_gib"] <= assumed["rollout_gpu_memory_gib"]
    print(f"point to point (disaggregated: {p2p.senders} trainer GPUs -> {p2p.replicas} replicas x TP{p2p.tp}): "
          f"predicted {p2p.total_s:.2f} s, bound by {p2p.bound}; links {assumed['link_gbps']:g} GB/s per GPU, copies "
          f"{assumed['copy_gbps']:g} GB/s, {assumed['message_us']:g} us per message, {assumed['bucket_gib']:g} GiB "
          f"buckets (assumed); a rollout GPU holds its shard twice (swapped in at once): "
          f"{assumed['rollout_gpu_weights_gib']:.1f} of {assumed['rollout_gpu_memory_gib']:.1f} GiB"
          + ("" if fits else " - does NOT fit: raise --p2p-tp"))

if __name__ == "__main__":
    main()
