"""``rl train CONFIG --run-dir RUN_DIR --auto-resume``, what the chart's entrypoint runs on every attempt of a job:
the driver is killed (SIGKILL, as a node lost or a Kubernetes restart would) during the run's very first save, and
the next attempt starts afresh instead of being refused forever; killed again during a later save, the next attempt
resumes from the newest complete checkpoint, saying which, and skips the one cut short. The killed drivers join the
test session's Ray cluster (as a launched run joins its cluster), so their workers go with them; the attempts that
finish run in this process. ``RL_CRASH_IN_SAVE`` makes each kill land at the same point of the save every time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from rl.cli import main as rl_main
from rl.loop.checkpoint import CRASH_ENV, MARKER, list_checkpoints
from tests.test_run import TINY

ROOT = Path(__file__).resolve().parents[1]


def _iterations(run: Path) -> list[int]:
    return [json.loads(x)["iteration"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_killed_in_its_saves_goes_on_with_auto_resume(ray_cluster, tmp_path, capsys, monkeypatch):
    cfg = json.loads(json.dumps(TINY))
    # small: what is under test is the saves and the attempts, not what is learnt
    cfg["run"] = {"iterations": 1, "save_every": 1, "eval_samples": 0, "collapse_guard": False}
    cfg["env"]["num_eval"] = 4
    cfg["rollout"].update(prompts_per_iteration=2, max_tokens=12)
    config, run, ckpts = tmp_path / "run.yaml", tmp_path / "run", tmp_path / "run" / "checkpoints"
    config.write_text(yaml.safe_dump(cfg))
    auto = ["train", str(config), "--run-dir", str(run), "--auto-resume"]
    monkeypatch.setenv("COLUMNS", "400")  # the console's lines unwrapped

    def killed_in_save(at: str, *sets: str) -> str:
        """An attempt whose driver is killed at ``at`` of a save; returns what it printed."""
        joined = ("--set", f"cluster.ray_address={ray.get_runtime_context().gcs_address}")
        proc = subprocess.run([sys.executable, "-m", "rl.cli", *auto, *joined, *sets], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env={**os.environ, CRASH_ENV: at})
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        return proc.stdout

    # the first save cut short: only iter_000000.tmp; a resume has nothing to start from, a plain start is refused
    killed_in_save("filled@iter_000000")
    assert [p.name for p in ckpts.iterdir()] == ["iter_000000.tmp"]
    assert rl_main(["train", "--resume", str(run)]) == 2
    assert "has no complete checkpoint under checkpoints/ (iter_000000.tmp: a save that did not finish)" in \
        capsys.readouterr().err
    assert rl_main(["train", str(config), "--run-dir", str(run)]) == 2
    assert "already holds a run" in capsys.readouterr().err

    # the next attempt starts afresh
    assert rl_main(auto) == 0
    out = capsys.readouterr().out
    assert f"--auto-resume: no complete checkpoint in {run} (removed iter_000000.tmp: saves that did not finish); " \
           "starting afresh" in out
    assert _iterations(run) == [0] and list_checkpoints(run) == [ckpts / "iter_000000"]

    # a later save cut short after its rename: that attempt had resumed; the next one resumes from iter_000000 again
    out = killed_in_save("renamed@iter_000001", "--set", "run.iterations=2")
    assert "resuming from iter_000000 (after iteration 0)" in out
    assert (ckpts / "iter_000001" / "state.json").is_file() and not (ckpts / "iter_000001" / MARKER).exists()
    assert rl_main([*auto, "--set", "run.iterations=2"]) == 0
    out = capsys.readouterr().out
    assert "skipped incomplete checkpoint(s) iter_000001 (a save that did not finish)" in out
    assert f"resuming from iter_000000 (after iteration 0) in {ckpts}" in out
    assert _iterations(run) == [0, 1]
    assert list_checkpoints(run) == [ckpts / "iter_000000", ckpts / "iter_000001"]
    assert (ckpts / "iter_000001" / MARKER).is_file() and (run / "final" / "model.safetensors").is_file()
