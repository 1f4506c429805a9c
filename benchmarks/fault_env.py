"""An environment whose every reward runs a program in the sandbox service, for the fault suite's sandbox faults.

``SandboxedArithmeticEnv`` scores the arithmetic task as ``ArithmeticEnv`` does, but decides it by running a small
Python program in a fresh sandbox (it compares the response's answer with the task's, after ``delay_s`` seconds, so
that commands are running when a fault strikes). The reward is the same as the plain environment's whatever the
sandbox does, unless the sandbox infrastructure fails twice under one command: that is an environment error (the
trajectory is left out), never a wrong answer. The suite installs it as a plug-in (``rl.envs`` entry point) of the
run it starts, as a user's package would.
"""

from __future__ import annotations

from typing import Any

from envs.arithmetic import ArithmeticEnv, extract_answer
from envs.base import Task
from sandbox.backend import Limits, Verdict

CHECK = "import sys, time\ntime.sleep(float(sys.argv[3]))\nprint('yes' if sys.argv[1] == sys.argv[2] else 'no')\n"


class SandboxedArithmeticEnv(ArithmeticEnv):
    """Arithmetic word problems whose answers are checked by a program in the sandbox (see the module)."""

    uses_sandbox = True

    def __init__(self, tasks: list[Task] | None = None, *, sandbox_address: str | None = None, delay_s: float = 0.3,
                 **options: Any) -> None:
        super().__init__(tasks, **options)
        self.sandbox_address, self.delay_s = sandbox_address, delay_s
        self._client = None

    @classmethod
    def generate_tasks(cls, n: int, seed: int, delay_s: float = 0.3, **options: Any) -> list[Task]:
        return super().generate_tasks(n, seed, **options)

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        from sandbox.client import connect

        if self._client is None:
            self._client = connect(self.sandbox_address)
        got = extract_answer(response)
        result = self._client.run(["python3", "-c", CHECK, str(got), str(int(task.answer)), str(self.delay_s)],
                                  limits=Limits(wall_s=10 + self.delay_s))
        if result.verdict is not Verdict.OK:
            raise RuntimeError(f"sandbox {result.verdict.value} on task {task.id}: {result.detail}")
        correct = result.stdout.strip() == b"yes"
        return (1.0 if correct else 0.0), {"extracted": got, "correct": correct, "sandbox_wall_s": result.wall_s}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().close()
