"""A multi-turn software-engineering environment: fix a repository in a sandbox session with tools.

The model gets the issue and the tools ``bash``, ``view_file``, ``edit_file`` (exact, unique replacement),
``create_file`` and ``submit``; each step parses its calls in ``tool_format`` (the model family's format from
``engines.model.text.chat_format``, set by the rollout from the tokenizer; K2 by default), runs them and returns
their results. ``reset`` and ``step`` also put the conversation as chat messages in ``info``: ``messages`` (the
user prompt, then one ``tool`` message per result) and ``tools`` (OpenAI form), which the rollout renders with
the model's own chat template; the text observations are the K2 rendering (declarations, result messages).
``submit``, or the last of ``max_turns`` turns (truncated), grades the repository.

Tasks use SWE-bench's field names in ``Task.meta``:

- ``instance_id``, ``repo``, ``base_commit``, ``problem_statement`` (shown to the model), ``patch`` (the gold
  fix, never shown), ``test_patch`` (a unified diff applied with ``git apply`` at reset; may be empty),
  ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists of test ids, or JSON-encoded lists as SWE-bench ships them);
- ``image_name`` (optional): the session's container image, for the Kubernetes backend (the local backend
  ignores it); the repository's files may then already be in the image.

How the repository gets into the session's work directory (both optional, applied in this order):

- ``repo_dir``: a directory on the environment's machine (absolute, or relative to the cwd) whose files are
  loaded under the same relative paths (``.git``, ``__pycache__`` and ``*.pyc`` skipped);
- ``files``: ``{path: text}`` written over those (the buggy files of generated tasks).

``test_command`` says how to run test ids: ``"pytest"`` (the default) runs ``python3 -m pytest -rA`` on the
ids and reads each test's outcome from the summary; any other string is a shell command with a ``{tests}``
placeholder (the quoted ids) whose output is read the same way (``PASSED id`` / ``FAILED id`` lines), or, when
it prints none, whose exit status decides for every id. The reward is 1.0 only when every FAIL_TO_PASS and
PASS_TO_PASS test passes, as graded by ``envs.swe_grading``: in a fresh session that gets only the model's changes
to source files, then the hidden ``test_patch``, with outcomes from a pytest plugin that tags them with a nonce
(editing tests, adding a conftest, planting modules or printing ``PASSED`` lines does not help; the test command
must run pytest). A sandbox failure ends the episode with reward 0 and ``info["sandbox_error"]``; it never raises.
``task_from_swebench`` turns a flat SWE-bench record into a ``Task``.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.model.text.chat_format import ToolFormat, get_format
from envs.base import Env, Task
from envs.registry import register
from envs.swe_grading import (
    PLUGIN_ENV,
    allowed_changes,
    graded_outcomes,
    grading_files,
    list_files,
    new_nonce,
)
from envs.tools import (
    Tool,
    ToolCall,
    render_tool_declarations,
    render_tool_results,
)
from sandbox.backend import ExecResult, Limits, SandboxError, Verdict

if TYPE_CHECKING:
    from sandbox.client import RemoteSession, SandboxClient

log = logging.getLogger(__name__)

_PATH = {"type": "string", "description": "Path relative to the repository root."}
TOOLS = [
    Tool("bash", "Run a shell command in the repository root (no network). Long output is truncated.",
         {"type": "object", "properties": {"command": {"type": "string", "description": "The command."}},
          "required": ["command"], "additionalProperties": False}),
    Tool("view_file", "Show a file with line numbers, optionally only lines start_line..end_line (1-based).",
         {"type": "object", "properties": {"path": _PATH, "start_line": {"type": "integer", "minimum": 1},
                                           "end_line": {"type": "integer", "minimum": 1}},
          "required": ["path"], "additionalProperties": False}),
    Tool("edit_file", "Replace the text old_str, which must occur exactly once in the file, by new_str.",
         {"type": "object", "properties": {"path": _PATH, "old_str": {"type": "string", "minLength": 1},
                                           "new_str": {"type": "string"}},
          "required": ["path", "old_str", "new_str"], "additionalProperties": False}),
    Tool("create_file", "Create a file with the given content (an existing file is overwritten).",
         {"type": "object", "properties": {"path": _PATH, "content": {"type": "string"}},
          "required": ["path", "content"], "additionalProperties": False}),
    Tool("submit", "Finish: your changes are graded by running the tests. Call it alone, last.",
         {"type": "object", "properties": {}, "additionalProperties": False}),
]
PASSING = frozenset({"PASSED", "XFAIL"})
_RESULT_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+?)(?: - (.*))?$", re.M)
_PLUS_PATH = re.compile(r"^\+\+\+ (?:b/)?(\S+)", re.M)
_ERROR_ID = re.compile(r"^(functions\.([A-Za-z_][\w.\-]*):\d+): ")
_OTHER_ERROR_ID = re.compile(r"^([A-Za-z0-9_]+): ")
_SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache"})
# Codes of file-tool failures that are the model's doing (a wrong path), not the sandbox's.
_USER_CODES = frozenset({"NOT_FOUND", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})


_SESSION_GONE = re.compile(r"no session|session \S+ (?:\(.*\) )?(?:is|was) closed")


def _user_error(e: SandboxError) -> bool:
    """Whether a file operation failed because of the path the model gave, not because the session is gone."""
    return e.code in _USER_CODES and not _SESSION_GONE.search(str(e))


class SandboxFailure(Exception):
    """The sandbox itself failed; the episode ends with reward 0 and the error in ``info``."""


class _ToolError(Exception):
    """A tool call the model got wrong; its message becomes the tool result."""


def as_test_ids(value: Any) -> list[str]:
    """A FAIL_TO_PASS/PASS_TO_PASS value as a list (SWE-bench ships them JSON-encoded)."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        value = json.loads(value)
    return [str(v) for v in value]


def task_from_swebench(record: dict[str, Any], **extra: Any) -> Task:
    """A Task from a flat SWE-bench record (plus ``extra`` meta such as ``repo_dir``)."""
    meta = {**record, **extra}
    return Task(str(meta["instance_id"]), str(meta["problem_statement"]), str(meta.get("patch", "")), meta)


def make_patch(path: str, old: str, new: str) -> str:
    """A unified diff (``a/``, ``b/`` prefixes) turning ``old`` into ``new`` at ``path``."""
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))


def patch_paths(diff: str) -> list[str]:
    """The files a unified diff touches (their new paths)."""
    return [m.group(1) for m in _PLUS_PATH.finditer(diff) if m.group(1) != "/dev/null"]


def parse_test_output(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Outcomes (``PASSED``, ``FAILED``...) and failure messages by test id from pytest ``-rA`` output."""
    status: dict[str, str] = {}
    messages: dict[str, str] = {}
    for m in _RESULT_LINE.finditer(text):
        status[m.group(2)] = m.group(1)
        if m.group(3):
            messages[m.group(2)] = m.group(3)
    return status, messages


def run_tests(session: RemoteSession, targets: list[str], test_command: str = "pytest", timeout_s: float = 300,
              env: dict[str, str] | None = None, stdin: bytes = b"") -> tuple[dict[str, str], dict[str, str],
                                                                                ExecResult]:
    """Run test ids (or files) in ``session``: (outcomes by id as pytest printed them, failure messages by id,
    ExecResult). Printed outcomes are what grading must not trust (see ``envs.swe_grading``)."""
    limits = Limits(wall_s=timeout_s, cpu_s=timeout_s, memory_bytes=2 << 30, output_bytes=8 << 20)
    env = {"COLUMNS": "400", **(env or {})}  # pytest cuts summary lines at the terminal width
    if test_command == "pytest":
        argv = ["python3", "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", "--tb=short", *targets]
    else:
        argv = ["bash", "-c", test_command.replace("{tests}", " ".join(shlex.quote(t) for t in targets))]
    res = session.exec(argv, limits=limits, env=env, stdin=stdin)
    if res.verdict == Verdict.ERROR:
        raise SandboxFailure(f"running the tests: {res.detail}")
    status, messages = parse_test_output(res.stdout.decode(errors="replace"))
    if not status and test_command != "pytest":
        status = dict.fromkeys(targets, "PASSED" if res.verdict == Verdict.OK else "FAILED")
    return status, messages, res


def truncate(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and end."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"


def _numbered(text: str, first: int = 1, last: int | None = None) -> str:
    lines = text.splitlines()
    last = len(lines) if last is None else min(last, len(lines))
    return "\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(max(first, 1), last + 1))


def load_repo_files(meta: dict[str, Any], cache: dict[str, dict[str, bytes]] | None = None) -> dict[str, bytes]:
    """The files a task puts in its session: ``repo_dir``'s files, then the ``files`` overrides."""
    files: dict[str, bytes] = {}
    if meta.get("repo_dir"):
        root = Path(meta["repo_dir"]).expanduser().absolute()
        if cache is not None and str(root) in cache:
            files.update(cache[str(root)])
        else:
            if not root.is_dir():
                raise FileNotFoundError(f"repo_dir {root} is not a directory")
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
                for name in sorted(filenames):
                    p = Path(dirpath, name)
                    if p.is_file() and not p.is_symlink() and not name.endswith(".pyc"):
                        files[p.relative_to(root).as_posix()] = p.read_bytes()
            if cache is not None:
                cache.clear()  # keep one repository: the tasks of a set share it
                cache[str(root)] = dict(files)
    for path, text in (meta.get("files") or {}).items():
        files[path] = text.encode() if isinstance(text, str) else bytes(text)
    return files


class SWEEnv(Env):
    """Fix a repository with bash/view/edit/create tools; reward 1.0 when the task's tests all pass."""

    task_type = "swe"
    multi_turn = True
    uses_sandbox = True
    uses_tools = True
    tools = TOOLS
    #: how the model writes calls; the rollout sets the model family's format (``chat_format.detect_format``)
    tool_format: ToolFormat = get_format("k2")

    def __init__(self, tasks: list[Task] | None = None, *, sandbox_address: str | None = None, max_turns: int = 20,
                 command_timeout_s: float = 30, **options: Any) -> None:
        super().__init__(tasks)
        self.sandbox_address, self.max_turns, self.command_timeout_s = sandbox_address, max_turns, command_timeout_s
        self.test_timeout_s = float(options.pop("test_timeout_s", 300))
        self.max_output_chars = int(options.pop("max_output_chars", 8000))
        if options:
            log.warning("SWEEnv ignores unknown options %s", sorted(options))
        self._client = None
        self._session = None
        self._repo_cache: dict[str, dict[str, bytes]] = {}
        self._baseline: dict[str, str] = {}
        self._turn, self._done, self._error, self._calls = 0, True, None, 0

    # -- episode ----------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Open a session holding the task's repository and return the prompt (a failure shows in info)."""
        _, info = super().reset(seed=seed, options=options)
        self._close_session()
        self._turn, self._done, self._error, self._calls = 0, False, None, 0
        try:
            self._open(self.task)
        except Exception as e:  # any failure to set up ends the episode at the first step, with reward 0
            log.warning("swe task %s: setting up the sandbox failed: %s", self.task.id, e)
            self._error = f"{type(e).__name__}: {e}"
            self._close_session()
            info["sandbox_error"] = self._error
        info["messages"] = [{"role": "user", "content": self.user_prompt(self.task)}]
        info["tools"] = copy.deepcopy([t.to_openai() for t in self.tools])  # the caller's own copy to change
        return self.prompt(self.task), info

    def prompt(self, task: Task) -> str:
        """The first observation as text: K2 tool declarations, then ``user_prompt``."""
        return f"{render_tool_declarations(self.tools)}\n{self.user_prompt(task)}"

    def user_prompt(self, task: Task) -> str:
        """The issue and how to work, with an example call in ``tool_format`` (the first user message)."""
        meta = task.meta
        fmt = self.tool_format
        example = fmt.render_calls([ToolCall(fmt.call_id("bash", 0), "bash", {"command": "ls"})])
        return (f"You are fixing an issue in the repository {meta.get('repo', '')}, checked out in the current "
                f"directory.\n\n# Issue\n\n{meta.get('problem_statement') or task.prompt}\n\n# How to work\n\n"
                "Explore the code, reproduce the problem, then change the non-test source files to resolve it. "
                f"Call tools in your tool-call format, for example:\n{example}\nEach call's result comes back to "
                "you before your next turn. When the issue is resolved, call submit: hidden tests check your "
                f"changes. You have at most {self.max_turns} turns.\n")

    def step(self, action: str):
        """Run the response's tool calls; ``submit`` or the last turn grades the repository."""
        if self.task is None:
            raise RuntimeError("step() called before reset()")
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        self._turn += 1
        if self._error is not None:
            return self._end(self._error, truncated=False)
        calls, errors = self.tool_format.parse(action, self.tools, self._calls)
        self._calls += len(calls) + len(errors)
        results = [(self._error_call(e, i), f"Error: {e}") for i, e in enumerate(errors)]
        if not calls and not errors:
            results.append((self._error_call("", 0), "No tool call found. Call a tool, or submit when you are done."))
        submitted = False
        try:
            for call in calls:
                if call.name == "submit":
                    submitted = True
                    break
                results.append((call, self._run_tool(call)))
            if submitted or self._turn >= self.max_turns:
                return self._grade(render_tool_results(results), truncated=not submitted)
        except Exception as e:  # a sandbox failure (or any other) costs this episode only, never the run
            return self._end(f"{type(e).__name__}: {e}", truncated=False)
        info = {"task_id": self.task.id, "turn": self._turn, "tool_calls": len(calls), "tool_errors": len(errors),
                "calls": calls, "messages": [{"role": "tool", "tool_call_id": call.id, "name": call.name,
                                              "content": result} for call, result in results]}
        return render_tool_results(results), 0.0, False, False, info

    def _error_call(self, error: str, i: int) -> ToolCall:
        """A call to report a parse error against: the one it names, else a fresh id of ``tool_format``."""
        m = _ERROR_ID.match(error)
        if m:
            return ToolCall(m.group(1), m.group(2), {})
        if self.tool_format.name == "k2":
            return ToolCall("invalid_tool_call", "invalid", {})
        m = _OTHER_ERROR_ID.match(error)
        return ToolCall(m.group(1) if m else self.tool_format.call_id("invalid", self._calls + i), "invalid", {})

    def _end(self, error: str, truncated: bool):
        log.warning("swe task %s: sandbox failure: %s", self.task.id, error)
        self._done = True
        self._close_session()
        info = {"task_id": self.task.id, "turn": self._turn, "sandbox_error": error, "resolved": False}
        return "", 0.0, not truncated, truncated, info

    def close(self) -> None:
        """Close the open session and the connection."""
        self._close_session()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing must never fail the run
                log.debug("closing the sandbox client failed", exc_info=True)
            self._client = None

    # -- sandbox ----------------------------------------------------------------------------------

    @property
    def client(self) -> SandboxClient:
        """The sandbox client, connected on first use."""
        if self._client is None:
            from sandbox.client import connect

            self._client = connect(self.sandbox_address)
        return self._client

    def _open(self, task: Task) -> None:
        meta = task.meta
        files = load_repo_files(meta, self._repo_cache)
        self._session = self.client.create_session(image=meta.get("image_name") or "", files=files)
        # what the repository holds before the model acts; the hidden test_patch is applied only at grading
        self._baseline = list_files(self._session)

    def _read(self, path: str) -> bytes | None:
        """A session file's bytes, or None when it does not exist."""
        try:
            return self._session.read_files([path])[path]
        except SandboxError as e:
            if _user_error(e):
                return None
            raise

    def _exec(self, argv: list[str], timeout_s: float) -> ExecResult:
        res = self._session.exec(argv, limits=Limits(wall_s=timeout_s, cpu_s=timeout_s, memory_bytes=2 << 30))
        if res.verdict == Verdict.ERROR:
            raise SandboxFailure(res.detail or "the sandbox failed")
        return res

    def _close_session(self) -> None:
        if self._session is not None:
            try:
                self._session.close()
            except Exception:  # the session may already be gone; the reaper frees it
                log.debug("closing the sandbox session failed", exc_info=True)
            self._session = None

    def _grade(self, observation: str, truncated: bool):
        """Carry the model's source changes into a fresh session and run the tests there (``envs.swe_grading``)."""
        meta = self.task.meta
        f2p, p2p = as_test_ids(meta.get("FAIL_TO_PASS")), as_test_ids(meta.get("PASS_TO_PASS"))
        if not f2p + p2p:
            raise SandboxFailure(f"task {self.task.id} has no FAIL_TO_PASS or PASS_TO_PASS tests to grade with")
        diff = meta.get("test_patch") or ""
        test_paths = {t.split("::")[0] for t in f2p + p2p} | set(patch_paths(diff))
        kept, deleted, dropped = allowed_changes(self._baseline, list_files(self._session), test_paths)
        changes = self._session.read_files(kept) if kept else {}
        self._close_session()
        files = grading_files(meta, load_repo_files(meta, self._repo_cache), changes)
        grader = self.client.create_session(image=meta.get("image_name") or "", files=files)
        try:
            if deleted:
                grader.exec(["python3", "-I", "-S", "-c", "import os, sys\nfor p in sys.argv[1:]:\n    os.remove(p)",
                             *deleted], limits=Limits(wall_s=60, cpu_s=60))
            if diff:  # git apply works outside a repository too, and SWE-bench's images have git
                res = grader.exec(["git", "apply", "--whitespace=nowarn", "-"], stdin=diff.encode(),
                                  limits=Limits(wall_s=60, cpu_s=60))
                if res.verdict != Verdict.OK:
                    raise SandboxFailure(f"test_patch does not apply: {res.stderr.decode(errors='replace')[:500]}")
            nonce = new_nonce()
            _, _, res = run_tests(grader, f2p + p2p, meta.get("test_command") or "pytest", self.test_timeout_s,
                                  env=PLUGIN_ENV, stdin=(nonce + "\n").encode())
        finally:
            grader.close()
        status, why = graded_outcomes(res.stdout, nonce)
        status = status or {}
        f2p_ok = sum(status.get(t) in PASSING for t in f2p)
        p2p_ok = sum(status.get(t) in PASSING for t in p2p)
        resolved = f2p_ok == len(f2p) and p2p_ok == len(p2p)
        info = {"task_id": self.task.id, "turn": self._turn, "resolved": resolved, "submitted": not truncated,
                "fail_to_pass_passed": f2p_ok, "fail_to_pass_total": len(f2p),
                "pass_to_pass_passed": p2p_ok, "pass_to_pass_total": len(p2p), "test_verdict": res.verdict.value,
                "changed_files": kept, "dropped_changes": dropped[:50]}
        if why:
            info["grade_error"] = why
        self._done = True
        return observation, (1.0 if resolved else 0.0), not truncated, truncated, info

    # -- tools ------------------------------------------------------------------------------------

    def _run_tool(self, call: ToolCall) -> str:
        args = call.arguments
        try:
            if call.name == "bash":
                return self._bash(args["command"])
            path = self._path(args["path"])
            if call.name == "view_file":
                text = self._must_read(path)
                out = _numbered(text, args.get("start_line", 1), args.get("end_line"))
                return truncate(out or "(no lines in that range)", self.max_output_chars)
            if call.name == "create_file":
                self._write(path, args["content"])
                return f"Wrote {path} ({len(args['content'].splitlines())} lines)."
            if call.name == "edit_file":
                return self._edit(path, args["old_str"], args["new_str"])
            return f"Error: unknown tool {call.name!r}"
        except _ToolError as e:
            return f"Error: {e}"

    def _bash(self, command: str) -> str:
        res = self._exec(["bash", "-c", command], self.command_timeout_s)
        out = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
        if res.verdict == Verdict.TIMEOUT:
            out += f"\n[the command timed out after {self.command_timeout_s:g} s and was killed]"
        elif res.verdict != Verdict.OK:
            out += f"\n[exit code {res.exit_code}{' ' + res.detail if res.detail else ''}]"
        return truncate(out, self.max_output_chars) or "(no output)"

    @staticmethod
    def _path(path: str) -> str:
        path = path.strip()
        for prefix in ("/work/", "./"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return path

    def _must_read(self, path: str) -> str:
        try:
            text = self._read(path)
        except SandboxError as e:
            raise SandboxFailure(str(e)) from e
        if text is None:
            raise _ToolError(f"{path} is not a file in the repository (use bash to list directories)")
        return text.decode(errors="replace")

    def _write(self, path: str, content: str) -> None:
        try:
            self._session.write_files({path: content.encode()})
        except SandboxError as e:
            if _user_error(e):
                raise _ToolError(str(e)) from e
            raise

    def _edit(self, path: str, old: str, new: str) -> str:
        text = self._must_read(path)
        count = text.count(old)
        if count != 1:
            raise _ToolError(f"old_str occurs {count} times in {path}; it must occur exactly once"
                             + (" (add surrounding lines to make it unique)" if count else ""))
        at = text.index(old)
        text = text[:at] + new + text[at + len(old):]
        self._write(path, text)
        first = text[:at].count("\n") + 1
        snippet = _numbered(text, first - 3, first + new.count("\n") + 3)
        return f"Edited {path}. The changed region now reads:\n{truncate(snippet, self.max_output_chars)}"

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **kwargs: Any) -> list[Task]:
        """SWE-smith-style tasks made by ``envs.swe_smith.generate_swe_tasks`` (see there for the options)."""
        from envs.swe_smith import generate_swe_tasks

        return generate_swe_tasks(n=n, seed=seed, **kwargs)


register("swe", SWEEnv)
