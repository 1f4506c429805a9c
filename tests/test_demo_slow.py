"""The quickstart demo end to end (about 5 minutes on 2 cores): RL must beat the warm start by
10 points of held-out accuracy. Kept out of the default run; the default suite covers the loop
(test_run.py) and learning on a toy reward (test_algorithm.py)."""

from pathlib import Path

import pytest

from rl.config import load_config
from rl.loop.controller import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_raises_accuracy_by_10_points(ray_cluster, tmp_path):
    summary = train(load_config(ROOT / "configs" / "quickstart.yaml"), tmp_path / "run")
    assert summary["final_accuracy"] >= summary["initial_accuracy"] + 0.10, summary
