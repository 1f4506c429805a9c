"""One command for a person with a GPU: the GPU tests, then every GPU figure the project reports.

    python -m benchmarks.gpu_check                              # records under benchmarks/results/<gpu>-*.jsonl
    python -m benchmarks.gpu_check --only tests decode          # some steps
    python -m benchmarks.gpu_check --dry-run --out /tmp/check   # the same plan on CPU at toy sizes (< 5 minutes)
    python -m benchmarks.gpu_check --quick --deadline 540       # smaller workloads, for a leased GPU's minutes
    python -m benchmarks.gpu_check --lease                      # the plan of a lease's first command (<= 560 s)
    python -m benchmarks.gpu_check --lease --call 2             # its optional second command (<= 180 s)
    python -m benchmarks.gpu_check --lease --plan-only          # print both commands' steps and limits, and stop
    python -m benchmarks.gpu_check --lease --dry-run            # both commands' steps on CPU at toy sizes (~1 min)

The lease plan (``lease_plan``) fits one leased GPU: about 100 s of cold start, then one command of at most
``LEASE_S`` and an optional second of at most ``LEASE_SECOND_S``. In value order: preflight with the read, copy and
GEMM rooflines (``benchmarks.preflight``); the decode-step sweep, batch 1..512 on the 0.6 B and 8 B Qwen3 shapes,
torch and triton attention (``benchmarks.decode_sweep``); the RL-scale rollout on 0.6 B, 512 sequences, with its
per-step log (``benchmarks.rollout --workload rl``); the same-GPU peer, ``generate`` with a static cache compiled
against the native engine on the fixed workload (``--hf-static``); the 1.7 B train step at 16k and 32k tokens; one
colocated iteration split by phase (``benchmarks.colocated_smoke``). The second command: the RL-scale rollout and a
train step on the 8 B shape.

Steps, each its own process with its own time limit, so that a crash, an out-of-memory or a hang in one loses
none of the others' figures:

- ``tests``: the suite's GPU tests and its sync/capture checks (``pytest -k "cuda or sync or capture"``);
- ``decode``: rollout tok/s of the ~0.6 B Qwen3-shape RL workload, native engine with each attention backend,
  CUDA graphs on and off (``benchmarks.rollout --workload rl``), and vLLM beside it when it is installed;
- ``weight_update``: a 16 GiB update through the checkpoint engine against the copy floor, bf16 weights and the
  fp32-master -> bf16 path (``benchmarks.weight_update_cuda``);
- ``train_step``: the ~1 B Qwen3-shape train step, MFU against the measured matmul peak and the GPU's nominal
  dense bf16 peak (``benchmarks.train_step``);
- ``rl_iteration``: one whole RL iteration of the 0.6 B shape on Ray, time per phase (``benchmarks.rl_iteration``).

Each step's records go to ``<out>/<gpu>-<step>.jsonl`` (one JSON object per line, with ``status``: ok, failed or
timeout, and ``wall_s``), and ``<out>/<gpu>-summary.md`` is the one-page summary of all of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.roofline import NOMINAL_BF16_TFLOPS, nominal

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Step:
    """One measurement: ``python -m <argv>`` under ``timeout_s``; its JSON records go to ``<gpu>-<name>.jsonl``."""

    name: str
    label: str
    argv: list[str]
    timeout_s: int
    extra: dict = field(default_factory=dict)  # keys added to each of its records (the variant it measured)
    call: int = 0  # of a lease plan: the command it belongs to (1, or 2: the optional second); 0 elsewhere


#: the test files that hold GPU tests or the sync/capture/IPC checks: the tests step collects only these (on the
#: 2026-11-27 lease, collecting all of tests/ found 68 by keyword, among them chart and image checks, and spent its
#: 120 s before the end); tests/test_gpu_check.py keeps every file that asks for CUDA in this list
GPU_TEST_FILES = tuple(f"tests/test_{n}.py" for n in (
    "sync_capture", "training_sync", "checkpoint_engine", "pinned_buffers", "inference", "arena", "flex_eligibility",
    "training_engine", "packed_training", "algorithm", "memory", "worker_device", "vllm_gpu_path", "engine_factory",
    "server", "triton_attention"))

#: a leased machine: its cold start (before the command runs), then the most seconds the step limits of its first
#: command and of its optional second may add up to (a command runs 10 minutes at most; the margin is the check's own
#: start and the records' writing)
LEASE_COLD_S, LEASE_S, LEASE_SECOND_S = 100, 560, 180


def lease_plan(dry_run: bool) -> list[Step]:
    """The check that fits one leased GPU (``--lease``): the steps of its first command (``call`` 1, limits adding
    up to at most ``LEASE_S``) and of its optional second (``call`` 2, at most ``LEASE_SECOND_S``), each in value
    order (what the issue needs measured first comes first), each step's records written as it ends.
    ``dry_run``: the same steps at toy sizes on CPU. ``{out}`` and ``{gpu}`` in a step's argv are the records'
    directory and the GPU's short name (``main`` puts them in)."""
    dev, dtype = ("cpu", "float32") if dry_run else ("cuda", "bfloat16")
    small, large = ("demo", "demo") if dry_run else ("qwen3-0.6b", "qwen3-8b")
    on = ["--device", dev, "--dtype", dtype]
    # the rollouts attend through the triton kernel on a GPU: its graphs are keyed by batch size alone and captured
    # as the engine starts, so a capture inside the timed window fails the rollout's check (torch's graphs are also
    # keyed by width, captured at first use); the sweep has torch beside it
    attend = ["--attention", "auto" if dry_run else "triton"]
    preflight = Step("preflight", "preflight: versions, free memory, read/copy/GEMM rooflines",
                     ["benchmarks.preflight", "--json"], 25, call=1)
    shapes = small if dry_run else f"{small} and {large}"
    sweep = Step("decode_sweep", f"decode-step sweep, batch 1..{4 if dry_run else 512}, {shapes} shapes, torch and "
                 "triton attention",
                 ["benchmarks.decode_sweep", *on, "--backends", "torch", "triton", "--json"]
                 + (["--models", "demo", "--batches", "1", "2", "4", "--context", "32", "--tries", "1"] if dry_run else
                    ["--models", small, large, "--context", "1024"])
                 # then the small shape's layers compiled (rollout.compile): last, so that a cut keeps the rest
                 + ["--compile", small], 100, call=1)

    def rollout_rl(model: str, limit: int, call: int, decode_steps: tuple[str, ...] = ("1",)) -> Step:
        # the RL scale: 64 prompts x 8 samples, prompts 128..512, outputs long-tailed up to 2048 (benchmarks.rollout_rl)
        size = ["--prompts", "2", "--samples", "2"] if dry_run else ["--prompts", "64", "--samples", "8"]
        return Step("rollout_rl", f"RL-scale rollout, native engine, {model} shape, ramp/body/tail, "
                    f"{' and '.join(decode_steps)} decode step(s) a read",
                    ["benchmarks.rollout", "--workload", "rl", "--model", model, *on, *attend, *size, "--skip-hf",
                     "--no-eager", "--decode-steps", *decode_steps,
                     "--step-log", f"{{out}}/{{gpu}}-rollout_rl-{model}-steps.jsonl", "--json"],
                    limit, call=call)

    fixed = ["--prompts", "2", "--samples", "2", "--prompt-len", "8", "--output-len", "8"] if dry_run else \
        ["--prompts", "16", "--samples", "8", "--prompt-len", "512", "--output-len", "512"]
    peer = Step("rollout_peer", "fixed workload: native engine against generate, static cache, compiled",
                ["benchmarks.rollout", "--workload", "fixed", "--model", small, *on, *attend, *fixed, "--hf-static",
                 "--no-eager", "--json"], 120, call=1)

    def train(model: str, tokens: list[str], limit: int, call: int) -> Step:
        return Step("train_step", f"train step, {model} shape, {' and '.join(tokens)} tokens",
                    ["benchmarks.train_step", "--model", model, *on, "--variants", "base", "--tokens", *tokens,
                     "--repeats", "1" if dry_run or call == 2 else "2", "--json"], limit, call=call)

    smoke = Step("colocated_smoke", "one colocated iteration by phase (trainer + native engine, IPC buffers)",
                 ["benchmarks.colocated_smoke", "--model", small, *on, "--json"]
                 + (["--prompts", "2", "--samples", "2", "--max-tokens", "8"] if dry_run else
                    ["--prompts", "8", "--samples", "4", "--max-tokens", "64"]), 105, call=1)  # 85.9 s on 2026-11-28
    mid = "demo" if dry_run else "qwen3-1.7b"
    # the second command opens with what only a GPU can prove of the new kernels (triton decode in bf16, graphs
    # captured at start with the sampler inside, sync-free steps): the first command's figures mean little if these
    # fail; an 8 B train step (fp32 masters and Muon state near 100 GB) does not fit beside them
    kernels = Step("tests", "GPU tests of the decode kernel, graphs and sync-free steps",
                   ["pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-k", "cuda", "tests/test_triton_attention.py",
                    "tests/test_sync_capture.py", "tests/test_inference.py", "tests/test_training_sync.py"], 60, call=2)
    # the small shape also with 8 forwards a read (multi-step decoding), after its one-step record is printed: a run
    # cut at the step's limit keeps that
    steps = [preflight, sweep, rollout_rl(small, 110, 1, ("1", "8")), peer,
             train(mid, ["256", "512"] if dry_run else ["16384", "32768"], 100, 1), smoke,
             kernels, rollout_rl(large, 120, 2)]
    if dry_run:  # toy sizes, but on a CPU shared with others: the limits are the GPU's concern, the commands are ours
        for s in steps[1:]:
            s.timeout_s = max(s.timeout_s, 300)
    return steps


def format_plan(steps: list[Step], budgets: bool = True) -> str:
    """The plan as lines: each step with its limit, then the limits' sum (per command of a lease plan, against its
    budget unless not ``budgets``: a dry run's limits are raised for a shared CPU)."""
    lines = []
    calls = sorted({s.call for s in steps})
    for call in calls:
        if call:
            lines.append(f"command {call}{' (optional)' if call == 2 else ''}:")
        for i, s in enumerate([s for s in steps if s.call == call], 1):
            lines.append(f"{i:2d}. {s.name:16s} {s.timeout_s:4d} s  {s.label}")
        total = sum(s.timeout_s for s in steps if s.call == call)
        budget = {1: f" (at most {LEASE_S} s after a ~{LEASE_COLD_S} s cold start)",
                  2: f" (at most {LEASE_SECOND_S} s)"}.get(call, "") if budgets else ""
        lines.append(f"    limits add up to {total} s{budget}")
    return "\n".join(lines)


def gpu_slug(dry_run: bool) -> str:
    """A short file-name part for this GPU: "h100", "h200", "a100"...; "cpu-dryrun" for a dry run."""
    if dry_run or not torch.cuda.is_available():
        return "cpu-dryrun"
    name = torch.cuda.get_device_name(0)
    m = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"\W+", "-", name)).lower()


def nominal_tflops(name: str) -> float | None:
    """The nominal dense bf16 peak of a GPU named ``name`` (None when unknown)."""
    return nominal(NOMINAL_BF16_TFLOPS, name)


def vllm_installed() -> bool:
    """Whether vLLM is installed here, found without importing it (an import takes many seconds and changes
    process-wide state; a vLLM that is found but fails to import fails its step with the reason)."""
    return importlib.util.find_spec("vllm") is not None


def plan(dry_run: bool, gpus: int, with_vllm: bool, quick: bool = False) -> list[Step]:
    """The steps of a check: full sizes on a GPU, toy sizes on the CPU with ``dry_run``; ``quick``: the same
    figures on smaller workloads, for a leased GPU's few minutes (the records say which sizes ran)."""
    dev = "cpu" if dry_run else "cuda"
    smaller = quick and not dry_run
    tests = Step("tests", "GPU tests and sync/capture/IPC checks",
                 ["pytest", "-q", "-rfs", "-p", "no:cacheprovider", "--continue-on-collection-errors", "-k",
                  "cuda or sync or capture or ipc", *GPU_TEST_FILES], 180 if smaller else 420)
    decode = []
    model, dtype = ("demo", "float32") if dry_run else ("qwen3-0.6b", "bfloat16")
    for attention in ("torch", "flex"):
        args = ["benchmarks.rollout", "--workload", "rl", "--model", model, "--device", dev, "--dtype", dtype,
                "--attention", attention, "--skip-hf", "--json"]
        if dry_run:
            args += ["--prompts", "4", "--samples", "2"]
        elif smaller:
            args += ["--prompts", "16", "--samples", "4", "--output-len", "512"]
        decode.append(Step("decode", f"rollout, native engine, {attention} attention", args, 150 if smaller else 300,
                           {"attention": attention}))
    if with_vllm:
        args = ["benchmarks.rollout", "--workload", "rl", "--model", model, "--device", dev, "--dtype", dtype,
                "--engine", "both", "--skip-hf", "--json"]
        if dry_run:
            args += ["--prompts", "4", "--samples", "2"]
        decode.append(Step("decode", "rollout, native engine and vLLM", args, 900, {"attention": "vllm-both"}))
    if dry_run:
        update = [Step("weight_update", "weight update (CPU: shared memory)",
                       ["benchmarks.weight_update", "--gib", "0.0625", "--repeats", "1", "--floor-repeats", "2",
                        "--json"], 300)]
    else:
        update = [Step("weight_update", f"weight update, 16 GiB, {w}",
                       ["benchmarks.weight_update_cuda", "--gib", "16", "--bucket-mb", "1024", "--repeats", "2",
                        "--weights", w, "--json"], 300, {"weights": w}) for w in ("bf16", "fp32-to-bf16")]
    train = Step("train_step", "train step",
                 ["benchmarks.train_step", "--model", "demo" if dry_run else "1b", "--device", dev, "--dtype", dtype,
                  "--variants", "base", "--repeats", "1" if dry_run else "3", "--json"]
                 + (["--tokens", "8192"] if smaller else []), 150 if smaller else 300)
    iteration = Step("rl_iteration", "one RL iteration",
                     ["benchmarks.rl_iteration", "--model", "tiny-qwen3" if dry_run else "qwen3-0.6b", "--device", dev,
                      "--iterations", "2", "--json"] + (["--prompts", "4", "--samples", "2"] if dry_run else [])
                     + (["--prompts", "16", "--samples", "4", "--max-tokens", "256"] if smaller else []),
                     240 if smaller else 540)
    steps = [tests, *decode, *update, train, iteration]
    two = Step("tests_two_gpus", "two-GPU tests", ["pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k",
                                                   "across_device_orderings or over_nccl",
                                                   "tests/test_checkpoint_engine.py"], 600)
    return steps if gpus < 2 or dry_run else [*steps, two]


def run_step(step: Step, env: dict[str, str], log: Path | None = None) -> list[dict]:
    """Run one step; its JSON records with status and wall time, and when it fails or runs past its limit the
    records it printed before (status "partial": measured, the step unfinished) and one failure record with the
    output's end; its whole output to ``log`` when given."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", *step.argv]
    base = {"step": step.name, "label": step.label, **step.extra, **({"call": step.call} if step.call else {})}
    # its own process group: at the time limit the step's children (compile workers, Ray) go with it, and
    # none of them keeps the output pipes open
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    status = "ok"
    try:
        stdout, stderr = proc.communicate(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        status = "timeout"
    wall = step.timeout_s if status == "timeout" else round(time.perf_counter() - t0, 1)
    if log:
        log.write_text(stdout + stderr)
    if step.argv[0] == "pytest" and status == "ok":
        return [{**base, **pytest_counts(stdout), "status": "ok" if proc.returncode == 0 else "failed",
                 "wall_s": wall, **({} if proc.returncode == 0 else {"output_tail": stdout[-3000:]})}]
    records = printed_records(stdout)
    if status == "ok" and (proc.returncode != 0 or not records):
        status = "failed"
    if status == "ok":
        return [{**base, "status": "ok", "wall_s": wall, **r} for r in records]
    # a sweep cut at its limit, or killed by an out-of-memory at its largest batch, keeps the points it measured
    return [{**base, "status": "partial", "wall_s": wall, **r} for r in records] + \
        [{**base, "status": status, "wall_s": wall, "output_tail": (stdout + stderr)[-3000:]}]


def printed_records(stdout: str) -> list[dict]:
    """The JSON objects a step printed, one a line (a line cut short by a kill is left out)."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def pytest_counts(out: str) -> dict[str, int]:
    """passed/failed/skipped/... counts from pytest's last line."""
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", last)}


def add_mfu(rec: dict, gpu_name: str) -> dict:
    """Put the train step's MFU against the GPU's nominal peak beside the measured-peak MFU."""
    peak = nominal_tflops(gpu_name)
    base = rec.get("base")
    if peak and isinstance(base, dict) and rec.get("model_tflop"):
        rec["nominal_bf16_tflops"] = peak
        base["mfu_nominal"] = round(rec["model_tflop"] / base["step_s"] / peak, 4)
    return rec


def summary_line(rec: dict) -> str:
    """One line of the summary for one record."""
    head = f"- **{rec['label']}** ({rec['status']}, {rec['wall_s']} s)"
    if rec["status"] not in ("ok", "partial"):
        tail = rec.get("output_tail", "").strip().splitlines()
        return f"{head}: {tail[-1] if tail else 'no output'}"
    if rec.get("checks_failed"):
        head += f" CHECK FAILED: {', '.join(rec['checks_failed'])} = {rec.get('captures_in_window')}"
    # a point a step could not measure here (a backend this device lacks, a batch too large); pytest's is a count
    if isinstance(rec.get("skipped"), str):
        return f"{head}: {rec.get('model')} {rec.get('backend')} {rec.get('batch', '')} skipped: {rec['skipped']}"
    s = rec["step"]
    if s.startswith("tests"):
        return f"{head}: " + ", ".join(f"{v} {k}" for k, v in rec.items() if k in
                                       ("passed", "failed", "skipped", "error", "errors"))
    if s == "decode":
        figs = [f"{k} {rec[k]}" for k in ("engine_tok_s", "engine_eager_tok_s", "cuda_graph_speedup",
                                          "roofline_fraction", "captures_in_window", "native_tok_s", "vllm_tok_s",
                                          "native_over_vllm", "same_tokens") if k in rec]
        return f"{head}: " + ", ".join(figs)
    if s == "decode_sweep":
        return (f"{head}: {rec['model']} {rec['backend']} batch {rec['batch']}: {rec['step_s']} s/step "
                f"({rec['mode']}; eager {rec.get('eager_step_s')}), {rec['tok_s']} tok/s, read roofline fraction "
                f"{rec['roofline_fraction']} (nominal {rec.get('roofline_fraction_nominal')})")
    if s in ("rollout_rl", "rollout_peer"):
        parts = rec.get("parts", {})
        figs = [f"{rec['model']}: engine {rec['engine_tok_s']} tok/s, read roofline fraction "
                f"{rec['roofline_fraction']} (body {parts.get('body', {}).get('roofline_fraction')} over "
                f"{parts.get('body', {}).get('steps')} steps at {parts.get('body', {}).get('mean_rows')} rows, tail "
                f"{parts.get('tail', {}).get('roofline_fraction')} over {parts.get('tail', {}).get('steps')} steps), "
                f"captures in the window {rec.get('captures_in_window')}, preemptions {rec.get('preemptions')}"]
        if rec.get("hf_generate_tok_s"):
            figs.append(f"generate ({rec.get('hf_cache')} cache, compiled {rec.get('hf_compiled')}) "
                        f"{rec['hf_generate_tok_s']} tok/s, engine / generate {rec.get('speedup')}")
        return f"{head}: " + "; ".join(figs)
    if s == "weight_update":
        figs = [f"{k} {rec[k]}" for k in ("bytes", "update_s", "floor_s", "ratio", "gb_per_s", "bitwise_equal")
                if k in rec]
        return f"{head}: " + ", ".join(figs)
    if s == "train_step":
        b = rec.get("base", {})
        return (f"{head}: {rec.get('params')} params, {b.get('step_s')} s/step, {b.get('tokens_per_s')} tok/s, "
                f"MFU {b.get('mfu')} of the measured matmul peak ({rec.get('matmul_peak_tflops')} TFLOP/s), "
                f"{b.get('mfu_nominal')} of the nominal ({rec.get('nominal_bf16_tflops')}); "
                f"first step {b.get('first_step_s')} s (compiles, est. {b.get('compile_s_est')} s)")
    if s == "colocated_smoke":
        return (f"{head}: replica equals the cast master {rec.get('replica_equals_cast_master')}, phases "
                f"{rec.get('phase_s')}, peak bytes {rec.get('peak_bytes')}")
    if s == "preflight":
        return f"{head}: torch {rec.get('torch')}, {rec.get('device')}, free {rec.get('free_gib')} GiB, " \
               f"read {rec.get('read_gb_s')} GB/s (nominal {rec.get('nominal_read_gb_s')}), copy " \
               f"{rec.get('copy_gb_s')} GB/s, GEMM {rec.get('gemm_tflops')} TFLOP/s (nominal " \
               f"{rec.get('nominal_bf16_tflops')}), packages {rec.get('packages')}"
    if s == "rl_iteration":
        phases = ", ".join(f"{k[5:]} {rec[k]} s" for k in rec if k.startswith("time_"))
        return f"{head}: iteration {rec.get('iteration_s')} s ({phases})"
    return head


def main(argv: list[str] | None = None) -> int:
    """Run the plan, write each step's records and the summary; exit status 1 if any step did not succeed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the same plan on CPU at toy sizes")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (decode 64 sequences up to 512 tokens, "
                    "train step 8K tokens, RL iteration 64 x 256 tokens) that fit a leased GPU's 10 minutes")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="directory for the records")
    ap.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps, in this order (tests, decode, "
                    "weight_update, train_step, rl_iteration)")
    ap.add_argument("--skip", nargs="+", metavar="STEP", default=[], help="run all steps but these")
    ap.add_argument("--attention", nargs="+", choices=["torch", "flex", "vllm-both"], help="decode variants to run")
    ap.add_argument("--weights", nargs="+", choices=["bf16", "fp32-to-bf16"], help="weight-update variants to run")
    ap.add_argument("--step-timeout", type=int, metavar="S", help="cap every step's time limit at S seconds (a "
                    "leased machine with little time left: a step cut short is recorded as a timeout)")
    ap.add_argument("--limit", nargs="+", default=[], metavar="STEP=S", help="set these steps' time limits (raise "
                    "or lower), e.g. tests=300 when a lease skips steps measured before")
    ap.add_argument("--deadline", type=int, metavar="S", help="the whole check's time budget: each step gets at most "
                    "what is left of S seconds, and a step with under 20 s left is recorded as skipped")
    ap.add_argument("--logs", type=Path, metavar="DIR", help="write each step's whole output to DIR/NN-<step>.log")
    ap.add_argument("--lease", action="store_true", help=f"the plan that fits one leased GPU (its first command's "
                    f"limits add up to at most {LEASE_S} s, its optional second's to {LEASE_SECOND_S} s; value order)")
    ap.add_argument("--call", choices=["1", "2", "all"], help="with --lease: the command to run (default 1 on a GPU; "
                    "2: the optional second; all: both, a dry run's default, to prove every step); --plan-only "
                    "prints both")
    ap.add_argument("--plan-only", action="store_true", help="print the plan and stop")
    a = ap.parse_args(argv)
    if not a.dry_run and not a.plan_only and not torch.cuda.is_available():
        ap.error("no CUDA device here; --dry-run runs the plan on the CPU")
    gpus = 0 if a.dry_run else torch.cuda.device_count()
    gpu_name = "CPU (dry run)" if a.dry_run or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    # importing vLLM takes seconds: only ask when its decode step could run
    wants_vllm = (not a.only or "decode" in a.only) and "decode" not in a.skip and \
        (not a.attention or "vllm-both" in a.attention)
    with_vllm = wants_vllm and vllm_installed()
    call = a.call or ("all" if a.dry_run else "1")
    calls = (1, 2) if call == "all" or a.plan_only else (int(call),)
    steps = [s for s in (lease_plan(a.dry_run) if a.lease else plan(a.dry_run, gpus, with_vllm, a.quick))
             if (not a.lease or s.call in calls) and (not a.only or s.name in a.only) and s.name not in a.skip
             and (not a.attention or s.extra.get("attention", a.attention[0]) in a.attention)
             and (not a.weights or s.extra.get("weights", a.weights[0]) in a.weights)]
    if a.only:  # in the order asked: a short lease measures what matters most first
        steps.sort(key=lambda s: a.only.index(s.name))
    limits = {}
    for item in a.limit:
        name, _, secs = item.partition("=")
        if not secs.isdigit() or name not in {s.name for s in steps}:
            ap.error(f"--limit {item!r}: expected STEP=SECONDS for a step of this plan")
        limits[name] = int(secs)
    for s in steps:
        s.timeout_s = min(limits.get(s.name, s.timeout_s), a.step_timeout or 10**9)
    if a.dry_run:  # what a lease would run on a GPU, beside the plan this dry run runs
        print(f"plan on a leased GPU (--lease):\n{format_plan(lease_plan(False))}", flush=True)
    if a.dry_run or a.lease or a.plan_only:
        print(f"plan ({'lease' if a.lease else 'quick' if a.quick else 'full'}"
              f"{', CPU dry run at toy sizes, limits raised for a shared CPU' if a.dry_run else ''}):\n"
              f"{format_plan(steps, budgets=not a.dry_run)}", flush=True)
    if a.plan_only:
        return 0
    slug = gpu_slug(a.dry_run)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.logs:
        a.logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    records: list[dict] = []
    t_start = time.monotonic()
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step.label} ...", file=sys.stderr, flush=True)
        left = None if a.deadline is None else int(a.deadline - (time.monotonic() - t_start))
        if left is not None and left < 20:
            recs = [{"step": step.name, "label": step.label, **step.extra, "status": "skipped", "wall_s": 0,
                     "output_tail": f"not run: {left} s of the {a.deadline} s deadline left"}]
        else:
            step.timeout_s = min(step.timeout_s, left or step.timeout_s)
            log = a.logs / f"{i:02d}-{step.name}.log" if a.logs else None
            step.argv = [x.replace("{out}", str(a.out)).replace("{gpu}", slug) for x in step.argv]
            recs = [add_mfu(r, gpu_name) if step.name == "train_step" else r for r in run_step(step, env, log)]
        with open(a.out / f"{slug}-{step.name}.jsonl", "a") as f:
            for r in recs:
                f.write(json.dumps({**r, "gpu": gpu_name}) + "\n")
        for r in recs:
            print(summary_line(r), file=sys.stderr, flush=True)
        records += recs
    lines = [f"# GPU check: {gpu_name}", "", f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} GPU(s), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; records in `{slug}-*.jsonl`.", ""]
    (a.out / f"{slug}-summary.md").write_text("\n".join(lines + [summary_line(r) for r in records]) + "\n")
    print(f"summary: {a.out / f'{slug}-summary.md'}", file=sys.stderr)
    return 0 if all(r["status"] == "ok" and not r.get("checks_failed") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
