"""The 1T-parameter planner: calibrated on published runs, memory per GPU, its table and CLI."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from checkpoint_engine.cost_model import (
    GPUS,
    K2_BYTES,
    PUBLISHED,
    Calibration,
    Footprint,
    GpuCluster,
    Layout,
    Run,
    calibrate,
    k2_arch,
    k2_calibration,
    memory,
    predict,
)
from checkpoint_engine.cost_model import plan as plan_with
from checkpoint_engine.cost_p2p import Rates, k2_p2p, predict_p2p
from engines.model.layout import model_tensors
from engines.model.native.causal_lm import build_model
from engines.model.native.fp8 import to_fp8
from rl.setup.update_cost import k2_footprint, main, run_config


def plan(layout: Layout):
    """The planner on the run K2 trains (``rl.setup.update_cost``'s footprint)."""
    return plan_with(layout, k2_footprint)


def test_k2_calibration_predicts_every_published_run_within_20_percent():
    """Fitted to the two Kimi K2 runs (16 and 256 H20), the model reproduces them and predicts the other
    four published runs (DeepSeek-V3.1 on H20, GLM-4.5-Air and Qwen3-235B on H800) within 20 %."""
    cal = k2_calibration()
    assert 60 < cal.rate_gbps < 100 and 0 < cal.hop_s < 1e-3
    for run in PUBLISHED:
        assert run.predicted(cal).total_s == pytest.approx(run.seconds, rel=0.2), run
    for run in PUBLISHED[:2]:
        assert run.predicted(cal).total_s == pytest.approx(run.seconds, rel=0.01)


def test_calibration_recovers_rate_and_hop():
    truth = Calibration(70.0, 2e-4, "truth")
    runs = [Run(model="m", nbytes=b, gpus=w, tp=16, gpu="H20", bucket_gib=bucket, seconds=0.0)
            for b, w, bucket in ((1e12, 16, 4), (1e12, 256, 8), (5e11, 64, 2))]
    runs = [dataclasses.replace(r, seconds=r.predicted(truth).total_s) for r in runs]
    cal = calibrate(runs)
    assert cal.rate_gbps == pytest.approx(70.0, rel=1e-6) and cal.hop_s == pytest.approx(2e-4, rel=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        calibrate(runs[:1])


def model_bytes(arch) -> dict[str, float]:
    """Parameters, and the bytes of a bf16 replica and of a block-FP8 one (``engines.model.native.fp8``), from
    shapes."""
    model = build_model(arch, device="meta", dtype=torch.bfloat16)
    size = lambda m: float(sum(t.numel() * t.element_size() for t in model_tensors(m).values()))  # noqa: E731
    out = {"params": float(sum(p.numel() for p in model.parameters())), "bf16": size(model)}
    out["fp8"] = size(to_fp8(model))
    return out


def test_k2_bytes_are_its_architectures():
    got = model_bytes(k2_arch())
    assert got == pytest.approx(K2_BYTES, rel=1e-6)
    assert got["fp8"] < 0.51 * got["bf16"]  # FP8 halves what crosses the wire (scales and bf16 embeddings aside)


def test_slow_links_or_tiny_buckets_change_the_bound():
    cal = Calibration(80.0, 1e-4, "test")
    slow_nic = predict(1e12, GpuCluster(GPUS["H800"], nic_gbps=5), 16, 8 * 2**30, cal)
    assert slow_nic.bound == "the NICs"
    tiny = predict(1e12, GpuCluster(GPUS["H800"]), 16, 2**26, cal)
    assert tiny.bound == "broadcast latency"


def test_impossible_layouts_are_refused_naming_the_largest_part():
    p, mem, _ = plan(Layout("bf16", 16))
    assert p is None and not mem.fits and "replica shard" in mem.why()
    p, mem, _ = plan(Layout("fp8", 16, bucket_gib=8))  # fits without its buffers, not with 3 x 8 GiB
    assert p is None and "79.2" in mem.why()
    with pytest.raises(SystemExit, match="does not fit: needs"):
        main(["--dtype", "bf16", "--tp", "8"])


def test_k2_fp8_on_256_h800_meets_the_targets():
    """FP8 replicas over 32 GPUs: under 20 s; over 16 GPUs the replica leaves room for smaller buckets
    only, more broadcasts, and still under 30 s; bf16 misses 30 s in every layout that fits."""
    tp32, mem, bucket = plan(Layout("fp8", 32))
    assert tp32 is not None and tp32.total_s < 20 and mem.fits and bucket == 8 * 2**30
    tp16, _, bucket16 = plan(Layout("fp8", 16))
    assert tp16 is not None and tp16.total_s < 30 and bucket16 < bucket
    for tp in (32, 64):
        bf16, _, _ = plan(Layout("bf16", tp))
        assert bf16 is not None and bf16.total_s > 30


def test_the_footprint_decides_what_shares_each_phase():
    """The trainer's shard joins the rollout phase only when it is not offloaded; the replica's shard and
    the KV cache join the training phase by sleep level: the planner takes these as plain numbers."""
    lay, cluster = Layout("fp8", 32), GpuCluster(GPUS["H800"])
    base = dict(trainer_bytes=40 * 2**30, kv_cache_bytes=8 * 2**30)
    parts = lambda **kw: memory(lay, cluster, 2**30, Footprint(**base, **kw)).parts  # noqa: E731
    assert parts(offload=True, sleep_level=2)["trainer shard"] == 40 and "replica shard" not in parts()
    assert set(parts(offload=False, sleep_level=2)) == {"replica shard", "KV cache", "engine buffers (H2D + 2 IPC)",
                                                        "trainer shard"}
    assert set(parts(offload=True, sleep_level=0)) == {"trainer shard", "engine buffers (H2D + 2 IPC)",
                                                       "replica shard", "KV cache"}
    old = subprocess.run([sys.executable, "-m", "checkpoint_engine.cost_model"], capture_output=True, text=True)
    assert old.returncode == 1
    assert old.stderr.strip() == "error: the planner's command is now `rl plan-update` (same flags)"


def test_the_planned_trainer_keeps_bf16_master_weights_as_the_report_does():
    """The K2 run the planner sizes holds bf16 master weights (two bytes per parameter per shard), not the
    float32 that a run's default config would give."""
    from rl.setup.memory import estimate

    cfg = run_config()
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"workers": 256})})
    est = estimate(cfg, k2_arch(), 4096)
    assert est.trainer_weights == -(-est.params * 2 // 256)


def test_cli_table_and_verdicts(capsys):
    main(["--table"])
    out = capsys.readouterr().out
    assert "| fp8 | 256 | 32 |" in out and "meets, margin" in out and "misses by" in out and "refused" in out
    main(["--tp", "32", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert rec["holds"] is True and rec["total_s"] < 20 and rec["layout"]["bucket_gib"] == 8
    main(["--validate"])
    assert "Qwen3-235B" in capsys.readouterr().out


def test_cli_rejects_non_positive_sizes():
    with pytest.raises(SystemExit):
        main(["--nodes", "0"])


def test_point_to_point_k2_prediction_is_under_5_s_and_says_what_fits():
    """The disaggregated update of K2 FP8 on 256 H800 (half training, replicas of TP32): each trainer GPU's link
    carries its 1/128 shard to 4 replicas, 4 x 1.029e12 / 128 B at 40 GB/s = 0.80 s, plus the pipeline's fill."""
    p, assumed = k2_p2p(256, tp=32)
    assert p.bound == "send" and abs(p.send_s - 4 * K2_BYTES["fp8"] / 128 / 40e9) < 1e-9
    assert p.send_s < p.total_s < 5 and p.receive_s == p.send_s  # 128 senders feed 128 receivers evenly
    assert assumed["rollout_gpu_weights_gib"] <= assumed["rollout_gpu_memory_gib"]
    _, tp16 = k2_p2p(256, tp=16)  # a double-buffered TP16 shard (2 x 60 GiB) does not fit an 80 GB GPU
    assert tp16["rollout_gpu_weights_gib"] > tp16["rollout_gpu_memory_gib"]
    with pytest.raises(ValueError, match="whole replicas"):
        k2_p2p(256, tp=48)


def test_point_to_point_over_shared_memory_is_bound_by_the_slower_copy():
    rates = Rates(stage=4e9, link=1e9, load=2e9, message_s=0.0)
    shared = predict_p2p(8e9, 1, 1, 1, 1e9, rates, shared=True)
    assert shared.send_s == shared.receive_s == 0 and shared.bound == "load"
    assert shared.total_s == pytest.approx(8e9 / 2e9 + 1e9 / 4e9)  # the load, after the first bucket's staging
    wire = predict_p2p(8e9, 1, 1, 1, 1e9, rates)
    assert wire.bound == "send" and wire.total_s == pytest.approx(8 + 1 + 0.25 + 0.5)


def test_cli_prints_the_point_to_point_prediction_beside_the_broadcast(capsys):
    main(["--json"])
    rec = json.loads(capsys.readouterr().out)
    assert rec["p2p"]["total_s"] < 5 < rec["total_s"] and rec["p2p"]["assumptions"]["tp"] == 32
    main([])
    assert "point to point (disaggregated: 128 trainer GPUs -> 4 replicas x TP32)" in capsys.readouterr().out
