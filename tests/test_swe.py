"""The SWE environment and the SWE-smith-style generator, on the local sandbox with toolz's dicttoolz module."""

from __future__ import annotations

import json
import re

import pytest

from envs.base import Task
from envs.swe import SWEEnv, as_test_ids, load_repo_files, make_patch, run_tests, task_from_swebench
from envs.swe_smith import TEST_COMMAND, Mutator, generate_swe_tasks, main
from envs.tasks import load_tasks
from envs.tools import ToolCall, call_id, render_tool_calls

SWE_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
              "PASS_TO_PASS", "image_name")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("swe")
    return out, generate_swe_tasks("toolz", 3, seed=1, out_dir=out, source_files=["dicttoolz.py"])


class Agent:
    """A scripted agent: each turn is a list of (tool, arguments), rendered as K2 tool calls."""

    def __init__(self, turns: list[list[tuple[str, dict]]]):
        self.turns, self.counter = turns, 0

    def respond(self, i: int) -> str:
        calls = []
        for name, args in self.turns[i]:
            calls.append(ToolCall(call_id(name, self.counter), name, args))
            self.counter += 1
        return "Let me look.\n" + render_tool_calls(calls)


def play(env: SWEEnv, task: Task, responses) -> tuple[list[str], float, bool, bool, dict]:
    obs, info = env.reset(options={"task": task})
    observations = [obs]
    for response in responses:
        obs, reward, terminated, truncated, info = env.step(response)
        observations.append(obs)
        if terminated or truncated:
            break
    env.close()
    return observations, reward, terminated, truncated, info


def reverse_edit(task: Task) -> tuple[str, str, str]:
    """(path, old_str, new_str) undoing the mutation: the gold patch's hunk, old side → new side."""
    lines = task.meta["patch"].splitlines()
    path = lines[1].removeprefix("+++ b/")
    body = [x for x in lines[3:] if not x.startswith("@@")]
    old = "\n".join(x[1:] for x in body if x[:1] in " -")
    new = "\n".join(x[1:] for x in body if x[:1] in " +")
    return path, old, new


def test_generated_records_have_swe_bench_fields_and_real_failures(generated):
    out, tasks = generated
    assert len(tasks) == 3
    assert load_tasks(out / "tasks.jsonl") == tasks
    assert (out / "repo" / "toolz" / "dicttoolz.py").is_file()
    assert len({t.id for t in tasks}) == 3 and len({t.meta["mutation"]["function"] for t in tasks}) == 3
    from sandbox.client import connect

    client = connect(None)
    for task in tasks:
        meta = task.meta
        assert all(k in meta for k in SWE_FIELDS)
        f2p, p2p = meta["FAIL_TO_PASS"], meta["PASS_TO_PASS"]
        assert f2p and p2p and not set(f2p) & set(p2p)
        assert meta["patch"].startswith("--- a/toolz/dicttoolz.py\n+++ b/toolz/dicttoolz.py\n@@")
        assert task.prompt == meta["problem_statement"] and "toolz/tests/test_dicttoolz.py::" in task.prompt
        buggy = meta["files"]["toolz/dicttoolz.py"]
        for line in meta["patch"].splitlines()[2:]:  # the statement never shows the fix
            if line[:1] in "+-" and len(line[1:].strip()) > 8:
                assert line[1:].strip() not in task.prompt
        clean = (out / "repo" / "toolz" / "dicttoolz.py").read_text()
        path, old, new = reverse_edit(task)
        assert buggy.count(old) == 1 and buggy.replace(old, new) == clean and path == "toolz/dicttoolz.py"
        with client.create_session(files=load_repo_files(meta)) as session:
            status, _, _ = run_tests(session, meta["FAIL_TO_PASS"], meta["test_command"])
            assert not any(status.get(t) == "PASSED" for t in meta["FAIL_TO_PASS"])
            status, _, _ = run_tests(session, meta["PASS_TO_PASS"], meta["test_command"])
            assert all(status.get(t) == "PASSED" for t in meta["PASS_TO_PASS"])
            session.write_files({path: clean})
            status, _, _ = run_tests(session, meta["FAIL_TO_PASS"], meta["test_command"])
            assert all(status.get(t) == "PASSED" for t in meta["FAIL_TO_PASS"])
    client.close()


def test_generation_is_deterministic_for_a_seed(generated, tmp_path):
    _, tasks = generated
    again = generate_swe_tasks("toolz", 1, seed=1, out_dir=tmp_path, source_files=["dicttoolz.py"])
    first = tasks[0].meta | {"repo_dir": ""}
    assert again[0].meta | {"repo_dir": ""} == first


def test_mutations_edit_only_the_mutated_tokens():
    source = "def f(a, b):\n    if a < b and b:\n        return g(a, b[: n])  # keep\n    return 1\n"
    m = Mutator("f.py", source)
    mutants = {(c.kind, c.arg, c.line): m.apply(c) for c in m.candidates()}
    assert mutants["flip_comparison", 0, 2] == source.replace("a < b", "a <= b")
    assert mutants["swap_bool_op", 0, 2] == source.replace(" and ", " or ")
    assert mutants["swap_arguments", 0, 3] == source.replace("g(a, b[: n])", "g(b[: n], a)")
    assert mutants["slice_bound", 1, 3] == source.replace("b[: n]", "b[: n + 1]")
    assert mutants["slice_bound", -1, 3] == source.replace("b[: n]", "b[: n - 1]")
    assert mutants["negate_condition", 0, 2] == source.replace("if a < b and b", "if not (a < b and b)")
    assert mutants["return_none", 0, 3] == source.replace("g(a, b[: n])", "None")
    assert mutants["off_by_one", -1, 4] == source.replace("return 1", "return 0")


def test_the_right_edit_solves_the_task_and_the_gold_patch_applies(generated):
    _, tasks = generated
    task = tasks[0]
    path, old, new = reverse_edit(task)
    agent = Agent([[("view_file", {"path": path, "start_line": 1, "end_line": 5})],
                   [("edit_file", {"path": path, "old_str": old, "new_str": new})],
                   [("submit", {})]])
    env = SWEEnv(max_turns=5)
    obs, reward, terminated, truncated, info = play(env, task, [agent.respond(i) for i in range(3)])
    assert "# Issue" in obs[0] and task.meta["problem_statement"] in obs[0] and "type edit_file" in obs[0]
    assert task.meta["patch"] not in obs[0]
    assert "## Results of functions.view_file:0" in obs[1] and "     1\t" in obs[1]
    assert "Edited toolz/dicttoolz.py" in obs[2]
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["resolved"] and info["fail_to_pass_passed"] == info["fail_to_pass_total"] > 0
    assert info["pass_to_pass_passed"] == info["pass_to_pass_total"] > 0

    # the gold patch, applied with git through the bash tool, solves it too
    agent = Agent([[("create_file", {"path": "fix.diff", "content": task.meta["patch"]}),
                    ("bash", {"command": "git apply fix.diff && rm fix.diff && echo applied"})],
                   [("submit", {})]])
    obs, reward, *_ = play(SWEEnv(), task, [agent.respond(0), agent.respond(1)])
    assert "applied" in obs[1] and reward == 1.0


def test_a_wrong_edit_or_no_edit_scores_zero(generated):
    _, tasks = generated
    task = tasks[1]
    path, old, _ = reverse_edit(task)
    agent = Agent([[("edit_file", {"path": path, "old_str": old, "new_str": "# nothing to see\n" + old})],
                   [("submit", {})]])
    _, reward, terminated, _, info = play(SWEEnv(), task, [agent.respond(0), agent.respond(1)])
    assert (reward, terminated, info["resolved"], info["fail_to_pass_passed"]) == (0.0, True, False, 0)
    # editing the tests does not help: they are put back before grading
    test_file = task.meta["FAIL_TO_PASS"][0].split("::")[0]
    agent = Agent([[("bash", {"command": f"printf 'def test_x():\\n    pass\\n' > {test_file}"}), ("submit", {})]])
    _, reward, _, _, info = play(SWEEnv(), task, [agent.respond(0)])
    assert (reward, info["pass_to_pass_passed"]) == (0.0, info["pass_to_pass_total"])


def test_malformed_calls_get_errors_and_max_turns_truncates(generated):
    _, tasks = generated
    env = SWEEnv(max_turns=4)
    env.reset(options={"task": tasks[2]})
    steps = [
        "<|tool_call_section_begin|><|tool_call_begin|>functions.bash:0<|tool_arguments_begin|>{not json"
        "<|tool_call_end|><|tool_call_section_end|>",
        render_tool_calls([ToolCall("functions.rm_rf:1", "rm_rf", {}), ToolCall("functions.view_file:2", "view_file",
                                                                                  {"path": "no/such/file.py"})]),
        "I think I am done, without calling anything.",
    ]
    for i, response in enumerate(steps):
        obs, reward, terminated, truncated, info = env.step(response)
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert "Error" in obs or "No tool call" in obs, obs
        if i == 1:
            assert "unknown tool 'rm_rf'" in obs and "no/such/file.py is not a file" in obs
    edit = ToolCall("functions.edit_file:3", "edit_file", {"path": "toolz/dicttoolz.py", "old_str": "def ",
                                                           "new_str": "def  "})
    obs, reward, terminated, truncated, info = env.step(render_tool_calls([edit]))
    assert re.search(r"old_str occurs \d+ times", obs)
    assert (reward, terminated, truncated, info["submitted"], info["resolved"]) == (0.0, False, True, False, False)
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("more")
    env.close()


def test_sandbox_failures_end_the_episode_without_raising(generated, tmp_path):
    _, tasks = generated
    task = tasks[0]
    submit = render_tool_calls([ToolCall("functions.submit:0", "submit", {})])
    _, reward, terminated, _, info = play(SWEEnv(sandbox_address="127.0.0.1:1"), task, [submit])
    assert (reward, terminated) == (0.0, True) and "sandbox_error" in info
    missing = Task("t", "p", "", {**task.meta, "repo_dir": str(tmp_path / "gone")})
    env = SWEEnv()
    _, info = env.reset(options={"task": missing})
    assert "repo_dir" in info["sandbox_error"]
    assert env.step(submit)[1:3] == (0.0, True)
    # the session disappears mid-episode
    env.reset(options={"task": task})
    env._session.close()
    bash = render_tool_calls([ToolCall("functions.bash:0", "bash", {"command": "ls"})])
    _, reward, terminated, _, info = env.step(bash)
    assert (reward, terminated) == (0.0, True) and "closed" in info["sandbox_error"]
    env.close()


def test_a_swe_bench_record_with_a_test_patch_and_the_default_pytest_command(tmp_path):
    (tmp_path / "tests").mkdir(parents=True)
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n")
    old_tests = "from calc import sub\n\n\ndef test_sub():\n    assert sub(3, 1) == 2\n"
    (tmp_path / "tests" / "test_calc.py").write_text(old_tests)
    new_tests = "from calc import add, sub\n\n\ndef test_sub():\n    assert sub(3, 1) == 2\n\n\n" \
                "def test_add():\n    assert add(3, 1) == 4\n"
    record = {"instance_id": "calc__calc-1", "repo": "calc/calc", "base_commit": "0" * 40,
              "problem_statement": "add() subtracts.", "patch": "", "image_name": "",
              "test_patch": make_patch("tests/test_calc.py", old_tests, new_tests),
              "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
              "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_sub"])}
    task = task_from_swebench(record, repo_dir=str(tmp_path))
    fix = ("edit_file", {"path": "calc.py", "old_str": "def add(a, b):\n    return a - b",
                         "new_str": "def add(a, b):\n    return a + b"})
    for turns, expected in (([[fix, ("submit", {})]], 1.0), ([[("submit", {})]], 0.0)):
        agent = Agent(turns)
        _, reward, _, _, info = play(SWEEnv(), task, [agent.respond(0)])
        assert reward == expected and info["pass_to_pass_passed"] == 1, info


def test_test_ids_accept_json_strings_and_the_cli_has_help(capsys):
    assert as_test_ids(json.dumps(["a::b", "c"])) == ["a::b", "c"] and as_test_ids("") == []
    assert "{tests}" in TEST_COMMAND
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--package" in capsys.readouterr().out


def calc_task(tmp_path) -> Task:
    """A SWE-bench-style record whose FAIL_TO_PASS test comes only with the hidden test_patch."""
    (tmp_path / "tests").mkdir(parents=True)
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n")
    old = "from calc import sub\n\n\ndef test_sub():\n    assert sub(3, 1) == 2\n"
    (tmp_path / "tests" / "test_calc.py").write_text(old)
    new = old.replace("import sub", "import add, sub") + "\n\ndef test_add():\n    assert add(3, 1) == 4\n"
    record = {"instance_id": "calc__calc-2", "repo": "calc/calc", "base_commit": "0" * 40,
              "problem_statement": "add() subtracts.", "patch": "", "image_name": "",
              "test_patch": make_patch("tests/test_calc.py", old, new),
              "FAIL_TO_PASS": ["tests/test_calc.py::test_add"], "PASS_TO_PASS": ["tests/test_calc.py::test_sub"]}
    return task_from_swebench(record, repo_dir=str(tmp_path))


FORCE_PASS_CONFTEST = """
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
"""
PASSING_TESTS = "def test_add():\n    pass\n\n\ndef test_sub():\n    pass\n"
FAKE_LINES = "print('PASSED tests/test_calc.py::test_add')\nprint('PASSED tests/test_calc.py::test_sub')\n"
SWE_EXPLOITS = {
    "a conftest that passes everything": ([("create_file", {"path": "conftest.py", "content": FORCE_PASS_CONFTEST}),
                                           ("create_file", {"path": "tests/conftest.py",
                                                            "content": FORCE_PASS_CONFTEST})], "conftest.py"),
    "pytest configuration": ([("create_file", {"path": "pytest.ini", "content": "[pytest]\naddopts = -p no:python\n"}),
                              ("create_file", {"path": "setup.cfg", "content": "[tool:pytest]\naddopts = --co\n"})],
                             "pytest.ini"),
    "a module shadowing pytest's": ([("create_file", {"path": "json.py", "content": "raise SystemExit(0)\n"})],
                                    "json.py"),
    "a sitecustomize in the home": ([("bash", {"command": "mkdir -p /tmp/.local/lib/python3.11/site-packages && "
                                               "echo 'import os; os._exit(0)' > "
                                               "/tmp/.local/lib/python3.11/site-packages/usercustomize.py"})], None),
    "rewriting the tests": ([("create_file", {"path": "tests/test_calc.py", "content": PASSING_TESTS})],
                            "tests/test_calc.py"),
}
CODE_EXPLOITS = {
    "os._exit(0) at import": ("import os\nos._exit(0)\n", "ended before pytest finished"),
    "fake PASSED lines": (FAKE_LINES, None),
    "patching the test runner": ("import _pytest.runner, unittest\n"
                                 "_pytest.runner.call_and_report = lambda *a, **k: None\n"
                                 "unittest.TestCase.run = lambda self, result=None: None\n", "replaced parts"),
}


def test_hidden_tests_are_not_in_the_episode(tmp_path):
    task = calc_task(tmp_path)
    agent = Agent([[("bash", {"command": "cat tests/test_calc.py; ls -a"}), ("submit", {})]])
    obs, reward, *_ = play(SWEEnv(), task, [agent.respond(0)])
    assert "test_sub" in obs[1] and "test_add" not in obs[1] and reward == 0.0


@pytest.mark.parametrize("name", list(SWE_EXPLOITS))
def test_swe_exploits_get_no_reward(tmp_path, name):
    calls, dropped = SWE_EXPLOITS[name]
    agent = Agent([[*calls, ("submit", {})]])  # the bug itself is left in place
    _, reward, _, _, info = play(SWEEnv(), calc_task(tmp_path), [agent.respond(0)])
    assert reward == 0.0 and info["fail_to_pass_passed"] == 0 and info["pass_to_pass_passed"] == 1, info
    if dropped:
        assert dropped in info["dropped_changes"], info


@pytest.mark.parametrize("name", list(CODE_EXPLOITS))
def test_code_under_test_cannot_forge_the_outcome(tmp_path, name):
    """The module under test itself cheats, its bug left in place; the honest fix with the same noise passes."""
    code, why = CODE_EXPLOITS[name]
    fixed = code + "\n\ndef add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
    agent = Agent([[("create_file", {"path": "calc.py", "content": fixed}), ("submit", {})]])
    _, reward, _, _, info = play(SWEEnv(), calc_task(tmp_path), [agent.respond(0)])
    assert reward == 0.0, info
    if why:
        assert why in info.get("grade_error", ""), info
    honest = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    agent = Agent([[("create_file", {"path": "calc.py", "content": FAKE_LINES + honest}), ("submit", {})]])
    assert play(SWEEnv(), calc_task(tmp_path / "again"), [agent.respond(0)])[1] == 1.0
