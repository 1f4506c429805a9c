"""Learning rate against model size on the demo task: held-out accuracy (greedy and sampled) and health.

    python -m benchmarks.lr_sweep [--models demo wide] [--lrs 1e-4 4e-4 1.6e-3] [--iterations 30] [--json]

Each cell is one ``rl train configs/quickstart.yaml`` run with ``optimizer.lr`` set, on the quick start's
model (0.9 M parameters) or a wider one built the same way (``warmstart.architecture``, through
transformers' config classes, with its own SFT warm start). The table lists the initial and final held-out
accuracy greedy and sampled at the rollout temperature, the lowest policy entropy, the largest train–infer
log-prob difference, and how many iterations warned of a collapse. The last line with --json is one JSON
object holding every row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: model name -> config overrides (the quick start's own, and a 4x wider model of the same family)
MODELS = {
    "demo": [],
    "wide": ["warmstart.architecture.hidden_size=256", "warmstart.architecture.intermediate_size=768",
             "warmstart.architecture.num_attention_heads=8", "warmstart.architecture.num_key_value_heads=4"],
}


def run(model: str, lr: float, iterations: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{model}-lr{lr:g}"
    args = [sys.executable, "-m", "rl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir",
            str(run_dir), "--set", f"optimizer.lr={lr}", "--set", f"run.iterations={iterations}"]
    for s in MODELS[model] + extra:
        args += ["--set", s]
    if not (run_dir / "summary.json").is_file():
        subprocess.run(args, check=True, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    entropy = [r["entropy"] for r in records if r.get("entropy") is not None]
    diff = [r["logprob_diff_max"] for r in records if r.get("logprob_diff_max") is not None]
    return {"model": model, "lr": lr, "iterations": len(records), **summary,
            "min_entropy": round(min(entropy), 3) if entropy else None,
            "first_entropy": round(entropy[0], 3) if entropy else None,
            "max_logprob_diff": max(diff) if diff else None,
            "collapse_warnings": sum(r.get("warn_entropy_collapse", 0) + r.get("warn_reward_collapse", 0)
                                     for r in records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 4e-4, 1.6e-3])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "lr-sweep")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [run(m, lr, args.iterations, args.out, args.set) for m in args.models for lr in args.lrs]
    print("| model | lr | greedy initial → final (best) | sampled initial → final | entropy first → min | "
          "collapse warnings | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        sampled = (f"{r['initial_accuracy_sampled']:.3f} → {r['final_accuracy_sampled']:.3f}"
                   if r.get("initial_accuracy_sampled") is not None else "-")
        print(f"| {r['model']} | {r['lr']:g} | {r['initial_accuracy']:.3f} → {r['final_accuracy']:.3f} "
              f"({r['best_accuracy']:.3f}) | {sampled} | {r['first_entropy']} → {r['min_entropy']} | "
              f"{r['collapse_warnings']} | {r['wall_s']:.0f} |")
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
