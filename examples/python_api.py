"""The Python API in a notebook (docs/python-api.md): cells marked ``# %%`` that VS Code, PyCharm and Jupyter (with
jupytext) run one at a time; ``python examples/python_api.py`` runs them in order, from the repository root.

1. The quick start's first iterations, from its config.
2. A reward function of your own, on a ``datasets.Dataset`` with its own column names, starting from the model the
   first run trained.
3. The summaries and ``metrics.jsonl`` read back.

On 2 CPU cores the first run builds the quick start's warm start once (cached for later runs; several minutes), then
each iteration takes tens of seconds.
"""

# %%
import json
from pathlib import Path

from datasets import Dataset

import rl
from envs.arithmetic import ArithmeticEnv

RUNS = Path("runs/notebook")
ITERATIONS = 5

# %% [markdown]
# ## 1. The quick start's first iterations
# `overrides` are dotted keys, as `rl train --set` takes them.

# %%
quick = rl.train("configs/quickstart.yaml", RUNS / "quickstart",
                 overrides={"run.iterations": ITERATIONS, "run.eval_every": ITERATIONS})
print(f"held-out accuracy {quick['initial_accuracy']:.3f} -> {quick['final_accuracy']:.3f}")


# %% [markdown]
# ## 2. Your reward and your dataset
# The function's parameters are matched by name (`prompt`, `response`, `answer`, `meta`...); it may be `async`.
# One that raises or returns NaN costs that response (counted in `env_errors`), not the run.

# %%
def exact(response: str, answer: str) -> float:
    """1 when the response's first word is the answer."""
    words = response.split()
    return float(bool(words) and words[0] == answer)


tasks = ArithmeticEnv.generate_tasks(2000, seed=42)  # stands in for your data: any columns, mapped below
dataset = Dataset.from_list([{"question": t.prompt, "solution": t.answer} for t in tasks])
split = dataset.train_test_split(test_size=64, seed=0)

mine = rl.train({"model": {"path": quick["final_model"]},
                 "run": {"iterations": ITERATIONS, "eval_every": ITERATIONS},
                 "env": {"columns": {"prompt": "question", "answer": "solution"}}},
                RUNS / "exact", reward=exact, train_tasks=split["train"], eval_tasks=split["test"])

# %% [markdown]
# ## 3. What the runs wrote
# The summary is the run directory's `summary.json`; `metrics.jsonl` has a line per iteration.

# %%
for name, summary in (("quickstart", quick), ("exact", mine)):
    records = [json.loads(line) for line in (RUNS / name / "metrics.jsonl").read_text().splitlines()]
    rewards = " ".join(f"{r['reward_mean']:.2f}" for r in records)
    print(f"{name}: {summary['iterations']} iterations, reward per iteration {rewards}, "
          f"final accuracy {summary['final_accuracy']:.3f}, model in {summary['final_model']}")
