"""A pytest plugin that reports each test's outcome on a line tagged with a nonce, for grading SWE tasks.

Loaded through ``PYTEST_PLUGINS=rl_judge_pytest`` (the grader writes this file into the session as
``.rl_judge/rl_judge_pytest.py`` and puts that directory on PYTHONPATH), so it is imported while pytest starts,
before output capture and before any code of the repository. At import it reads the nonce from stdin (the code
under test cannot read it there later), keeps a private copy of stdout, and writes ``<nonce> start``; at the end of
the session it writes ``<nonce> {"outcomes": ..., "tampered": ...}``. A run that printed the start line but not the
result ended early (an ``os._exit`` in the code under test): every test counts as failed. Lines that the code under
test prints (``PASSED tests/...``) carry no nonce and are ignored.

The code under test runs in the same process, so this raises the bar rather than closing every door: it checks
that the functions pytest and unittest use to run and report tests are the ones it saw at start (a patch of
``_pytest.runner``, ``TestReport`` or ``unittest.TestCase`` marks the run tampered), but a program that searches
the interpreter's memory for the nonce, or registers its own pytest hooks, could still forge the outcome.
Stdlib and pytest only (Python 3.7+: it runs under the task image's interpreter).
"""

import json
import os
import sys
import types

_NONCE = os.read(0, 256).decode(errors="replace").strip()
_OUT = os.dup(1)
os.write(_OUT, f"\n{_NONCE} start\n".encode())

# after the nonce is read, and still before anything of the repository runs
import unittest.case  # noqa: E402

import _pytest.reports  # noqa: E402
import _pytest.runner  # noqa: E402

_WATCHED = (_pytest.runner, _pytest.reports.TestReport, _pytest.reports.BaseReport, unittest.case.TestCase,
            unittest.case._Outcome, unittest.TestResult)
_outcomes = {}


def _functions(owner):
    """ids of the functions an owner (module or class) holds, to notice a replacement later."""
    return {k: id(v) for k, v in vars(owner).items()
            if isinstance(v, (types.FunctionType, staticmethod, classmethod, property))}


_SNAPSHOT = [_functions(o) for o in _WATCHED]

def pytest_runtest_logreport(report) -> None:
    nodeid, was_xfail = report.nodeid, hasattr(report, "wasxfail")
    if report.failed:
        _outcomes[nodeid] = "XPASS" if was_xfail else ("ERROR" if report.when != "call" else "FAILED")
    elif report.skipped:
        _outcomes.setdefault(nodeid, "XFAIL" if was_xfail else "SKIPPED")
    elif report.when == "call" and _outcomes.get(nodeid) not in ("FAILED", "ERROR"):
        _outcomes[nodeid] = "XPASS" if was_xfail else "PASSED"


def pytest_sessionfinish(session, exitstatus) -> None:
    changed = [getattr(o, "__name__", str(o)) for i, o in enumerate(_WATCHED) if _functions(o) != _SNAPSHOT[i]]
    result = {"outcomes": _outcomes, "tampered": changed, "exitstatus": int(exitstatus)}
    os.write(_OUT, f"\n{_NONCE} {json.dumps(result)}\n".encode())
    sys.stdout.flush()
