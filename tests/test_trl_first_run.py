"""A TRL user's first run: ``rl.train`` with ``datasets.Dataset`` splits and a reward function in TRL's signature
(``fn(completions, answer, **kwargs) -> list[float]``) that gives fractional scores. The held-out evaluation scores
each response alone (a group of one), so the run reports numeric held-out accuracy under ``run.eval_success`` and
the mean reward, equal to what the per-response function gives on the saved held-out responses; best/ is chosen on
the mean reward; ``summary.json`` and ``metrics.jsonl`` are strict JSON. A group function declared relative leaves
the evaluation without metrics: said in one line, null in the summary, and a guard asked for is refused."""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import pytest
from datasets import Dataset
from rich.console import Console

import rl
from envs.arithmetic import ArithmeticEnv, extract_answer
from rl.errors import UserError
from rl.loop.held_out import finite, held_out_line, summary_figures, summary_line
from rl.rollout.data import load_task_sets
from tests.test_run import TINY

SUCCESS = 0.5  # run.eval_success: a well-formed answer counts as solved here, so the threshold is what decides
TASKS = [{"prompt": t.prompt, "answer": t.answer} for t in ArithmeticEnv.generate_tasks(80, seed=11)]
TRAIN, HELD_OUT = TASKS[:64], TASKS[64:]


def one_score(response: str, answer: str) -> float:
    """The per-response reference: 1 for the right answer, 0.5 for its digits somewhere, 0.25 for any digit."""
    got = extract_answer(response)
    if got is not None and int(got) == int(answer):
        return 1.0
    return 0.5 if answer in response else 0.25 if any(c.isdigit() for c in response) else 0.0


def correctness(completions, answer, **kwargs) -> list[float]:
    """As TRL's docs write a reward function: lists in, one reward per completion out."""
    return [one_score(c, a) for c, a in zip(completions, answer, strict=True)]


def relative_rank(completions, **kwargs) -> list[float]:
    """A reward that compares a group's completions (longest first): relative, so never scored alone."""
    order = sorted(range(len(completions)), key=lambda i: -len(completions[i]))
    return [float(order.index(i) == 0) for i in range(len(completions))]


def strict(text: str):
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def raw_config(model_dir: Path, **run) -> dict:
    raw = json.loads(json.dumps({k: v for k, v in TINY.items() if k not in ("warmstart", "checkpoint_engine")}))
    raw["model"] = {"path": str(model_dir)}
    raw["run"] = {"iterations": 2, "eval_every": 1, "save_every": 2, "eval_samples": 2, "eval_success": SUCCESS,
                  "best_metric": "eval_reward", **run}
    return raw


@pytest.fixture(scope="module")
def trl_run(ray_cluster, model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trl") / "run"
    out = io.StringIO()
    summary = rl.train(raw_config(model_dir), run_dir, reward=correctness, train_tasks=Dataset.from_list(TRAIN),
                       eval_tasks=Dataset.from_list(HELD_OUT), console=Console(file=out, width=200))
    return run_dir, summary, out.getvalue()


def reference(rows: list[dict]) -> tuple[float, float]:
    """Accuracy and mean reward of saved held-out responses by the per-response function, computed here (the rows
    follow the held-out order; the loader names the n-th task STEM-n, from 1)."""
    assert [r["task_id"].rsplit("-", 1)[1] for r in rows] == [str(n) for n in range(1, len(HELD_OUT) + 1)]
    scores = [one_score(r["response"], t["answer"]) for r, t in zip(rows, HELD_OUT, strict=True)]
    solved = [s >= SUCCESS and r["finish_reason"] == "stop" for s, r in zip(scores, rows, strict=True)]
    assert [r["reward"] for r in rows] == scores and [r["solved"] for r in rows] == solved
    return sum(solved) / len(rows), statistics.fmean(scores)


def test_held_out_metrics_of_a_trl_reward_are_numbers_equal_to_the_per_response_rewards(trl_run):
    run_dir, summary, printed = trl_run
    written = strict((run_dir / "summary.json").read_text())
    assert written == summary
    records = [strict(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    warm = [json.loads(x) for x in (run_dir / "held_out" / "warm_start.jsonl").read_text().splitlines()]
    last = [json.loads(x) for x in (run_dir / "held_out" / "iter_000001.jsonl").read_text().splitlines()]
    acc0, reward0 = reference(warm)
    acc1, reward1 = reference(last)
    assert summary["initial_accuracy"] == pytest.approx(acc0)
    assert summary["initial_eval_reward"] == pytest.approx(reward0)
    assert summary["final_accuracy"] == pytest.approx(acc1) and summary["final_eval_reward"] == pytest.approx(reward1)
    assert records[-1]["accuracy"] == pytest.approx(acc1) and records[-1]["eval_reward"] == pytest.approx(reward1)
    assert 0 < reward0 < 1 and 0 <= summary["initial_accuracy_sampled"] <= 1  # fractional scores, both measured
    shown = f", mean reward {reward0:.3f}" if f"{reward0:.3f}" != f"{acc0:.3f}" else ""  # once where they agree
    assert f"warm start: held-out accuracy {acc0:.3f} on {len(HELD_OUT)} prompts{shown}" in printed
    assert "nan" not in printed.lower()
    best = json.loads((run_dir / "best" / "best.json").read_text())  # chosen on the mean reward
    assert best["eval_reward"] == summary["best_eval_reward"] == max(reward0, *(r["eval_reward"] for r in records))


def test_a_relative_group_reward_has_no_held_out_metrics_said_once_and_null(tmp_path, model_dir):
    with pytest.raises(UserError, match=r"^run.collapse_guard: true needs held-out metrics, and this run has none "
                                        r"\(no held-out metrics: reward function tests.test_trl_first_run:"
                                        r"relative_rank "):
        rl.train(raw_config(model_dir, collapse_guard=True), tmp_path / "refused",
                 reward={"function": relative_rank, "relative": True}, train_tasks=TRAIN, eval_tasks=HELD_OUT)
    for split, rows in (("train", TRAIN), ("eval", HELD_OUT)):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = raw_config(model_dir)
    raw["env"] = {"reward": {"function": f"{__name__}:relative_rank", "relative": True},
                  "train_tasks": str(tmp_path / "train.jsonl"), "eval_tasks": str(tmp_path / "eval.jsonl")}
    cfg = rl.parse_config(raw)
    assert held_out_line(cfg, load_task_sets(cfg)) == (
        f"no held-out metrics: reward function {__name__}:relative_rank (its rewards compare a prompt's responses "
        "with each other, so one response has none); best/ and the collapse guard are off")
    with pytest.raises(UserError, match="only a group function"):
        rl.train(raw_config(model_dir), tmp_path / "one", reward={"function": one_score, "relative": True},
                 train_tasks=TRAIN, eval_tasks=HELD_OUT)
    nothing = summary_figures([{"iteration": 0, "accuracy": None}], {"accuracy": None, "eval_reward": None})
    assert nothing == {f"{w}_{k}": None for k in ("accuracy", "eval_reward") for w in ("initial", "final", "best")}
    assert strict(json.dumps(finite({"x": float("nan"), "y": [float("inf"), 1.0]}), allow_nan=False)) == \
        {"x": None, "y": [None, 1.0]}
    assert summary_line(nothing) == "no held-out metrics"
