"""benchmarks.gpu_check: the plan a person with a GPU runs, proven on CPU by its dry run."""

from __future__ import annotations

import json
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


def test_the_lease_plan_fits_one_command_in_value_order_and_says_why_a_step_is_skipped():
    """Issue 41: the limits add up to at most 540 s on a GPU, with or without vLLM; the steps come in value order,
    the colocated smoke among them; without vLLM its step stays in the plan, skipped with the reason."""
    for with_vllm in (False, True):
        steps = gpu_check.lease_plan(dry_run=False, with_vllm=with_vllm)
        assert [s.name for s in steps] == ["preflight", "tests", "weight_update", "weight_update", "decode",
                                           "train_step", "colocated_smoke", "decode"]
        assert sum(s.timeout_s for s in steps if not s.skip) <= gpu_check.LEASE_S == 540
        assert steps[0].timeout_s <= 15 and steps[1].timeout_s <= 150
        assert all(s.timeout_s <= 120 for s in steps[4:7])
        assert {s.extra.get("weights") for s in steps if s.name == "weight_update"} == {"bf16", "fp32-to-bf16"}
        assert all("4" == s.argv[s.argv.index("--gib") + 1] for s in steps if s.name == "weight_update")
        assert "qwen3-0.6b" in steps[5].argv and "--device" in steps[6].argv
        assert steps[-1].skip == ("" if with_vllm else "vLLM not installed")
    assert all(s.timeout_s for s in gpu_check.lease_plan(dry_run=True, with_vllm=False))  # the CPU dry run builds it


def test_a_dry_run_prints_the_lease_plan_and_a_lease_records_skipped_steps_in_place(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "plan on a leased GPU (--lease):" in out and "colocated_smoke" in out
    total = int(out.split("limits add up to ")[1].split()[0])
    assert total <= 540
    status = gpu_check.main(["--dry-run", "--lease", "--only", "preflight", "tests", "--out", str(tmp_path)])
    recs = [json.loads(x) for p in sorted(tmp_path.glob("*.jsonl")) for x in p.read_text().splitlines()]
    by_step = {r["step"]: r for r in recs}
    assert status == 1  # a skipped step is not a success
    assert by_step["preflight"]["status"] == "ok" and by_step["preflight"]["torch"]
    assert by_step["tests"]["status"] == "skipped" and "need a GPU" in by_step["tests"]["output_tail"]


def test_every_model_the_train_step_accepts_has_a_workload():
    """The 2026-11-27 lease's train step died with KeyError 'qwen3-0.6b': --model accepted a shape with no
    workload, which the CPU dry run (the demo model) never reached."""
    from benchmarks import train_step

    assert set(train_step.WORKLOADS) == set(train_step.CONFIGS)
    gpu_models = {s.argv[s.argv.index("--model") + 1] for s in gpu_check.lease_plan(dry_run=False, with_vllm=True)
                  if "--model" in s.argv}
    assert gpu_models <= set(train_step.CONFIGS)


def test_the_lease_collects_every_test_file_that_asks_for_cuda():
    """The lease's tests step collects only ``GPU_TEST_FILES`` (collecting all of tests/ cost its time limit): a new
    test file that skips without CUDA must be listed there, or no lease ever runs it."""
    import re
    from pathlib import Path

    root = Path(gpu_check.__file__).resolve().parents[1]
    asks = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py")
            if re.search(r"cuda\.is_available|device_count\(\)", p.read_text())}
    assert asks <= set(gpu_check.GPU_TEST_FILES), sorted(asks - set(gpu_check.GPU_TEST_FILES))
    assert all((root / f).is_file() for f in gpu_check.GPU_TEST_FILES)


def test_limit_sets_a_steps_time_raised_or_lowered_and_refuses_an_unknown_step(capsys):
    """A lease that skips steps measured before gives the rest more time (the 2026-11-28 lease: tests=320)."""
    assert gpu_check.main(["--lease", "--plan-only", "--only", "preflight", "tests", "--limit", "tests=320",
                           "preflight=9"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"preflight\s+9 s", out) and re.search(r"tests\s+320 s", out) and "add up to 329 s" in out
    for bad in ("decode=60", "tests=soon"):  # decode: not in this plan's --only
        with pytest.raises(SystemExit):
            gpu_check.main(["--lease", "--plan-only", "--only", "tests", "--limit", bad])
        assert "--limit" in capsys.readouterr().err
