"""Grading a SWE episode so that the reward cannot be gamed from inside the episode's sandbox.

The model has a shell in its session: it can edit the tests, add a ``conftest.py`` that passes everything, plant a
``sitecustomize.py`` in its home, shadow ``pytest`` with a module of its own, or print ``PASSED test_x``. So the
tests never run in that session. At grading:

1. ``list_files`` (a trusted lister, ``python3 -I``) takes the session's files and their hashes; comparing with the
   list taken at reset gives what the model changed.
2. ``allowed_changes`` keeps only changes to the repository's source: never a test file (the task's, or anything
   that looks like one), a ``conftest.py``, a test-runner configuration, a ``.pth``/``sitecustomize`` file, nor a
   new module at the top of the repository, where it would shadow an installed one.
3. A fresh session gets the task's original files, those changes, then the hidden ``test_patch`` (never shown
   during the episode), and the judge plugin (``envs/swe_judge_plugin.py``), which reports every test's outcome on
   a line tagged with a nonce that only the grader knows. Without that line every test counts as failed.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path, PurePosixPath
from typing import Any

from sandbox.backend import Limits, Verdict

PLUGIN_SOURCE = (Path(__file__).parent / "swe_judge_plugin.py").read_text()
PLUGIN_DIR = ".rl_judge"
PLUGIN_ENV = {"PYTEST_PLUGINS": "rl_judge_pytest", "PYTHONPATH": f"/work/{PLUGIN_DIR}"}
_SKIP = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", PLUGIN_DIR}
_CONFIG_FILES = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py", "noxfile.py",
                 "sitecustomize.py", "usercustomize.py", ".coveragerc", "Makefile"}
_TEST_DIRS = {"test", "tests", "testing"}
_TEST_FILE = re.compile(r"^(test_.*|.*_test)\.py$")

LISTER = f"""
import hashlib, json, os
skip = {sorted(_SKIP)!r}
out, stack = {{}}, ['.']
while stack:
    d = stack.pop()
    for e in os.scandir(d):
        if e.is_dir(follow_symlinks=False):
            if e.name not in skip:
                stack.append(e.path)
        elif e.is_file(follow_symlinks=False) or e.is_symlink():
            p = e.path[2:]
            if e.is_symlink():
                out[p] = 'symlink:' + os.readlink(e.path)
            else:
                h = hashlib.sha256()
                with open(e.path, 'rb') as f:
                    for chunk in iter(lambda: f.read(1 << 20), b''):
                        h.update(chunk)
                out[p] = h.hexdigest()
        if len(out) > 200000:
            raise SystemExit('too many files')
print(json.dumps(out))
"""


class GradingError(Exception):
    """The episode cannot be graded (the sandbox failed, or the session's files could not be listed)."""


def list_files(session) -> dict[str, str]:
    """{path: sha256} of the regular files (and symlinks) under the session's work directory."""
    res = session.exec(["python3", "-I", "-S", "-c", LISTER],
                       limits=Limits(wall_s=120, cpu_s=120, memory_bytes=1 << 30, output_bytes=64 << 20))
    if res.verdict != Verdict.OK:
        raise GradingError(f"listing the repository failed: {res.detail or res.stderr[-300:]!r}")
    return json.loads(res.stdout)


def is_protected(path: str, test_paths: set[str]) -> bool:
    """Whether a change to ``path`` is never carried into grading: tests, test configuration, start-up hooks."""
    p = PurePosixPath(path)
    return (path in test_paths or p.name in _CONFIG_FILES or p.suffix == ".pth" or bool(_TEST_FILE.match(p.name))
            or any(part in _TEST_DIRS for part in p.parts[:-1]) or p.parts[0] == PLUGIN_DIR)


def allowed_changes(before: dict[str, str], after: dict[str, str], test_paths: set[str]) -> tuple[list, list, list]:
    """(changed paths kept, deleted paths kept, paths dropped) between two listings."""
    packages = {str(PurePosixPath(p).parent) for p in before if PurePosixPath(p).name == "__init__.py"}
    kept, deleted, dropped = [], [], []
    for path, digest in sorted(after.items()):
        if before.get(path) == digest:
            continue
        parent = str(PurePosixPath(path).parent)
        new_outside_package = path not in before and parent not in packages
        if is_protected(path, test_paths) or new_outside_package or digest.startswith("symlink:"):
            dropped.append(path)
        else:
            kept.append(path)
    for path in sorted(set(before) - set(after)):
        (dropped if is_protected(path, test_paths) else deleted).append(path)
    return kept, deleted, dropped


def graded_outcomes(stdout: bytes, nonce: str) -> tuple[dict[str, str] | None, str]:
    """The outcomes the judge plugin reported, or (None, why) when it did not report or saw tampering."""
    started, result = False, None
    prefix = nonce + " "
    for raw in stdout.decode(errors="replace").splitlines():
        at = raw.find(prefix)
        if at < 0:
            continue
        rest = raw[at + len(prefix):]
        if rest == "start":
            started = True
            continue
        try:
            result = json.loads(rest)
        except ValueError:
            return None, "the judge plugin's result line is malformed"
    if result is None or not isinstance(result, dict):
        return None, ("the test run ended before pytest finished (an exit in the code under test?)" if started
                      else "the judge plugin did not run (the test command does not run pytest?)")
    if result.get("tampered"):
        return None, f"the code under test replaced parts of the test runner: {', '.join(result['tampered'])}"
    outcomes = result.get("outcomes")
    if not isinstance(outcomes, dict):
        return None, "the judge plugin's result line is malformed"
    return {str(k): str(v) for k, v in outcomes.items()}, ""


def new_nonce() -> str:
    """A fresh nonce for one grading run."""
    return secrets.token_hex(16)


def grading_files(meta: dict[str, Any], repo: dict[str, bytes], changes: dict[str, bytes]) -> dict[str, bytes]:
    """The files of the grading session: the original repository, the kept changes, and the judge plugin."""
    return {**repo, **changes, f"{PLUGIN_DIR}/rl_judge_pytest.py": PLUGIN_SOURCE.encode()}
