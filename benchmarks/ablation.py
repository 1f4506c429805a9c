"""Ablation on the demo task: held-out accuracy after the same iterations, for K1.5 with Muon or
AdamW, with and without partial rollout.

    python -m benchmarks.ablation [--iterations N] [--seeds 0 1] [--json]

Each variant is one ``rl train configs/ablation.yaml --set ...`` run (same warm start, same
prompts per iteration, same seeds); the table lists initial, final and best held-out greedy
accuracy, wall time, and the partial-rollout counters. The last line with --json is one JSON
object holding every row.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "k1.5 + muon": [],
    "k1.5 + adamw": ["optimizer.kind=adamw"],
    "k1.5 + muon + partial rollout": ["rollout.partial.token_budget=6000"],
    "k1.5 + adamw + partial rollout": ["optimizer.kind=adamw", "rollout.partial.token_budget=6000"],
    "k1.5 + adamw, lr/4": ["optimizer.kind=adamw", "optimizer.lr=1.0e-4"],  # AdamW with a smaller step
}
DEFAULT = list(VARIANTS)[:4]


def run_variant(name: str, sets: list[str], seed: int, iterations: int | None, out: Path) -> dict:
    """One training run; returns its summary plus partial-rollout totals from metrics.jsonl."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    run_dir = out / f"{slug}-seed{seed}"
    args = [sys.executable, "-m", "rl.cli", "train", str(ROOT / "configs" / "ablation.yaml"), "--run-dir",
            str(run_dir), "--set", f"run.seed={seed}"]
    for s in sets + ([f"run.iterations={iterations}"] if iterations else []):
        args += ["--set", s]
    subprocess.run(args, check=True, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    totals = {k: sum(r.get(f"partial_{k}", 0) for r in records) for k in ("paused", "resumed", "dropped")}
    return {"variant": name, "seed": seed, **summary, **totals,
            "rollout_s_per_iter": round(sum(r["time_rollout"] for r in records) / len(records), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, help="override run.iterations of configs/ablation.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [run_variant(v, VARIANTS[v], s, args.iterations, args.out) for v in args.variants for s in args.seeds]
    print("| variant | seed | initial | final | best | paused | resumed | dropped | rollout s/iter | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['seed']} | {r['initial_accuracy']:.3f} | {r['final_accuracy']:.3f} | "
              f"{r['best_accuracy']:.3f} | {r['paused']} | {r['resumed']} | {r['dropped']} | "
              f"{r['rollout_s_per_iter']} | {r['wall_s']:.0f} |")
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
