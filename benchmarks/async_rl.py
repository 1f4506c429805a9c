"""Asynchronous RL where it pays: a verifier with long-tailed latency, run by the synchronous colocated loop and by
the disaggregated placement at max_staleness 1 and 2, on the same machine, model, prompts and iterations.

    python -m benchmarks.async_rl [--iterations N] [--delay-s S] [--json]

The workload is the quick start's (its warm start, arithmetic word problems, 16 prompts x 8 samples per iteration),
graded by ``slow_verifier``: each response's grade takes a lognormal time (median ``--delay-s``, sigma 1: a few take
ten times the median, as sandboxed checks do) before its reward. The verifier sleeps; it does not compute, so the
colocated loop's devices idle through it, while disaggregated replicas and trainers overlap it with generation and
training. Reported per variant: samples trained per second of RL loop, the trainer's and the replicas' idle share
(disaggregated), staleness, and held-out accuracy after the same iterations (equal samples drawn). One JSON line
per variant with --json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"colocated": {}, "disaggregated k=1": {"k": 1}, "disaggregated k=2": {"k": 2}}
DELAY_ENV = "ASYNC_RL_DELAY_S"  # the verifier's median seconds, passed to the driver's reward threads


def slow_verifier(response: str, answer: str, task_id: str) -> float:
    """1 for the right answer, after a lognormal wait drawn from the response (the same response waits the same)."""
    import os

    from envs.arithmetic import extract_answer

    median = float(os.environ.get(DELAY_ENV, "0.05"))
    rng = random.Random(f"{task_id}\0{response}")
    time.sleep(median * math.exp(rng.gauss(0.0, 1.0)))
    got = extract_answer(response)
    return float(got is not None and int(got) == int(answer))


def config(variant: dict, iterations: int, pair: str | None = None) -> dict:
    """The run of ``variant``: the quick start's warm start, or ``pair``'s of the transfer suite (its model family,
    tokenizer and arithmetic task; 300 held-out prompts), graded by ``slow_verifier``."""
    raw = {"run": {"name": "async-rl", "iterations": iterations, "eval_every": iterations, "save_every": iterations,
                   "eval_samples": 0, "collapse_guard": False},
           "warmstart": {"steps": 260, "batch_size": 64, "lr": 3.0e-3},
           "env": {"name": "arithmetic", "num_train": 20000, "num_eval": 100,
                   "reward": {"function": "benchmarks.async_rl:slow_verifier"}},
           "rollout": {"prompts_per_iteration": 16, "samples_per_prompt": 8, "max_tokens": 40, "env_workers": 16},
           "algorithm": {"tau": 0.2, "minibatches": 2},
           "optimizer": {"lr": 4.0e-4},
           "checkpoint_engine": {"bucket_mb": 1}}
    if pair is not None:
        from benchmarks.transfer import PAIRS, pair_config

        if PAIRS[pair]["env"]["name"] != "arithmetic" or PAIRS[pair].get("backend"):
            raise SystemExit(f"--pair {pair}: the slow verifier grades the arithmetic task on the native engines")
        theirs = pair_config(pair, iterations, [])
        raw["warmstart"] = theirs["warmstart"]
        raw["model"] = theirs["model"]
        raw["env"] = {**theirs["env"], "num_eval": 300, "reward": raw["env"]["reward"]}
    if "k" in variant:
        raw["cluster"] = {"placement": "disaggregated"}
        raw["algorithm"]["max_staleness"] = variant["k"]
    return raw


def run_variant(name: str, iterations: int, out: Path, pair: str | None = None) -> dict:
    import rl

    run_dir = out / (pair or "quickstart") / name.replace(" ", "-").replace("=", "")
    raw = config(VARIANTS[name], iterations, pair)
    summary = rl.train(raw, run_dir)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = sum(r.get("trained_samples", 0) for r in records)
    wall = summary["wall_s"]
    row = {"variant": name, "iterations": len(records), "trained_samples": trained, "loop_s": wall,
           "samples_per_s": round(trained / wall, 3),
           "reward_s_per_iter": round(sum(r["time_reward"] for r in records) / len(records), 3),
           "initial_accuracy": summary["initial_accuracy"], "final_accuracy": summary["final_accuracy"],
           "pair": pair or "quickstart", "held_out_prompts": raw["env"]["num_eval"]}
    if "k" in VARIANTS[name]:
        row.update(trainer_idle_share=round(sum(r["time_trainer_idle"] for r in records) / wall, 3),
                   rollout_idle_share=round(sum(r["time_rollout_idle"] for r in records) / wall, 3),
                   staleness_max=max(r["staleness_max"] for r in records),
                   stale_dropped=sum(r["stale_dropped"] for r in records))
    return row


def main() -> None:
    import os

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--delay-s", type=float, default=0.08, help="the verifier's median seconds per response")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "async-rl")
    p.add_argument("--pair", default=None, help="a transfer-suite pair of the arithmetic task (benchmarks.transfer) "
                                                "instead of the quick start's warm start, e.g. qwen2-arith")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ[DELAY_ENV] = str(args.delay_s)
    rows = [run_variant(v, args.iterations, args.out, args.pair) for v in args.variants]
    base = next((r["samples_per_s"] for r in rows if r["variant"] == "colocated"), None)
    print("| variant | samples/s | × colocated | reward s/iter | trainer idle | rollout idle | staleness max | "
          "dropped | accuracy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        r["delay_s"] = args.delay_s
        if base:
            r["speedup"] = round(r["samples_per_s"] / base, 3)
        print(f"| {r['variant']} | {r['samples_per_s']} | {r.get('speedup', '-')} | {r['reward_s_per_iter']} | "
              f"{r.get('trainer_idle_share', '-')} | {r.get('rollout_idle_share', '-')} | "
              f"{r.get('staleness_max', '-')} | {r.get('stale_dropped', '-')} | "
              f"{r['initial_accuracy']:.3f} → {r['final_accuracy']:.3f} |")
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
