"""benchmarks.gpu_check: the plan a person with a GPU runs, proven on CPU by its dry run."""

from __future__ import annotations

import json
import os
import re

import pytest

from benchmarks import gpu_check


def test_gpu_names_map_to_short_record_names_and_nominal_peaks():
    assert gpu_check.nominal_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gpu_check.nominal_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_check.nominal_tflops("Some Future Accelerator") is None
    rec = {"model_tflop": 98.94, "base": {"step_s": 0.5, "mfu": 0.3}}
    assert gpu_check.add_mfu(rec, "NVIDIA H100 80GB HBM3")["base"]["mfu_nominal"] == 0.2


def test_pytest_counts_read_the_last_line():
    out = "....s\n3 passed, 1 skipped, 2 deselected in 4.1s\n"
    assert gpu_check.pytest_counts(out) == {"passed": 3, "skipped": 1, "deselected": 2}
    assert gpu_check.pytest_counts("1 failed, 2 passed in 1s") == {"failed": 1, "passed": 2}


def test_the_full_plan_measures_every_figure_the_issue_asks_for():
    steps = gpu_check.plan(dry_run=False, gpus=2, with_vllm=True)
    names = [s.name for s in steps]
    assert names.count("decode") == 3 and {s.extra.get("attention") for s in steps} >= {"torch", "flex", "vllm-both"}
    updates = [s for s in steps if s.name == "weight_update"]
    assert {s.extra["weights"] for s in updates} == {"bf16", "fp32-to-bf16"}
    assert all("16" in s.argv for s in updates)  # 16 GiB
    assert {"tests", "train_step", "rl_iteration", "tests_two_gpus"} <= set(names)
    assert "qwen3-0.6b" in next(s for s in steps if s.name == "rl_iteration").argv


@pytest.mark.slow
def test_dry_run_runs_the_whole_plan_on_cpu(tmp_path):
    # the GPU tests run in this suite already (skipped without a GPU), and so does the side-by-side vLLM rollout
    # (tests/test_vllm_engine.py): the dry run here leaves those two steps out
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--skip", "tests", "--attention", "torch", "flex"])
    summary = (tmp_path / "cpu-dryrun-summary.md").read_text()
    records = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in tmp_path.glob("*.jsonl")}
    failed = [(r["label"], r.get("output_tail", "")[-600:])
              for rs in records.values() for r in rs if r["status"] != "ok"]
    assert status == 0 and not failed, failed
    assert set(records) == {f"cpu-dryrun-{s}.jsonl" for s in ("decode", "weight_update", "train_step", "rl_iteration")}
    assert {r["attention"] for r in records["cpu-dryrun-decode.jsonl"]} >= {"torch", "flex"}
    assert all(r["engine_tok_s"] > 0 for r in records["cpu-dryrun-decode.jsonl"] if "engine_tok_s" in r)
    assert records["cpu-dryrun-weight_update.jsonl"][0]["bitwise_equal"] is True
    assert records["cpu-dryrun-rl_iteration.jsonl"][0]["iteration_s"] > 0
    assert "one RL iteration" in summary and "train step" in summary


def test_the_quick_plan_measures_the_same_figures_on_smaller_workloads():
    full = {(s.name, s.label): s for s in gpu_check.plan(dry_run=False, gpus=1, with_vllm=False)}
    quick = {(s.name, s.label): s for s in gpu_check.plan(dry_run=False, gpus=1, with_vllm=False, quick=True)}
    assert quick.keys() == full.keys()
    assert all(quick[k].timeout_s <= full[k].timeout_s for k in full)
    argv = {k[0]: " ".join(s.argv) for k, s in quick.items()}
    assert "--output-len 512" in argv["decode"] and "--tokens 8192" in argv["train_step"]
    assert "--max-tokens 256" in argv["rl_iteration"] and "--gib 16" in argv["weight_update"]


@pytest.mark.serial
def test_a_step_past_its_limit_is_cut_with_its_children(tmp_path):
    """A step whose child outlives it (a compile worker, Ray) must not hold the check past the step's limit:
    the child keeps the output pipe open, and waiting for the pipe alone would wait for the child."""
    import time

    (tmp_path / "hangs.py").write_text("import subprocess, sys, time\nprint('started', flush=True)\n"
                                       "subprocess.Popen(['sleep', '60'])\ntime.sleep(60)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    t0 = time.monotonic()
    [rec] = gpu_check.run_step(gpu_check.Step("hangs", "a step that hangs", ["hangs"], 3), env, tmp_path / "h.log")
    assert time.monotonic() - t0 < 20
    assert rec["status"] == "timeout" and "started" in (tmp_path / "h.log").read_text()


def test_steps_run_in_the_order_asked_and_a_spent_deadline_skips_them(tmp_path):
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "train_step", "weight_update",
                             "--deadline", "0"])
    lines = (tmp_path / "cpu-dryrun-summary.md").read_text().splitlines()
    steps = [x for x in lines if x.startswith("- ")]
    assert status == 1 and len(steps) == 2
    assert "train step" in steps[0] and "weight update" in steps[1] and all("(skipped" in x for x in steps)


def _arg(step: gpu_check.Step, flag: str) -> list[str]:
    """The values after ``flag`` in a step's argv (up to the next flag)."""
    rest = step.argv[step.argv.index(flag) + 1:]
    return rest[: next((i for i, x in enumerate(rest) if x.startswith("--")), len(rest))]


def test_the_lease_plan_fits_the_lease_in_value_order():
    """Issue "GPU speed", item 7: about 100 s of cold start, then a command whose limits add up to at most 560 s
    and an optional second of at most 180 s, each in value order."""
    steps = gpu_check.lease_plan(dry_run=False)
    first, second = [s for s in steps if s.call == 1], [s for s in steps if s.call == 2]
    assert [s.name for s in first] == ["preflight", "decode_sweep", "rollout_rl", "rollout_peer", "train_step",
                                       "colocated_smoke"]
    assert [s.name for s in second] == ["tests", "rollout_rl"] and len(first) + len(second) == len(steps)
    assert sum(s.timeout_s for s in first) <= gpu_check.LEASE_S == 560
    assert sum(s.timeout_s for s in second) <= gpu_check.LEASE_SECOND_S == 180
    sweep, rl, peer, train, smoke = first[1:]
    assert _arg(sweep, "--models") == ["qwen3-0.6b", "qwen3-8b"] and _arg(sweep, "--backends") == ["torch", "triton"]
    assert "--batches" not in sweep.argv  # the default: 1..512
    assert _arg(rl, "--model") == ["qwen3-0.6b"] and _arg(rl, "--prompts") == ["64"] and _arg(rl, "--samples") == ["8"]
    assert _arg(rl, "--step-log")[0].startswith("{out}/{gpu}-") and _arg(rl, "--attention") == ["triton"]
    assert "--hf-static" in peer.argv and _arg(peer, "--workload") == ["fixed"] and "--skip-hf" not in peer.argv
    assert _arg(train, "--model") == ["qwen3-1.7b"] and _arg(train, "--tokens") == ["16384", "32768"]
    assert smoke.argv[0] == "benchmarks.colocated_smoke"
    assert second[0].argv[0] == "pytest" and set(second[0].argv) >= {"tests/test_triton_attention.py", "cuda"}
    assert _arg(second[1], "--model") == ["qwen3-8b"]
    assert all(s.argv[s.argv.index("--device") + 1] == "cuda" for s in steps if "--device" in s.argv)
    toy = gpu_check.lease_plan(dry_run=True)  # the CPU dry run: the same steps, toy sizes
    assert [(s.name, s.call) for s in toy] == [(s.name, s.call) for s in steps]
    assert all(s.argv[s.argv.index("--device") + 1] == "cpu" for s in toy if "--device" in s.argv)


def test_plan_only_prints_both_commands_with_limits_within_their_budgets(capsys):
    assert gpu_check.main(["--lease", "--plan-only"]) == 0
    out = capsys.readouterr().out
    totals = [int(x) for x in re.findall(r"limits add up to (\d+) s", out)]
    assert "command 1:" in out and "command 2 (optional):" in out and "decode_sweep" in out
    assert len(totals) == 2 and totals[0] <= 560 and totals[1] <= 180
    assert gpu_check.main(["--dry-run", "--plan-only"]) == 0  # a full dry run prints the lease plan beside its own
    assert "plan on a leased GPU (--lease):" in capsys.readouterr().out


# slow tier: it guards the lease script (61 s), which only a GPU session runs; CI's slow tier still runs it
@pytest.mark.slow
def test_the_lease_dry_run_runs_every_step_on_cpu(tmp_path):
    """`python -m benchmarks.gpu_check --lease --dry-run`: every step of both commands at toy sizes, each record
    written as its step ends (about a minute and a half on two cores)."""
    status = gpu_check.main(["--lease", "--dry-run", "--out", str(tmp_path)])
    records = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in tmp_path.glob("cpu-dryrun-*.jsonl")
               if not p.name.endswith("-steps.jsonl")}
    failed = [(r["label"], r.get("output_tail", "")[-600:]) for rs in records.values() for r in rs
              if r["status"] != "ok"]
    assert status == 0 and not failed, failed
    steps = {name.removeprefix("cpu-dryrun-").removesuffix(".jsonl"): rs for name, rs in records.items()}
    assert set(steps) == {"preflight", "decode_sweep", "rollout_rl", "rollout_peer", "train_step", "colocated_smoke",
                          "tests"}
    [pre] = steps["preflight"]
    assert pre["read_gb_s"] > 0 and pre["copy_gb_s"] > 0 and pre["gemm_tflops"] > 0
    sweep = [r for r in steps["decode_sweep"] if "skipped" not in r]
    # triton runs on a CPU only in its interpreter, which tests/conftest.py picks without a GPU
    backends = ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]
    plain = [(r["backend"], r["batch"]) for r in sweep if not r["compiled"]]
    assert plain == [(b, n) for b in backends for n in (1, 2, 4)]
    # then the model's layers compiled (rollout.compile) on the last backend
    assert [(r["backend"], r["batch"]) for r in sweep if r["compiled"]] == [(backends[-1], n) for n in (1, 2, 4)]
    assert all(0 < r["roofline_fraction"] for r in sweep)
    # the small shape one forward a read, then eight (multi-step decoding); the large one in the second call
    assert [(r["call"], r["decode_steps"]) for r in steps["rollout_rl"]] == [(1, 1), (1, 8), (2, 1)]
    assert steps["rollout_rl"][1]["host_reads"] < steps["rollout_rl"][1]["engine_steps"]
    for rec in steps["rollout_rl"] + steps["rollout_peer"]:
        assert rec["captures_in_window"] == 0 and "checks_failed" not in rec
        assert rec["parts"]["body"]["tokens"] > 0 and rec["roofline_fraction"] > 0
    [peer] = steps["rollout_peer"]
    assert peer["hf_cache"] == "static" and peer["hf_generate_tok_s"] > 0 and peer["speedup"] > 0
    log = [json.loads(x) for x in (tmp_path / "cpu-dryrun-rollout_rl-demo-steps.jsonl").read_text().splitlines()]
    runs: dict[tuple, list[dict]] = {}
    for x in log:
        runs.setdefault((x["run"], x["decode_steps"]), []).append(x)
    assert sorted(k for _, k in runs) == [1, 1, 8]
    for (_, k), lines in runs.items():  # a multi-step read samples on for rows that ended within it
        made = sum(x["sampled"] for x in lines)
        assert made == steps["rollout_rl"][0]["tokens"] if k == 1 else made >= steps["rollout_rl"][0]["tokens"]
    assert steps["colocated_smoke"][0]["replica_equals_cast_master"] is True
    assert "CHECK FAILED" not in (tmp_path / "cpu-dryrun-summary.md").read_text()


def test_a_failed_capture_check_is_flagged_and_fails_the_check():
    rec = {"step": "rollout_rl", "label": "RL", "status": "ok", "wall_s": 1, "model": "m", "engine_tok_s": 1.0,
           "roofline_fraction": 0.5, "parts": {}, "captures_in_window": 3, "checks_failed": ["captures_in_window"]}
    assert "CHECK FAILED: captures_in_window = 3" in gpu_check.summary_line(rec)


def test_a_step_cut_at_its_limit_keeps_the_records_it_printed(tmp_path):
    (tmp_path / "prints_then_hangs.py").write_text(
        "import json, time\nprint(json.dumps({'batch': 1}), flush=True)\nprint('{\"cut', flush=True)\n"
        "time.sleep(60)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    recs = gpu_check.run_step(gpu_check.Step("sweep", "a sweep cut short", ["prints_then_hangs"], 3, call=1), env)
    assert [(r["status"], r.get("batch")) for r in recs] == [("partial", 1), ("timeout", None)]
    assert all(r["call"] == 1 for r in recs)


def test_every_model_the_train_step_accepts_has_a_workload():
    """The 2026-11-27 lease's train step died with KeyError 'qwen3-0.6b': --model accepted a shape with no
    workload, which the CPU dry run (the demo model) never reached. The lease's train steps need qwen3-1.7b and
    qwen3-8b in benchmarks.train_step."""
    from benchmarks import train_step

    assert set(train_step.WORKLOADS) == set(train_step.CONFIGS)
    gpu_models = {s.argv[s.argv.index("--model") + 1] for s in gpu_check.lease_plan(dry_run=False)
                  if s.name == "train_step"}
    assert gpu_models <= set(train_step.CONFIGS), sorted(gpu_models - set(train_step.CONFIGS))


def test_the_lease_collects_every_test_file_that_asks_for_cuda():
    """The tests step collects only ``GPU_TEST_FILES`` (collecting all of tests/ cost a lease its time limit): a new
    test file that skips without CUDA must be listed there, or no GPU check ever runs it."""
    import re
    from pathlib import Path

    root = Path(gpu_check.__file__).resolve().parents[1]
    asks = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py")
            if re.search(r"cuda\.is_available|device_count\(\)", p.read_text())}
    assert asks <= set(gpu_check.GPU_TEST_FILES), sorted(asks - set(gpu_check.GPU_TEST_FILES))
    assert all((root / f).is_file() for f in gpu_check.GPU_TEST_FILES)


def test_limit_sets_a_steps_time_raised_or_lowered_and_refuses_an_unknown_step(capsys):
    """A lease that skips steps measured before gives the rest more time (the 2026-11-28 lease: tests=320)."""
    assert gpu_check.main(["--lease", "--plan-only", "--only", "preflight", "decode_sweep", "--limit",
                           "decode_sweep=320", "preflight=9"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"preflight\s+9 s", out) and re.search(r"decode_sweep\s+320 s", out) and "add up to 329 s" in out
    for bad in ("rollout_rl=60", "decode_sweep=soon"):  # rollout_rl: not in this plan's --only
        with pytest.raises(SystemExit):
            gpu_check.main(["--lease", "--plan-only", "--only", "decode_sweep", "--limit", bad])
        assert "--limit" in capsys.readouterr().err
