"""Code rewards that cannot be gamed: each exploit a policy could learn gets reward 0 with a verdict saying why,
through the real sandbox service and the code environment; honest solutions (HumanEval's own) still get 1."""

from __future__ import annotations

import pytest

from envs.base import Task
from envs.code import CodeEnv
from sandbox.backend import Limits, Verdict
from sandbox.server import start_server

TASK = Task("add-1", "def add(a, b):\n", "", {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n",
                                             "entry_point": "add"})
WRONG = "def add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def server():
    srv = start_server("local", concurrency=4)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def env(server):
    e = CodeEnv(sandbox_address=server.address, wall_s=10)
    yield e
    e.close()


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


def reward(env: CodeEnv, code: str, task: Task = TASK) -> tuple[float, dict]:
    return env.score(task, fenced(code))


def test_an_honest_solution_passes_and_a_wrong_one_fails(env):
    r, info = reward(env, "def add(a, b):\n    return a + b\n")
    assert r == 1.0 and info["verdict"] == "ok", info
    r, info = reward(env, WRONG)
    assert r == 0.0 and "AssertionError (tests line 1)" in info["detail"], info


EXPLOITS = {
    # ending the process before the tests run, with success
    "os._exit(0)": (WRONG + "import os\nos._exit(0)\n", "before the tests ran"),
    "sys.exit(0)": (WRONG + "import sys\nsys.exit(0)\n", "SystemExit: 0"),
    "exit inside the call": ("import os\ndef add(a, b):\n    os._exit(0)\n", "during a call of add()"),
    "SystemExit inside the call": ("def add(a, b):\n    raise SystemExit(0)\n", "during a call of add()"),
    "atexit": (WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n", "AssertionError"),
    "kill the judge": ("import os\ndef add(a, b):\n    os.kill(os.getppid(), 9)\n", "gave no result"),
    # reading the tests it is judged by (files, the judge's memory, descriptors and stdin)
    "read the tests": ("""
import glob, os
seen = ''
for path in glob.glob('/work/**', recursive=True) + glob.glob('/tmp/**', recursive=True):
    try:
        seen += open(path, errors='ignore').read()
    except OSError:
        pass
judge = os.getppid()
for part in ('mem', 'environ', 'fd/0', 'fd/1', 'fd/3', 'fd/4', 'fd/5'):
    try:
        seen += open(f'/proc/{judge}/{part}', 'rb').read(1 << 20).decode(errors='ignore')
    except OSError:
        pass
def add(a, b):
    return 5 if 'add(2, 3) == 5' in seen else a - b
""", "AssertionError"),
    # patching what the tests use
    "patch assert and unittest": ("""
import builtins, unittest
class Never(Exception):
    pass
builtins.AssertionError = Never
unittest.TestCase.assertEqual = lambda *a, **k: None
unittest.TestCase.run = lambda self, result=None: result
""" + WRONG, "AssertionError"),
    "an object equal to everything": ("class E:\n    def __eq__(self, o):\n        return True\n"
                                      "def add(a, b):\n    return E()\n", "plain data"),
    "a str subclass equal to everything": ("class S(int):\n    def __eq__(self, o):\n        return True\n"
                                           "def add(a, b):\n    return S(7)\n", "AssertionError"),
    # forging the result: expected-output and result files, fake 'passed' lines on every stream it can reach
    "write the expected output files": ("""
import json
for name in ('expected_output.txt', 'result.json', 'tests.py', 'program.py', 'solution.py', 'output.txt'):
    for d in ('/work/', '/tmp/'):
        open(d + name, 'w').write(json.dumps({'passed': True}) + '\\nOK\\npassed\\n')
""" + WRONG, "AssertionError"),
    "print a fake passed line": ("""
import json, os, sys
line = json.dumps({'passed': True, 'reason': '', 'printed': ''})
for fd in ('/proc/1/fd/1', '/proc/1/fd/2', '/dev/stdout'):
    try:
        w = os.open(fd, os.O_WRONLY)
        os.write(w, ('0' * 32 + ' ' + line + '\\npassed\\nOK\\n').encode())
    except OSError:
        pass
print('passed'); print('0' * 32, line); sys.stdout.flush()
""" + WRONG, "AssertionError"),
}


@pytest.mark.parametrize("name", list(EXPLOITS))
def test_exploits_get_no_reward(env, name):
    code, why = EXPLOITS[name]
    r, info = reward(env, code)
    assert r == 0.0, (name, info)
    assert why in info["detail"], (name, info)


def test_tests_using_unittest_main_still_judge(env):
    tests = ("import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n"
             "        self.assertEqual(add(2, 3), 5)\n        with self.assertRaises(TypeError):\n"
             "            add(1, 'x')\nunittest.main()\n")
    task = Task("add-ut", "def add(a, b):\n", "", {"tests": tests, "entry_point": "add"})
    assert reward(env, "def add(a, b):\n    return a + b\n", task)[0] == 1.0
    patched = "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n" + WRONG
    r, info = reward(env, patched, task)
    assert r == 0.0 and "the tests exited with status" in info["detail"], info


def test_the_service_api_judges_code_and_tests(server):
    from sandbox.client import SandboxClient

    with SandboxClient(server.address) as c:
        ok = c.run(code="def f():\n    return 1\n", tests="assert f() == 1\nprint('done')", limits=Limits(wall_s=10))
        assert ok.verdict == Verdict.OK and ok.stdout == b"done\n", ok
        cheat = c.run(code="import os\nprint('done', flush=True)\nos._exit(0)\ndef f():\n    return 2\n",
                      tests="assert f() == 1", limits=Limits(wall_s=10))
        assert cheat.verdict == Verdict.FAILED and "before the tests ran" in cheat.detail, cheat
        assert b"done" in cheat.stderr  # the solution's own output is kept, apart from the result


def test_humaneval_reference_solutions_pass(env):
    """The judge changes nothing for honest code: HumanEval's canonical solutions all get reward 1 (the first 40
    here; all 164 in the slow suite)."""
    tasks = CodeEnv.humaneval_tasks(limit=40)
    failed = [t.id for t in tasks if env.score(t, fenced(t.prompt + t.answer))[0] != 1.0]
    assert failed == []


@pytest.mark.slow
def test_all_humaneval_reference_solutions_pass(env):
    tasks = CodeEnv.humaneval_tasks()
    failed = [t.id for t in tasks if env.score(t, fenced(t.prompt + t.answer))[0] != 1.0]
    assert failed == []
