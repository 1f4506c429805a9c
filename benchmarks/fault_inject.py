"""Injecting real faults into a running RL run: the processes are found by what they are doing, then killed,
stopped, starved of memory or of disk.

Ray names each actor process after its class and, while it runs a call, after the method too (its process title,
``ray::RolloutWorker.rollout``); so a run's phase is read from its processes: ``rollout`` while an inference engine
runs ``rollout``, ``train`` while a trainer trains, ``weight_update`` while a trainer runs ``update_weights``,
``save`` while one runs ``save``. The iteration is the number of records in the run's ``metrics.jsonl``. Only the
descendants of one process (the run's driver, or the test process that started Ray) are looked at: other runs on
the machine are left alone.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rl.loop.checkpoint import (
    list_checkpoints,  # imported here: the injector must not spend seconds importing at the point
)

#: a phase of an iteration, and the actor method that shows it ("reward": a command runs in the run's sandbox service)
PHASES = {"rollout": ("RolloutWorker", "rollout"), "train": ("TrainerWorker", "train"),
          "weight_update": ("TrainerWorker", "update_weights"), "save": ("TrainerWorker", "save"),
          "reward": ("sandbox", "command")}


def sandbox_service(root: int) -> psutil.Process | None:
    """The run's own sandbox service process under ``root`` (``rl sandbox serve``), if one runs."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                line = p.cmdline()
                if "sandbox" in line and "serve" in line and p.status() != psutil.STATUS_ZOMBIE:
                    return p
    return None


def sandbox_commands(root: int) -> list[psutil.Process]:
    """The sandboxes running a command for the run's sandbox service under ``root`` (its bwrap children)."""
    service = sandbox_service(root)
    if service is None:
        return []
    out = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in service.children():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if p.name() == "bwrap" and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
    return out


def actors(root: int, cls: str, method: str | None = None) -> list[psutil.Process]:
    """Live actor processes of class ``cls`` under process ``root`` (running ``method`` when given)."""
    out = []
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        try:
            title = (p.cmdline() or [""])[0]  # "ray::Class" idle, "ray::Class.method" in a call
            if (title == f"ray::{cls}.{method}" if method else title.split(".")[0] == f"ray::{cls}") \
                    and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def records(run_dir: Path) -> int:
    """Iterations the run has finished (lines of its metrics.jsonl)."""
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        return 0


def complete_checkpoints(run_dir: Path) -> list[str]:
    """Names of the run's complete checkpoints, oldest first."""
    return [p.name for p in list_checkpoints(run_dir)] if (run_dir / "checkpoints").is_dir() else []


@dataclass
class Injection:
    """What was done, when (``time.time()``), and where in the run."""

    phase: str
    iteration: int
    target: str = ""
    at: float | None = None
    still_in_phase: bool = False
    finished: int = 0  # iterations the run had finished
    checkpoints: list[str] = field(default_factory=list)  # its complete checkpoints then


@dataclass
class Trigger:
    """Inject once the run is in ``phase`` of ``iteration`` (the save after ``iteration``), after ``delay_s``."""

    phase: str
    iteration: int
    delay_s: float = 0.0
    cls: str = field(init=False)
    method: str = field(init=False)

    def __post_init__(self) -> None:
        self.cls, self.method = PHASES[self.phase]

    @classmethod
    def draw(cls, seed: int, phases: tuple[str, ...], iterations: range, max_delay_s: float = 0.03) -> Trigger:
        """A seeded random point of an iteration: the phase, the iteration and the delay into the phase."""
        rng = random.Random(seed)
        return cls(rng.choice(phases), rng.choice(list(iterations)), round(rng.uniform(0, max_delay_s), 3))

    def reached(self, root: int, run_dir: Path) -> bool:
        done = records(run_dir)
        want = self.iteration + 1 if self.phase == "save" else self.iteration  # a save follows its record
        return done == want and self.in_phase(root)

    def in_phase(self, root: int) -> bool:
        """Whether the run under ``root`` is in this trigger's phase now."""
        if self.phase == "reward":
            return bool(sandbox_commands(root))
        return bool(actors(root, self.cls, self.method))


class Injector(threading.Thread):
    """Watches the run under ``root`` and calls ``act(root)`` once at ``trigger``; ``act`` returns a description of
    its target. ``injection`` says what happened (``at`` stays None if the run never reached the point). ``after``:
    another injector whose fault must come first (its trigger is watched only once that one has acted), so that two
    faults whose phases can overlap land in a known order."""

    def __init__(self, root: int, run_dir: Path, trigger: Trigger, act: Callable[[int], str],
                 poll_s: float = 0.005, after: Injector | None = None) -> None:
        super().__init__(daemon=True)
        self.root, self.run_dir, self.trigger, self.act, self.poll_s = root, run_dir, trigger, act, poll_s
        self.after = after
        self.injection = Injection(trigger.phase, trigger.iteration)
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if (self.after is None or self.after.injection.at is not None) and \
                        self.trigger.reached(self.root, self.run_dir):
                    time.sleep(self.trigger.delay_s)
                    self.injection.still_in_phase = self.trigger.in_phase(self.root)
                    self.injection.finished = records(self.run_dir)
                    self.injection.checkpoints = complete_checkpoints(self.run_dir)
                    self.injection.at = time.time()  # before acting: filling a disk takes a while, and the run
                    self.injection.target = self.act(self.root)  # may notice before it is done
                    return
                time.sleep(self.poll_s)
        except BaseException as e:  # the test or suite reports it
            self.error = e

    def stop(self) -> None:
        self._halt.set()


def signal_actor(cls: str, sig: int, method: str | None = None) -> Callable[[int], str]:
    """An action: send ``sig`` to the first actor process of ``cls`` (running ``method``, if given)."""
    def act(root: int) -> str:
        procs = actors(root, cls, method) or actors(root, cls)
        if not procs:
            seen = [(q.pid, q.ppid(), (q.cmdline() or [""])[0], q.status())
                    for q in psutil.Process(root).children(recursive=True)]
            raise RuntimeError(f"no {cls} process under {root} to send {signal.Signals(sig).name} to: {seen}")
        os.kill(procs[0].pid, sig)
        return f"{cls} pid {procs[0].pid} ({signal.Signals(sig).name})"
    return act


def kill_sandbox_service(root: int) -> str:
    """An action: SIGKILL the run's sandbox service while it runs commands (its sandboxes are left to end alone)."""
    service = sandbox_service(root)
    if service is None:
        raise RuntimeError(f"no sandbox service under {root}")
    busy = len(sandbox_commands(root))
    os.kill(service.pid, signal.SIGKILL)
    return f"sandbox service pid {service.pid} (SIGKILL, {busy} commands running)"


def kill_sandbox_commands(root: int) -> str:
    """An action: SIGKILL every sandbox running a command for the run's sandbox service (from outside, as an
    eviction or an operator would: bwrap and, with it, the sandbox's whole PID namespace)."""
    procs = sandbox_commands(root)
    if not procs:
        raise RuntimeError(f"no sandbox running a command under {root}")
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    return f"{len(procs)} sandboxes (bwrap pids {', '.join(str(p.pid) for p in procs)}, SIGKILL)"


def kill_group(proc: subprocess.Popen) -> Callable[[int], str]:
    """An action: SIGKILL the whole process group of ``proc`` (the driver and what it started), as a container
    restart does."""
    def act(root: int) -> str:
        os.killpg(proc.pid, signal.SIGKILL)
        return f"driver pid {proc.pid} and its process group (SIGKILL)"
    return act


MEMCG = Path("/sys/fs/cgroup/memory")


def oom_actor(cls: str, limit_bytes: int = 256 * 2**10) -> Callable[[int], str]:
    """An action: move the first actor process of ``cls`` into a memory cgroup (v1) of its own whose limit its
    next allocations exceed, so that the kernel's OOM killer kills it (needs root and the v1 memory controller)."""
    def act(root: int) -> str:
        procs = actors(root, cls)
        if not procs:
            raise RuntimeError(f"no {cls} process under {root}")
        pid = procs[0].pid
        group = MEMCG / f"rl-fault-{pid}"
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        (group / "cgroup.procs").write_text(str(pid))
        return f"{cls} pid {pid} (memory cgroup limit {limit_bytes // 2**10} KiB)"
    return act


def oom_supported() -> str | None:
    """Why a real OOM kill cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a memory cgroup needs root"
    if not (MEMCG / "memory.limit_in_bytes").is_file():
        return "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    return None


def oom_kills(pid: int) -> int | None:
    """OOM kills counted in the fault's cgroup of ``pid`` (memory.oom_control's oom_kill), then the group is
    removed; None when the kernel does not count them."""
    group = MEMCG / f"rl-fault-{pid}"
    try:
        fields = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        return int(fields["oom_kill"]) if "oom_kill" in fields else None
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()


def fill_disk(path: Path) -> Callable[[int], str]:
    """An action: fill the filesystem of ``path`` with one file until it is full."""
    def act(root: int) -> str:
        block = b"\0" * 2**20
        written = 0
        with open(path / "filler", "wb") as f:
            try:
                while True:
                    f.write(block)
                    f.flush()
                    written += len(block)
            except OSError:
                pass
        return f"filled {path} ({written // 2**20} MiB)"
    return act


def stopped_descendants(root: int) -> list[int]:
    """Processes under ``root`` left stopped (SIGSTOP) by a fault."""
    out = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() == psutil.STATUS_STOPPED:
                    out.append(p.pid)
    return out
