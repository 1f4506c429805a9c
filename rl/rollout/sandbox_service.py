"""The run's own sandbox service: ``rl sandbox serve`` in a child process, started again when it dies.

A run without ``sandbox.address`` runs its untrusted code through a service of its own, configured by its
``sandbox`` section. It lives in a process of its own, so that a crash of the service (a kernel OOM kill, a bug, a
SIGKILL) takes neither the driver nor its state with it: a watcher thread notices the exit, prints one line and
starts the service again on the same port; clients reconnect by themselves, and the sandbox client retries a
one-shot run that the death cut off once it can reach the service again (``sandbox.client``). The child ends when
the driver does (it watches its parent: ``RL_SANDBOX_PARENT_PID``), and ``stop`` ends it (SIGTERM: the service
removes its sandboxes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from checkpoint_engine.topology import free_port
from rl.errors import UserError
from sandbox.options import SandboxOptions

#: how long the service may take to listen after a start
START_TIMEOUT_S = 60.0
#: restarts allowed over the run's life: a service that keeps dying is a fault of its own, named then
MAX_RESTARTS = 20


#: the environment variable that tells ``rl sandbox serve`` to end when that process does
PARENT_ENV = "RL_SANDBOX_PARENT_PID"


class SandboxServiceProcess:
    """``rl sandbox serve`` for ``options`` in a child process on a free port, kept alive (see the module)."""

    def __init__(self, options: SandboxOptions, max_restarts: int = MAX_RESTARTS) -> None:
        self.options = options.override(port=free_port(options.host))
        self.address = f"{self.options.host}:{self.options.port}"
        self.max_restarts, self.restarts = max_restarts, 0
        self.last_exit: str | None = None  # how the last death looked, e.g. "signal 9"
        self._dir = tempfile.TemporaryDirectory(prefix="rl-sandbox-service-")
        self._config = Path(self._dir.name) / "sandbox.yaml"
        self._config.write_text(json.dumps({"sandbox": self.options.model_dump(mode="json")}))  # YAML ⊇ JSON
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.proc = self._start()
        self._watcher = threading.Thread(target=self._watch, name="sandbox-service-watch", daemon=True)
        self._watcher.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _start(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "rl.cli", "sandbox", "serve", "--config", str(self._config)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())})
        lines, deadline = [], time.monotonic() + START_TIMEOUT_S
        assert proc.stdout is not None
        for line in proc.stdout:  # until it says it listens (or ends)
            lines.append(line.rstrip())
            if "listening on" in line:
                threading.Thread(target=_drain, args=(proc,), daemon=True).start()
                return proc
            if time.monotonic() > deadline:
                break
        proc.kill()
        proc.wait()
        tail = "; ".join(lines[-3:]) or f"exit status {proc.returncode}"
        raise UserError(f"the run's sandbox service did not start: {tail}")

    def _watch(self) -> None:
        while not self._stopping.is_set():
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            self.last_exit = f"signal {-code}" if code < 0 else f"exit status {code}"
            if self.restarts >= self.max_restarts:
                print(f"sandbox service died ({self.last_exit}) after {self.restarts} restarts; not started again: "
                      "commands now fail as environment errors", file=sys.stderr, flush=True)
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    self.proc = self._start()
                except UserError as e:
                    print(f"sandbox service died ({self.last_exit}) and did not start again: {e}", file=sys.stderr,
                          flush=True)
                    return
                self.restarts += 1
            print(f"sandbox service died ({self.last_exit}); started again on {self.address} "
                  f"(restart {self.restarts}), cut-off commands are retried once", flush=True)

    def stop(self) -> None:
        """End the service (SIGTERM, then SIGKILL after 10 s). Idempotent."""
        self._stopping.set()
        with self._lock:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._dir.cleanup()


def _drain(proc: subprocess.Popen) -> None:
    """Read the service's output so that it never blocks on a full pipe (its lines are of no use here)."""
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass
