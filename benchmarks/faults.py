"""Fault-injection suite: a real RL run per fault (Ray, real worker processes, the tiny quick-start-like model), the
fault injected at a seeded random point of an iteration, and what the run did about it.

    python -m benchmarks.faults --json          # every fault; records to benchmarks/results/faults-<machine>.jsonl
    python -m benchmarks.faults --faults stall,trainer_killed --seed 3

Each fault runs ``rl train CONFIG --run-dir D --auto-resume`` as its own process (its own local Ray cluster) and
injects, through ``benchmarks.fault_inject``, when the run is in the drawn phase (rollout, train, weight_update, save)
of the drawn iteration:

- ``rollout_worker_killed``: SIGKILL of an inference engine's process (expected: replaced in place);
- ``rollout_worker_oom``: the kernel's OOM killer kills it (a memory cgroup of its own with a small limit; root);
- ``trainer_killed``: SIGKILL of the trainer rank (expected: the workers restart from the last checkpoint);
- ``stall``: SIGSTOP of an inference engine, never continued (expected: found within ``run.step_timeout_s``);
- ``trainer_stall``: SIGSTOP of the trainer rank;
- ``driver_killed``: SIGKILL of the driver's whole process group; the same command is run again, as a restarted job
  would be, and continues from the last complete checkpoint;
- ``disk_full``: the run directory is a small tmpfs (root) that is filled up during a save; the run must stop with
  one line and its last checkpoint intact; the command is then run again with the space freed;
- ``sandbox_killed``: SIGKILL of the run's own sandbox service while it runs commands (the run's rewards are decided
  by programs in the sandbox: ``benchmarks.fault_env``, installed as a plug-in); expected: the service is started
  again and the commands it cut off run once more, so every reward is the one an uninterrupted run got;
- ``sandbox_command_killed``: SIGKILL, from outside, of the sandboxes running commands (as an eviction would);
  expected: reported as the sandbox's failure, not the program's, and run once more;
- ``node_lost``: the run is on a Ray cluster of three nodes on this machine (a head without CPUs and two worker
  nodes, ``benchmarks.ray_nodes``; its uninterrupted reference too), and the worker node holding the run's actors
  is lost whole (its raylet, object store and workers SIGKILLed together); expected: the workers restart from the
  last checkpoint on the node that is left.

Per fault one JSON object: ``outcome`` (recovered: in place, the run went on; restarted: from a checkpoint; stopped:
ended with a clear message; hang: the run did not end within ``--timeout`` and was killed), ``detect_s`` (from the
injection to the run's line saying what it found: its recovery line, or for ``driver_killed`` the resumed run's line
naming its checkpoint), ``iterations_lost`` (finished iterations that had to be run again), ``checkpoint_lost`` (the
newest complete checkpoint at the injection is gone and none newer took its place), ``checkpoint_corrupt`` (a
checkpoint listed as complete fails ``checkpoint_problem``), ``bit_exact`` (the final weights and every iteration's
reward, loss and lengths equal those of an uninterrupted run of the same config: the resumed or recovered run went
on exactly as the run it replaces). With ``--json`` the records go to ``benchmarks/results/faults-<machine>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.fault_inject import (
    Injector,
    Trigger,
    actors,
    fill_disk,
    kill_group,
    kill_sandbox_commands,
    kill_sandbox_service,
    oom_actor,
    oom_kills,
    oom_supported,
    signal_actor,
    stopped_descendants,
)
from benchmarks.ray_nodes import RayNodes

ROOT = Path(__file__).resolve().parents[1]

#: a very small run: a tiny model, 4 groups of 4 per iteration, a checkpoint after every iteration, training on
#: every batch (equal-reward groups kept: the warm-started tiny model's rewards are mostly 0)
RUN = {
    "run": {"iterations": 4, "eval_every": 100, "save_every": 1, "eval_samples": 0, "keep_checkpoints": 2},
    "warmstart": {"steps": 15, "num_examples": 300, "batch_size": 16, "vocab_size": 400,
                  "architecture": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 2}},
    "env": {"num_train": 200, "num_eval": 4},
    "rollout": {"prompts_per_iteration": 4, "samples_per_prompt": 4, "max_tokens": 24, "max_batch": 8},
    "algorithm": {"minibatches": 2, "micro_batch": 8, "drop_equal_reward_groups": False},
    "optimizer": {"lr": 1e-3},
    "checkpoint_engine": {"bucket_mb": 0.01},
}

#: per-iteration metrics that a run which went on exactly has equal (times and counters of faults left out)
EXACT_KEYS = ("reward_mean", "response_len", "truncation_rate", "loss", "grad_norm", "rollout_tokens", "accuracy")

RECOVERY = re.compile(r"recovery (\d+) of at most \d+: (.*)")
#: the run's lines about its sandbox: the service started again, a cut-off command run once more
SANDBOX_RECOVERY = re.compile(r"(sandbox service died .*|sandbox: a run was cut off .*)")
#: the sandbox faults' run: every reward is decided in the sandbox, by a program that takes 0.3 s
SANDBOXED = {"env": {"name": "sandboxed-arithmetic", "kwargs": {"delay_s": 0.3}}}
RESUMING = re.compile(r"resuming from (iter_\d+)")


def run_config(**sections) -> dict:
    """``RUN`` with ``sections`` merged in (one level deep)."""
    raw = json.loads(json.dumps(RUN))
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return raw


@dataclass
class Fault:
    name: str
    phases: tuple[str, ...]
    sections: dict
    needs: str | None = None  # why it cannot run here, or None


FAULTS = {
    "rollout_worker_killed": Fault("rollout_worker_killed", ("rollout", "train", "weight_update", "save"), {}),
    "rollout_worker_oom": Fault("rollout_worker_oom", ("rollout",), {}),
    "trainer_killed": Fault("trainer_killed", ("rollout", "train", "weight_update", "save"), {}),
    "stall": Fault("stall", ("rollout", "train", "weight_update"), {"run": {"step_timeout_s": 20}}),
    "trainer_stall": Fault("trainer_stall", ("train", "weight_update", "save"), {"run": {"step_timeout_s": 20}}),
    "driver_killed": Fault("driver_killed", ("rollout", "train", "weight_update", "save"), {}),
    "disk_full": Fault("disk_full", ("save",), {}),
    "sandbox_killed": Fault("sandbox_killed", ("reward",), SANDBOXED),
    "sandbox_command_killed": Fault("sandbox_command_killed", ("reward",), SANDBOXED),
    "node_lost": Fault("node_lost", ("rollout", "train", "weight_update"), {}),
}


class Run:
    """One ``rl train ... --auto-resume`` process; its output lines are kept with the time each arrived."""

    def __init__(self, config: Path, run_dir: Path, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "rl.cli", "train", str(config), "--run-dir", str(run_dir), "--auto-resume"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=ROOT, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append((time.time(), line.rstrip()))

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None when it did not end in time (then its process group is killed)."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        for pid in stopped_descendants(self.proc.pid):  # a stopped worker would outlive the run
            os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._reader.join(timeout=5)
        return rc

    def first(self, pattern: re.Pattern, after: float = 0.0) -> tuple[float, re.Match] | None:
        for t, line in self.lines:
            if t >= after and (m := pattern.search(line)):
                return t, m
        return None

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _checkpoints(run_dir: Path) -> list[Path]:
    from rl.loop.checkpoint import list_checkpoints

    return list_checkpoints(run_dir) if (run_dir / "checkpoints").is_dir() else []


def _corrupt(run_dir: Path) -> bool:
    from rl.loop.checkpoint import checkpoint_problem

    return any(checkpoint_problem(p) is not None for p in _checkpoints(run_dir))


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short: not a record (same_run then differs in length)
            continue
    return out


def same_run(a: Path, b: Path) -> bool:
    """Whether run ``b`` ended exactly where run ``a`` did: final weights bit for bit, and per iteration the
    ``EXACT_KEYS`` metrics."""
    from safetensors.torch import load_file

    fa, fb = a / "final" / "model.safetensors", b / "final" / "model.safetensors"
    if not (fa.exists() and fb.exists()):
        return False
    wa, wb = load_file(str(fa)), load_file(str(fb))
    if set(wa) != set(wb) or any(not wa[k].equal(wb[k]) for k in wa):
        return False
    ra, rb = _records(a), _records(b)
    return len(ra) == len(rb) and all(x.get(k) == y.get(k) for x, y in zip(ra, rb, strict=True) for k in EXACT_KEYS)


def plugins(work: Path) -> Path:
    """A directory that, on PYTHONPATH, installs ``benchmarks.fault_env`` as the ``sandboxed-arithmetic`` plug-in
    (an ``rl.envs`` entry point in a distribution's metadata, as ``pip install`` of a user's package leaves it)."""
    info = work / "plugins" / "rl_fault_envs-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rl-fault-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[rl.envs]\nsandboxed-arithmetic = benchmarks.fault_env:SandboxedArithmeticEnv\n")
    return info.parent


def _env(cache: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(plugins(Path(tempfile.gettempdir()) / "rl-fault-plugins")),
                                        os.environ.get("PYTHONPATH")]))
    return {**os.environ, "RL_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200", "PYTHONPATH": path}


def reference(work: Path, fault: Fault, cache: Path, timeout_s: float) -> Path:
    """An uninterrupted run of the fault's config (one per distinct config: run.step_timeout_s changes no result)."""
    sections = {k: v for k, v in fault.sections.items() if k != "run"}
    name = "reference" + ("-" + "-".join(sorted(sections)) if sections else "")
    ref = work / name
    if not (ref / "final" / "model.safetensors").exists():
        config = work / f"{name}.yaml"
        config.write_text(yaml.safe_dump(run_config(**sections)))
        rc = Run(config, ref, _env(cache)).wait(timeout_s)
        if rc != 0:
            raise RuntimeError(f"the reference run failed (exit {rc})")
    return ref


def inject(fault: Fault, seed: int, work: Path, cache: Path, timeout_s: float, nodes: RayNodes | None = None) -> dict:
    """Run ``fault`` once at its seeded point; returns its record."""
    if fault.name == "node_lost" and nodes is None:
        return inject_node_lost(fault, seed, work, cache, timeout_s)
    out: dict = {"fault": fault.name, "seed": seed}
    if fault.name == "rollout_worker_oom" and (why := oom_supported()):
        return {**out, "outcome": "skipped", "note": why}
    iterations = RUN["run"]["iterations"]
    trigger = Trigger.draw(seed, fault.phases, range(1, iterations - 1))
    out.update(phase=trigger.phase, iteration=trigger.iteration, delay_s=trigger.delay_s)
    ref = reference(work, fault, cache, timeout_s)
    run_dir = work / fault.name
    shutil.rmtree(run_dir, ignore_errors=True)
    mounted = False
    if fault.name == "disk_full":
        run_dir.mkdir(parents=True)
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(run_dir)],
                                               capture_output=True).returncode:
            return {**out, "outcome": "skipped", "note": "mounting a tmpfs needs root"}
        mounted = True
    config = work / f"{fault.name}.yaml"
    config.write_text(yaml.safe_dump(run_config(**fault.sections)))
    try:
        return {**out, **_inject(fault, trigger, config, run_dir, ref, cache, timeout_s, nodes)}
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(run_dir)], check=False)


def inject_node_lost(fault: Fault, seed: int, work: Path, cache: Path, timeout_s: float) -> dict:
    """``node_lost``: its reference and its run on one three-node Ray cluster of this machine (see the module)."""
    with RayNodes(head_cpus=0) as nodes:
        for name in ("node-a", "node-b"):
            nodes.add_node(cpus=4, home=work / name)
        nodes.wait_for_nodes(3)
        # the same threads on either node, so that the run after the loss computes as its reference does
        cluster = {"cluster": {"ray_address": nodes.address, "threads_per_worker": 2}}
        lost = Fault(fault.name, fault.phases, cluster)
        return inject(lost, seed, work, cache, timeout_s, nodes)


def lose_node(nodes: RayNodes) -> Callable[[int], str]:
    """An action: SIGKILL the process group of the worker node that holds the run's actors (the node is lost)."""
    def act(root: int) -> str:
        for k, node in enumerate(nodes.procs[1:], 1):  # procs[0] is the head
            if actors(node.pid, "RolloutWorker") or actors(node.pid, "TrainerWorker"):
                os.killpg(node.pid, signal.SIGKILL)
                return f"Ray worker node {k} (process group {node.pid}: raylet, object store, workers; SIGKILL)"
        raise RuntimeError("no worker node holds the run's actors")
    return act


def _inject(fault: Fault, trigger: Trigger, config: Path, run_dir: Path, ref: Path, cache: Path,
            timeout_s: float, nodes: RayNodes | None = None) -> dict:
    env = _env(cache)
    run = Run(config, run_dir, env)
    # the run's actors are the nodes' processes, not the driver's, when it runs on a cluster of its own
    root = os.getpid() if nodes is not None else run.proc.pid
    act = {
        "rollout_worker_killed": signal_actor("RolloutWorker", signal.SIGKILL),
        "rollout_worker_oom": oom_actor("RolloutWorker"),
        "trainer_killed": signal_actor("TrainerWorker", signal.SIGKILL),
        "stall": signal_actor("RolloutWorker", signal.SIGSTOP),
        "trainer_stall": signal_actor("TrainerWorker", signal.SIGSTOP),
        "driver_killed": kill_group(run.proc),
        "disk_full": fill_disk(run_dir),
        "sandbox_killed": kill_sandbox_service,
        "sandbox_command_killed": kill_sandbox_commands,
        "node_lost": lose_node(nodes) if nodes is not None else None,
    }[fault.name]
    injector = Injector(root, run_dir, trigger, act)
    injector.start()
    rc = run.wait(timeout_s)
    injector.stop()
    injector.join(timeout=5)
    inj = injector.injection
    rec: dict = {"target": inj.target, "still_in_phase": inj.still_in_phase, "exit": rc}
    if injector.error is not None:
        rec["note"] = f"injection failed: {injector.error}"
    if inj.at is None:
        return {**rec, "outcome": "hang" if rc is None else "not_injected", "detect_s": None, "iterations_lost": 0,
                "checkpoint_lost": False, "checkpoint_corrupt": _corrupt(run_dir), "bit_exact": same_run(ref, run_dir)}
    if fault.name == "rollout_worker_oom":
        pid = int(inj.target.split("pid ")[1].split()[0])
        rec["oom_kills"] = oom_kills(pid)
    found = run.first(SANDBOX_RECOVERY if fault.name.startswith("sandbox") else RECOVERY, inj.at)
    second = None
    if fault.name in ("driver_killed", "disk_full"):
        stop = run.first(re.compile(r"^error: "), inj.at)
        if fault.name == "disk_full":
            rec["message"] = stop[1].string if stop else None
            (run_dir / "filler").unlink(missing_ok=True)  # the operator frees space; the job is run again
        rec["checkpoint_corrupt_after_fault"] = _corrupt(run_dir)
        second = Run(config, run_dir, env)
        rc2 = second.wait(timeout_s)
        rec["exit_resumed"] = rc2
        resumed = second.first(RESUMING)
        # detection: the run's own line saying what stopped it, or the resumed job's line naming its checkpoint
        found = stop if fault.name == "disk_full" else resumed
        rc = rc2
        rec["resumed_from"] = resumed[1].group(1) if resumed else None
    if rc is None:
        outcome = "hang"
    elif fault.name == "disk_full":
        outcome = "stopped" if rec["exit"] == 1 and rec.get("message") else "not_stopped"
    elif fault.name == "driver_killed":
        outcome = "restarted" if rc == 0 else "failed"
    elif rc != 0:
        outcome = "stopped" if any(line.startswith("error:") for _, line in run.lines) else "failed"
    elif found and "restart from" in found[1].group(found[1].re.groups):
        outcome = "restarted"
    elif found:
        outcome = "recovered"
    elif rec.get("oom_kills") == 0:  # the limit was never reached: no fault happened
        outcome = "not_injected"
    else:
        outcome = "unnoticed"
    rec["outcome"] = outcome
    rec["detect_s"] = None if found is None else round(found[0] - inj.at, 2)
    if found is not None and fault.name not in ("driver_killed", "disk_full"):
        rec["detected"] = found[1].group(found[1].re.groups)
    # finished iterations run again: those after the checkpoint the run went on from (none when it went on in place)
    restart = re.search(r"(?:restart from checkpoint |resuming from )iter_(\d+)",
                        (second.text() if second else rec.get("detected", "")))
    redo_from = int(restart.group(1)) + 1 if restart else (0 if outcome == "restarted" else inj.finished)
    rec["iterations_lost"] = max(0, inj.finished - redo_from)
    after = {p.name for p in _checkpoints(run_dir)}
    newest = inj.checkpoints[-1] if inj.checkpoints else None
    rec["checkpoint_lost"] = bool(newest) and newest not in after and not any(a > newest for a in after)
    rec["checkpoint_corrupt"] = _corrupt(run_dir) or bool(rec.get("checkpoint_corrupt_after_fault"))
    rec["bit_exact"] = same_run(ref, run_dir)
    done = _records(run_dir)
    rec["recoveries"] = max((r.get("recoveries", 0) for r in done), default=0)
    if fault.name.startswith("sandbox"):
        for key in ("sandbox_restarts", "sandbox_retries", "env_errors"):
            rec[key] = max((r.get(key, 0) for r in done), default=0)
    return rec


def table(rows: list[dict]) -> str:
    head = ("fault", "phase", "iter", "outcome", "detect_s", "iterations_lost", "checkpoint_lost",
            "checkpoint_corrupt", "bit_exact")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["fault"], r.get("phase", "-"), r.get("iteration", "-"), r["outcome"],
                 "-" if r.get("detect_s") is None else f"{r['detect_s']:.1f}", r.get("iterations_lost", "-"),
                 r.get("checkpoint_lost", "-"), r.get("checkpoint_corrupt", "-"), r.get("bit_exact", "-")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of: " + ", ".join(FAULTS))
    p.add_argument("--seed", type=int, default=0, help="draws each fault's phase, iteration and delay")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it counts as a hang")
    p.add_argument("--machine", default=f"cpu-{os.cpu_count()}core", help="names the results file")
    p.add_argument("--json", action="store_true", help="append the records to benchmarks/results/faults-MACHINE.jsonl")
    args = p.parse_args()
    names = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    work = Path(tempfile.mkdtemp(prefix="rl-faults-"))
    cache = Path(os.environ.get("RL_CACHE_DIR", work / "cache"))
    rows = []
    try:
        for k, name in enumerate(names):
            t0 = time.time()
            rec = inject(FAULTS[name], args.seed * 1000 + k, work, cache, args.timeout)
            rec["wall_s"] = round(time.time() - t0, 1)
            rec["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            rows.append(rec)
            print(json.dumps(rec), flush=True)
            if args.json:
                out = ROOT / "benchmarks" / "results" / f"faults-{args.machine}.jsonl"
                with out.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))


if __name__ == "__main__":
    main()
