"""LoRA against full fine-tuning on the quick start, at equal samples: held-out accuracy, gain, trainer peak memory
and weight-update seconds.

    python -m benchmarks.lora_learning [--variants full r8:4e-3 r1:4e-3] [--iterations 100] [--out DIR] [--json]

Each variant is one ``rl train configs/quickstart.yaml`` run (same seed, tasks, samples per iteration and
iterations): ``full`` as the quick start is (Muon, its learning rate), ``rRANK:LR`` with ``model.lora.rank`` RANK
(alpha 2·RANK, AdamW, the default targets) at learning rate LR. The gain is the final minus the initial held-out
greedy accuracy; ``of_full`` is a variant's gain over the full run's. ``--json``: the last line holds every row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def overrides(variant: str) -> list[str]:
    """``rl train --set`` arguments of a variant name ("full" or "rRANK:LR")."""
    if variant == "full":
        return []
    rank, _, lr = variant[1:].partition(":")
    return [f"model.lora.rank={int(rank)}", f"model.lora.alpha={2 * int(rank)}", f"optimizer.lr={float(lr)}"]


def run(variant: str, iterations: int, out: Path) -> dict:
    """One run (reused when its summary exists); its row."""
    run_dir = out / variant.replace(":", "-lr")
    args = [sys.executable, "-m", "rl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"), "--run-dir",
            str(run_dir), "--set", f"run.iterations={iterations}"]
    for s in overrides(variant):
        args += ["--set", s]
    if not (run_dir / "summary.json").is_file():
        subprocess.run(args, check=True, cwd=ROOT)
    s = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    updates = [r["time_weight_update"] for r in records if r.get("time_weight_update") is not None]
    peaks = [r["mem_train_peak_gib"] for r in records if r.get("mem_train_peak_gib") is not None]
    return {"variant": variant, "iterations": s["iterations"], "initial_accuracy": s["initial_accuracy"],
            "final_accuracy": s["final_accuracy"], "best_accuracy": s.get("best_accuracy"),
            "initial_accuracy_sampled": s.get("initial_accuracy_sampled"),
            "final_accuracy_sampled": s.get("final_accuracy_sampled"),
            "gain": round(s["final_accuracy"] - s["initial_accuracy"], 4), "wall_s": s.get("wall_s"),
            "weight_update_s_mean": round(sum(updates) / len(updates), 4) if updates else None,
            "train_peak_gib_max": max(peaks) if peaks else None}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["full", "r8:4e-3", "r1:4e-3"])
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "lora-learning")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = [run(v, a.iterations, a.out) for v in a.variants]
    full = next((r for r in rows if r["variant"] == "full"), None)
    for r in rows:
        r["of_full"] = round(r["gain"] / full["gain"], 3) if full and full["gain"] else None
        print(f"{r['variant']:>10}  acc {r['initial_accuracy']:.3f} -> {r['final_accuracy']:.3f} (best "
              f"{r['best_accuracy']}), gain {r['gain']:+.3f}, of full {r['of_full']}, train peak "
              f"{r['train_peak_gib_max']} GiB, update {r['weight_update_s_mean']} s, {r['wall_s']} s")
    if a.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
