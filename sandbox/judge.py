"""Judged runs of code against tests: the service's side of ``sandbox.judge_harness``.

``Run(code, tests)`` does not run the two as one program (a program that exits before the tests, or reads or
patches them, would pass): it writes the code as ``solution.py``, runs the judge harness, sends it the tests and a
fresh nonce on stdin, and believes only the result line that carries the nonce. A missing or malformed result, or
a solution that ends early or tampers, gives a failed verdict whose detail says why.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from sandbox.backend import ExecResult, Verdict

HARNESS = (Path(__file__).parent / "judge_harness.py").read_text()
# verdicts the sandbox decided itself (the judge never got to answer, or a limit ended the run)
_SANDBOX_VERDICTS = (Verdict.TIMEOUT, Verdict.OUTPUT_LIMIT, Verdict.CANCELLED, Verdict.ERROR)


def judge_command(code: str, tests: str) -> tuple[dict[str, bytes], list[str], bytes, str]:
    """(files, argv, stdin, nonce) of a judged run of ``code`` against ``tests``."""
    nonce = secrets.token_hex(16)
    stdin = json.dumps({"nonce": nonce, "tests": tests}).encode()
    return {"solution.py": code.encode()}, ["python3", "-I", "-c", HARNESS, "judge"], stdin, nonce


def judge_verdict(res: ExecResult, nonce: str) -> ExecResult:
    """The run's verdict as the judge gave it: OK only when the line with ``nonce`` says the tests passed.

    ``stdout`` becomes what the tests printed; ``stderr`` keeps the solution's own output.
    """
    if res.verdict in _SANDBOX_VERDICTS:
        return res
    result = None
    marker = nonce.encode() + b" "
    for line in res.stdout.splitlines():
        at = line.find(marker)
        if at >= 0:
            try:
                result = json.loads(line[at + len(marker):])
            except ValueError:
                result = None
            break
    if not isinstance(result, dict) or not isinstance(result.get("passed"), bool):
        how = f"exit status {res.exit_code}" if res.signal is None else f"killed by signal {res.signal}"
        why = res.detail or how
        res.stdout = b""
        if res.verdict in (Verdict.OK, Verdict.FAILED):
            res.verdict, res.exit_code = Verdict.FAILED, res.exit_code or 1
        res.detail = f"the judge gave no result (the harness was killed or its output tampered with; {why})"
        return res
    res.stdout = str(result.get("printed", "")).encode()
    if result["passed"] and res.verdict == Verdict.OK:
        return res
    reason = str(result.get("reason", ""))
    if res.verdict in (Verdict.OK, Verdict.FAILED):
        res.verdict, res.exit_code, res.detail = Verdict.FAILED, res.exit_code or 1, reason
    else:  # a limit of the sandbox (memory, processes...) ended it: keep that verdict, with the judge's reason
        res.detail = f"{res.detail}; {reason}" if reason else res.detail
    return res
