"""The 1T-parameter planner: its cost model, its calibration from benchmark records, its CLI."""

import json

import pytest

from checkpoint_engine.plan import Calibration, Cluster, calibrate, load_records, main, predict


def test_k2_on_h800_is_broadcast_bound_and_under_30_s():
    p = predict(1.04e12, 2, Cluster(pcie_gbps=50), 2 * (1 << 30), 16, Calibration(efficiency=0.8, step_latency_s=1e-3))
    b = 2.08e12
    assert p.broadcast_s == pytest.approx(b / 200e9)             # each GPU takes all of B over NVLink
    assert p.h2d_s == pytest.approx(b / 256 / 50e9)               # its own share over PCIe
    steps = -(-b // (256 * 2 * (1 << 30)))
    assert p.total_s == pytest.approx((b / 256 / 50e9 + b / 200e9) / 0.8 + steps * 1e-3)
    assert p.bound == "broadcast" and p.total_s < 30


def test_slow_links_or_tiny_buckets_change_the_bound():
    cal = Calibration(efficiency=1.0, step_latency_s=1e-3)
    slow_nic = predict(1.04e12, 2, Cluster(nvlink_gbps=900, nic_gbps=5), 1 << 30, 16, cal)
    assert slow_nic.bound == "broadcast" and "NICs" in slow_nic.why
    tiny = predict(1.04e12, 2, Cluster(), 1 << 16, 16, cal)
    assert tiny.bound == "step latency"


def test_calibration_recovers_efficiency_and_step_latency():
    eff, lat = 0.7, 0.004
    records = [{"bucket_mb": mb, "buckets": n, "floor_s": 0.6, "update_s": 0.6 / eff + n * lat, "workers": 2}
               for mb, n in ((256, 5), (64, 17), (16, 65))]
    # a one-worker record (no broadcast at all) must not enter the fit
    records.append({"bucket_mb": 512, "buckets": 2, "floor_s": 0.3, "update_s": 0.1, "workers": 1})
    # nor a comparison run without the engine's rollback (its update skips work the engine does)
    records.append({"bucket_mb": 1024, "buckets": 2, "floor_s": 0.6, "update_s": 0.61, "workers": 2,
                    "rollback": "none"})
    # the largest bucket's own latency makes its efficiency a little low; the fit absorbs the rest
    cal = calibrate(records)
    assert cal.efficiency == pytest.approx(0.6 / (0.6 / eff + 5 * lat))
    assert cal.step_latency_s == pytest.approx(lat, rel=0.05)


def test_cli_states_whether_the_target_holds(capsys, tmp_path):
    main([])
    out = capsys.readouterr().out
    assert "30 s target holds" in out and "bound by broadcast" in out and "assumed" in out
    main(["--nvlink-gbps", "50", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert rec["holds"] is False and rec["total_s"] > 41.6 / 0.8 - 1
    f = tmp_path / "bench.jsonl"
    f.write_text("workers 2 ...\n{not json\n")
    with pytest.raises(ValueError, match="bench.jsonl:2"):
        load_records(f)


def test_cli_rejects_non_positive_sizes():
    with pytest.raises(SystemExit):
        main(["--nodes", "0"])
