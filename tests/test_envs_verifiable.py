"""Verifiable-reward environments (math, reasoning-gym puzzles, code in the sandbox) and task files."""

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envs.base import Task
from envs.code import CodeEnv, extract_code
from envs.math import MathEnv, extract_answer, last_boxed
from envs.puzzles import DEFAULT_DATASETS, ReasoningGymEnv
from envs.puzzles import extract_answer as extract_puzzle_answer
from envs.registry import get
from envs.tasks import TaskFileError, load_tasks, save_tasks


def test_environments_register_themselves():
    assert (get("math"), get("puzzles"), get("code")) == (MathEnv, ReasoningGymEnv, CodeEnv)
    assert CodeEnv.uses_sandbox and (MathEnv.task_type, ReasoningGymEnv.task_type, CodeEnv.task_type) == (
        "math", "puzzle", "code")


# ---- math ----

@pytest.fixture(scope="module")
def math_env():
    return MathEnv(verify_timeout_s=2.0)


def test_answer_extraction():
    assert last_boxed(r"so \boxed{\frac{a}{b}} and \fbox{\frac{\sqrt{2}}{2}}.") == r"\frac{\sqrt{2}}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{2") == "1"  # a truncated last box: the last complete one
    assert last_boxed(r"\boxed 7.") == "7"
    assert extract_answer("work...\nThe answer is $\\frac{1}{2}$.") == "$\\frac{1}{2}$"
    assert extract_answer("**Final answer:** 12") == "12"
    assert extract_answer("Answer: 5 because 2+3=5.") == "5"
    assert extract_answer("I do not know.") is None


@pytest.mark.parametrize(("gold", "response", "reward"), [
    (r"\frac{1}{2}", r"\boxed{0.5}", 1.0),
    ("0.5", r"\boxed{\frac{1}{2}}", 1.0),
    (r"2\sqrt{2}", r"\boxed{\sqrt{8}}", 1.0),
    (r"\dfrac{3}{4}", "Final answer: 3/4", 1.0),
    ("2", r"\boxed{x=2}", 1.0),
    ("x=2", "The answer is 2.", 1.0),
    ("(1, 2]", r"\boxed{(1,2]}", 1.0),
    ("[1, 2]", r"\boxed{(1,2]}", 0.0),
    (r"\{1, 2\}", r"\boxed{\{2, 1\}}", 1.0),
    ("-3, 4", r"\boxed{4, -3}", 1.0),
    ("-3, 4", r"\boxed{4}", 0.0),
    ("1/3", r"\boxed{0.33}", 0.0),
    (r"\frac{a}{b}", r"\boxed{\frac{a}{b}}", 1.0),
    (r"\frac{a}{b}", r"\boxed{\frac{b}{a}}", 0.0),
    (r"\frac{3}{5}", r"\boxed{\frac{\frac{3}{2}}{\frac{5}{2}}}", 1.0),
    ("5", "no answer at all", 0.0),
])
def test_math_equivalences(math_env, gold, response, reward):
    r, info = math_env.score(Task("t", "q", gold), response)
    assert r == reward, info
    json.dumps(info)


def test_generated_math_tasks_score_their_solutions(math_env):
    tasks = MathEnv.generate_tasks(30, seed=3)
    assert tasks == MathEnv.generate_tasks(30, seed=3)
    assert {t.meta["kind"] for t in tasks} >= {"fraction_arithmetic", "simplify_root", "fraction_simplification"}
    for task in tasks:
        assert math_env.score(task, task.meta["solution"])[0] == 1.0, task
        assert math_env.score(task, r"\boxed{123457}")[0] == 0.0, task
    with pytest.raises(ValueError, match="unknown math task kinds"):
        MathEnv.generate_tasks(1, 0, kinds=["calculus"])


def test_math_scores_from_worker_threads_and_survives_runaway_answers():
    task = Task("t", "q", r"\frac{1}{2}")
    results = []
    threads = [threading.Thread(target=lambda env=env: results.append(env.score(task, r"\boxed{0.5}")[0]))
               for env in (MathEnv(), MathEnv(isolate=False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0, 1.0]
    env = MathEnv(verify_timeout_s=0.5, max_answer_chars=50)
    r, info = env.score(task, r"\boxed{2^{2^{2^{2^{100}}}}}")  # would hang sympy, holding the GIL
    assert r == 0.0 and "no verdict" in info["reason"]
    assert env.score(task, r"\boxed{" + "1+" * 40 + "1}")[1]["reason"] == "answer over 50 chars"
    assert env.score(task, r"\boxed{\frac{2}{4}}")[0] == 1.0  # a fresh checker took over


# ---- puzzles ----

@pytest.mark.parametrize("dataset", sorted(DEFAULT_DATASETS))
def test_puzzle_reference_answers_score_one(dataset):
    tasks = ReasoningGymEnv.generate_tasks(2, seed=5, datasets=[dataset])
    env = ReasoningGymEnv()
    for task in tasks:
        assert task.meta["dataset"] == dataset and "<answer>" in task.prompt
        meta = json.loads(json.dumps(task.meta))  # JSON-serialisable, and grading works from the JSON copy
        task = Task(task.id, task.prompt, task.answer, meta)
        right, info = env.score(task, f"Let me think.\n<answer>{meta['entry']['answer']}</answer>")
        assert right == 1.0, info
        assert env.score(task, f"Final answer:\n{task.answer}")[0] == 1.0
        assert env.score(task, "<answer>7 - 3 wrong</answer>")[0] < 1.0
        assert env.score(task, "no idea")[0] == 0.0


def test_puzzle_mix_is_deterministic_and_round_trips_through_task_files(tmp_path):
    tasks = ReasoningGymEnv.generate_tasks(12, seed=1, datasets={"maze": 1.0, "knights_knaves": 2.0},
                                           configs={"maze": {"min_grid_size": 5, "max_grid_size": 6}})
    assert tasks == ReasoningGymEnv.generate_tasks(12, seed=1, datasets={"maze": 1.0, "knights_knaves": 2.0},
                                                   configs={"maze": {"min_grid_size": 5, "max_grid_size": 6}})
    assert {t.meta["dataset"] for t in tasks} == {"maze", "knights_knaves"}
    save_tasks(tasks, tmp_path / "p.parquet")
    env = ReasoningGymEnv()
    for task in load_tasks(tmp_path / "p.parquet"):
        assert env.score(task, f"<answer>{task.answer}</answer>")[0] == 1.0
    without_coordinates = Task("x", tasks[0].prompt, tasks[0].answer,
                               {"dataset": tasks[0].meta["dataset"], "entry": tasks[0].meta["entry"]})
    assert env.score(without_coordinates, f"<answer>{tasks[0].answer}</answer>")[0] == 1.0
    with pytest.raises(ValueError, match="unknown reasoning-gym datasets"):
        ReasoningGymEnv.generate_tasks(1, 0, datasets=["morse_code"])


def test_puzzle_answers_that_a_scorer_would_evaluate_are_screened():
    env = ReasoningGymEnv()
    (p24,) = ReasoningGymEnv.generate_tasks(1, seed=2, datasets=["puzzle24"])
    for evil in ["__import__('os').system('true')", "9**9**9**9"]:
        r, info = env.score(p24, f"<answer>{evil}</answer>")
        assert r == 0.0 and "arithmetic" in info["reason"]
    (queens,) = ReasoningGymEnv.generate_tasks(1, seed=2, datasets=["n_queens"])
    assert env.score(queens, "<answer>print('hi')</answer>")[1]["reason"] == "valid Python but not a literal"
    assert extract_puzzle_answer("<answer>a</answer> then <answer> b </answer>") == "b"


# ---- code ----

@pytest.fixture(scope="module")
def code_env():
    return CodeEnv(wall_s=2.0)


def test_humaneval_canonical_solutions_pass_and_bad_ones_fail(code_env):
    tasks = CodeEnv.humaneval_tasks()
    assert len(tasks) == 164 and tasks[0].id == "HumanEval/0"
    for task in [tasks[i] for i in (0, 2, 10, 38)]:  # 10 and 38 call helpers defined in the prompt
        assert code_env.score(task, task.answer)[0] == 1.0, task.id
        whole = f"Here it is:\n```python\n{task.prompt}{task.answer}```\nDone."
        r, info = code_env.score(task, whole)
        assert (r, info["program"]) == (1.0, "function"), info
    task = tasks[2]
    r, info = code_env.score(task, "    return number\n")
    assert (r, info["verdict"]) == (0.0, "failed") and "AssertionError" in info["stderr"]
    assert code_env.score(task, "```python\ndef truncate_number(number):\n    return number +\n```")[0] == 0.0
    r, info = code_env.score(task, "```python\ndef truncate_number(number):\n    while True:\n        pass\n```")
    assert (r, info["verdict"]) == (0.0, "timeout")
    assert code_env.score(task, "")[1]["reason"] == "no code in the response"


def test_user_code_tasks_from_jsonl(tmp_path, code_env):
    records = [
        {"id": "add", "prompt": "def add(a, b):\n", "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0",
         "entry_point": "add"},
        {"id": "sq", "prompt": "Write square(x).", "tests": "def check(f):\n    assert f(3) == 9\n",
         "entry_point": "square", "difficulty": "easy"},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    add, sq = CodeEnv.load_tasks(path)
    assert (add.id, add.answer, sq.meta["difficulty"]) == ("add", "", "easy")
    assert code_env.score(add, "    return a + b\n")[0] == 1.0
    assert code_env.score(add, "    return a - b\n")[0] == 0.0
    assert code_env.score(sq, "```py\ndef square(x):\n    return x * x\n```")[0] == 1.0
    assert CodeEnv.from_records(records) == [add, sq]
    path.write_text(json.dumps({"prompt": "def f():\n", "tests": "assert f()"}) + "\n")
    with pytest.raises(TaskFileError, match=r"code.jsonl:1: a code task needs a non-empty string field 'entry_point'"):
        CodeEnv.load_tasks(path)
    assert extract_code("```\nx = 1\n```\n```python\ny = 2\n```") == "y = 2\n"
    with pytest.raises(NotImplementedError, match="task file"):
        CodeEnv.generate_tasks(1, 0, wall_s=3)


# ---- task files ----

def test_task_files_round_trip_in_jsonl_and_parquet(tmp_path):
    tasks = [Task("a", "p1", "1", {"kind": "x", "nested": {"list": [1, 2]}}), Task("b", "p2", "", {})]
    for name in ("t.jsonl", "t.parquet"):
        save_tasks(tasks, tmp_path / name)
        assert load_tasks(tmp_path / name) == tasks
    assert pq.read_table(tmp_path / "t.parquet").column_names == ["id", "prompt", "answer", "meta"]


def test_extra_columns_go_to_meta_and_ids_default_to_row_numbers(tmp_path):
    pq.write_table(pa.table({"prompt": ["fix it", "and this"], "instance_id": ["repo-1", "repo-2"],
                             "meta": [json.dumps({"a": 1}), None]}), tmp_path / "swe.parquet")
    first, second = load_tasks(tmp_path / "swe.parquet", require_answer=False)
    assert first == Task("swe-1", "fix it", "", {"instance_id": "repo-1", "a": 1})
    assert second == Task("swe-2", "and this", "", {"instance_id": "repo-2"})
    (tmp_path / "h.jsonl").write_text(json.dumps({"prompt": "p", "answer": 3, "task_id": "H/0"}) + "\n")
    assert load_tasks(tmp_path / "h.jsonl") == [Task("h-1", "p", "3", {"task_id": "H/0"})]


def test_bad_records_name_the_file_and_row(tmp_path):
    pq.write_table(pa.table({"prompt": ["ok", None], "answer": ["1", "2"]}), tmp_path / "bad.parquet")
    with pytest.raises(TaskFileError, match=r"bad.parquet row 2: missing field 'prompt'"):
        load_tasks(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"prompt": ["ok"]}), tmp_path / "noanswer.parquet")
    with pytest.raises(TaskFileError, match=r"noanswer.parquet row 1: missing field 'answer'"):
        load_tasks(tmp_path / "noanswer.parquet")
    pq.write_table(pa.table({"prompt": ["ok"], "answer": ["1"], "meta": ["{oops"]}), tmp_path / "meta.parquet")
    with pytest.raises(TaskFileError, match=r"meta.parquet row 1: 'meta' is a string but not valid JSON"):
        load_tasks(tmp_path / "meta.parquet")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "", "answer": "2"}\n')
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: 'prompt' must be a non-empty string"):
        load_tasks(tmp_path / "bad.jsonl")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(TaskFileError, match="junk.parquet: not a readable Parquet file"):
        load_tasks(tmp_path / "junk.parquet")
