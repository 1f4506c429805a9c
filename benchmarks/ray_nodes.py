"""Real multi-node Ray clusters on this one machine, for the tests and the fault suite (a node lost): a head started
with ``ray start --head`` and worker nodes with ``ray start --address``, each node with an environment of its own
(HOME, RL_CACHE_DIR) and, through bubblewrap, a filesystem view of its own (paths hidden from it), as pods on
different Kubernetes nodes would have.

The cluster keeps its state in a temporary directory of its own: a record in Ray's default one would make every later
``ray.init()`` of the test session join this cluster instead of starting its own. Each node is a process group of its
own (``procs``, in the order started): killing one's group loses that node, raylet, workers and all.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_engine.topology import free_port

VENV_BIN = Path(sys.executable).parent


class RayNodes:
    """A head node and any number of worker nodes; ``close()`` (or the context manager) stops them all."""

    def __init__(self, head_cpus: int = 0) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # short: it holds the nodes' sockets
        self.temp_dir = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")
        # a loaded 2-core machine starts a raylet slowly: give it more than Ray's default 10 s to register
        self.env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
                    "RAY_raylet_start_wait_time_s": "120"}
        self.procs: list[subprocess.Popen] = []
        self._start(["--head", f"--port={self.port}", f"--num-cpus={head_cpus}", f"--temp-dir={self.temp_dir}",
                     "--include-dashboard=false", f"--ray-client-server-port={free_port()}"], self.env)
        self.wait_for_nodes(1)

    def _start(self, args: list[str], env: dict[str, str], hide: tuple[Path, ...] = ()) -> None:
        # ports that default to fixed numbers get free ones: several nodes (and other test runs) share this machine
        cmd = ["ray", "start", "--block", "--object-store-memory=100000000", "--disable-usage-stats",
               f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}", *args]
        if hide:  # the node's processes see an empty directory at each of these paths
            cmd = ["bwrap", "--dev-bind", "/", "/", *[a for p in hide for a in ("--tmpfs", str(p))], "--", *cmd]
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           start_new_session=True))

    def add_node(self, *, cpus: int, home: Path, resources: str | None = None, hide: tuple[Path, ...] = ()) -> None:
        """A worker node whose processes have ``home`` as HOME and ``home``/cache as RL_CACHE_DIR."""
        (home / "cache").mkdir(parents=True, exist_ok=True)
        env = {**self.env, "HOME": str(home), "RL_CACHE_DIR": str(home / "cache")}
        args = [f"--address={self.address}", f"--num-cpus={cpus}"]
        if resources:
            args.append(f"--resources={resources}")
        for p in hide:
            p.mkdir(parents=True, exist_ok=True)
        self._start(args, env, hide)

    def wait_for_nodes(self, n: int, timeout_s: float = 120) -> None:
        """Until ``n`` nodes are alive (each node's processes must not have died meanwhile)."""
        deadline = time.time() + timeout_s
        script = f"import ray; ray.init(address={self.address!r}); print(sum(x['Alive'] for x in ray.nodes()))"
        while True:
            for p in self.procs:
                assert p.poll() is None, f"a Ray node exited: {p.stderr.read().decode()[-2000:]}"
            out = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            assert time.time() < deadline, f"{n} Ray nodes did not come up: {out.stderr[-2000:]}"
            time.sleep(2)

    def close(self) -> None:
        """SIGTERM to every node's process group, SIGKILL to what is left after 20 s."""
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 20
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            try:  # the node's raylet, GCS and workers share its process group
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
