"""Faults injected into real runs (the reduced set of ``python -m benchmarks.faults``): a killed inference engine is
replaced in place, a stopped one is found within ``run.step_timeout_s``, a killed driver's job, run again, goes
on from its last complete checkpoint, and a killed sandbox service is started again with its cut-off commands run
once more; each run then ends bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import threading
import time

import psutil
import pytest
import yaml
from rich.console import Console

from benchmarks.fault_env import SandboxedArithmeticEnv
from benchmarks.fault_inject import Injector, Trigger, actors, kill_group, kill_sandbox_service, signal_actor
from benchmarks.faults import SANDBOXED, Run, run_config, same_run
from envs.registry import register
from rl.cli import main as rl_main
from rl.config import parse_config
from rl.loop.controller import train

ITERATIONS = 2


def _cfg(sections: dict | None = None, **run):
    return parse_config(run_config(run={"iterations": ITERATIONS, **run}, **(sections or {})))


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    """An uninterrupted run of the faults' config."""
    out = tmp_path_factory.mktemp("reference")
    train(_cfg(), out, console=Console(file=io.StringIO()))
    return out


def _faulted(cfg, run_dir, trigger: Trigger, act) -> tuple[Injector, list[tuple[float, str]]]:
    """``train`` in this process with ``act`` injected at ``trigger``; returns the injector and the run's lines
    with the time each was written."""
    lines: list[tuple[float, str]] = []

    class Lines(io.StringIO):
        def write(self, s: str) -> int:
            lines.extend((time.time(), x) for x in s.splitlines() if x.strip())
            return len(s)

    injector = Injector(os.getpid(), run_dir, trigger, act)
    injector.start()
    try:
        train(cfg, run_dir, console=Console(file=Lines(), width=300))
    finally:
        injector.stop()
        injector.join(timeout=5)
    assert injector.error is None, injector.error
    assert injector.injection.at is not None, "the run never reached the injection point"
    return injector, lines


def _recoveries(run_dir) -> list[int]:
    return [json.loads(x)["recoveries"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_inference_engine_is_replaced_in_place_and_its_groups_generated_again(reference, tmp_path):
    """SIGKILL of the inference engine's process while it generates iteration 1's groups: the run names it in one
    line, replaces it (weights from the trainers, the only other holder), generates its groups again with their
    seeds and ends with the uninterrupted run's weights and metrics, bit for bit."""
    run_dir = tmp_path / "run"
    inj, lines = _faulted(_cfg(), run_dir, Trigger("rollout", 1), signal_actor("RolloutWorker", signal.SIGKILL))
    found = [(t, line) for t, line in lines if line.startswith("recovery ")]
    assert len(found) == 1
    assert re.match(r"recovery 1 of at most 3: inference engine 0 died during rollout \(detected in [\d.]+ s\); "
                    r"inference engine 0 replaced in place \(weights from the trainers\)$", found[0][1])
    assert found[0][0] - inj.injection.at < 30
    assert _recoveries(run_dir) == [0, 1]
    assert same_run(reference, run_dir)


def test_disaggregated_a_killed_replica_is_refilled_and_a_killed_trainer_resumes_bit_exactly(reference, tmp_path):
    """The disaggregated placement at k = 0 (the colocated run bit for bit): SIGKILL of the rollout replica while it
    generates (before the first iteration's record is written: its first batch, or the next one, which the stream
    starts as soon as the update is out), then of the trainer while it trains iteration 1. The replica is replaced in
    place and filled point to point by the trainers, its groups generated again; the killed trainer takes the workers
    back to the last checkpoint. The run ends with the uninterrupted colocated run's weights and metrics, bit for bit:
    no sample lost, none trained twice. (Triggered at iteration 1's generation, the replica's fault raced the record:
    the stream may finish that batch before the record is written, and the trainer's fault came first.)"""
    run_dir = tmp_path / "run"
    cfg = _cfg({"cluster": {"placement": "disaggregated"}, "algorithm": {"max_staleness": 0}})
    replica = Injector(os.getpid(), run_dir, Trigger("rollout", 0), signal_actor("RolloutWorker", signal.SIGKILL))
    injectors = [replica, Injector(os.getpid(), run_dir, Trigger("train", 1),
                                   signal_actor("TrainerWorker", signal.SIGKILL), after=replica)]
    out = io.StringIO()
    for inj in injectors:
        inj.start()
    try:
        train(cfg, run_dir, console=Console(file=out, width=300))
    finally:
        for inj in injectors:
            inj.stop()
            inj.join(timeout=5)
    assert all(inj.error is None and inj.injection.at is not None for inj in injectors)
    found = [line for line in out.getvalue().splitlines() if line.startswith("recovery ")]
    assert len(found) == 2, "\n".join(found)
    assert re.match(r"recovery 1 of at most 3: inference engine 0 died during rollout .*replaced in place \(weights "
                    r"from the trainers\)$", found[0])
    assert re.match(r"recovery 2 of at most 3: trainer 0 died during train .*the workers restart from checkpoint "
                    r"iter_000000", found[1])
    assert same_run(reference, run_dir)


@pytest.mark.slow
def test_a_killed_lora_replica_is_replaced_from_the_base_and_the_adapters(ray_cluster, tmp_path):
    """LoRA, at sleep level 2: SIGKILL of the inference engine while it generates iteration 1's groups. A peer's
    weights are merged ones and the updates carry only the adapters, so the new engine reads the base from the
    checkpoint the run started from and the trainers send the adapters; the run ends bit for bit as an uninterrupted
    LoRA run, which it cannot without the base (its replica would serve zeros and the adapters only)."""
    lora = {"model": {"lora": {"rank": 4, "alpha": 8.0}}, "rollout": {"sleep_level": 2},
            "optimizer": {"lr": 2e-2}}
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    train(_cfg(lora), straight, console=Console(file=io.StringIO()))
    _, lines = _faulted(_cfg(lora), run_dir, Trigger("rollout", 1), signal_actor("RolloutWorker", signal.SIGKILL))
    found = [line for _, line in lines if line.startswith("recovery ")]
    assert len(found) == 1 and found[0].endswith(
        "inference engine 0 replaced in place (base from the checkpoint, adapters from the trainers)"), found
    assert _recoveries(run_dir) == [0, 1]
    assert same_run(straight, run_dir)


def test_a_stopped_inference_engine_is_found_within_the_step_timeout_and_replaced(reference, tmp_path):
    """SIGSTOP of the inference engine during a rollout (it never continues): the run does not wait on it past
    run.step_timeout_s, names it and the phase, replaces it and ends as the uninterrupted run does; the stopped
    process does not outlive the run."""
    run_dir = tmp_path / "run"
    stopped: list[int] = []

    def stop(root: int) -> str:
        target = signal_actor("RolloutWorker", signal.SIGSTOP)(root)
        stopped.append(int(target.split("pid ")[1].split()[0]))
        return target

    def unblock() -> None:  # a run that waits on the stopped engine forever must fail this test, not hang it
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    watchdog = threading.Timer(240, unblock)
    watchdog.start()
    try:
        inj, lines = _faulted(_cfg(step_timeout_s=10), run_dir, Trigger("rollout", 1), stop)
    finally:
        watchdog.cancel()
    found = [(t, line) for t, line in lines if line.startswith("recovery ")]
    assert len(found) == 1 and "inference engine 0 stalled (no answer in run.step_timeout_s=10 s) during rollout" \
        in found[0][1]
    assert 9 < found[0][0] - inj.injection.at < 40
    assert same_run(reference, run_dir)
    deadline = time.time() + 30  # Ray kills the stopped process a few seconds after ray.kill
    while psutil.pid_exists(stopped[0]) and psutil.Process(stopped[0]).status() != psutil.STATUS_ZOMBIE:
        assert time.time() < deadline, "the stopped engine outlived the run"
        time.sleep(0.5)


def test_a_killed_driver_is_run_again_and_goes_on_from_its_last_checkpoint_bit_exactly(reference, tmp_path, capsys):
    """`rl train CONFIG --run-dir D --auto-resume` killed with its whole process group (as a container restart
    does) while it trains iteration 1; the same command run again (here in this process, on the tests' Ray
    cluster) names the checkpoint it goes on from and ends with the uninterrupted run's weights and metrics, bit
    for bit."""
    config, run_dir = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(run_config(run={"iterations": ITERATIONS})))
    first = Run(config, run_dir, dict(os.environ))
    injector = Injector(first.proc.pid, run_dir, Trigger("train", 1), kill_group(first.proc))
    injector.start()
    assert first.wait(300) == -signal.SIGKILL
    injector.join(timeout=5)
    assert injector.error is None and injector.injection.at is not None
    assert not actors(first.proc.pid, "TrainerWorker")
    assert rl_main(["train", str(config), "--run-dir", str(run_dir), "--auto-resume"]) == 0
    assert re.search(r"resuming from iter_000000 \(after iteration 0\)", capsys.readouterr().out)
    assert same_run(reference, run_dir)


@pytest.fixture(scope="module")
def sandboxed_reference(ray_cluster, tmp_path_factory):
    """An uninterrupted run whose rewards are decided by programs in the run's own sandbox service."""
    register("sandboxed-arithmetic", SandboxedArithmeticEnv)  # what the suite installs as a plug-in
    out = tmp_path_factory.mktemp("sandboxed-reference")
    train(_cfg(SANDBOXED), out, console=Console(file=io.StringIO()))
    return out


@pytest.mark.serial  # its reward programs have a wall-clock limit: a loaded machine changes the run
def test_a_killed_sandbox_service_is_started_again_and_its_cut_off_commands_run_once_more(sandboxed_reference,
                                                                                         tmp_path):
    """SIGKILL of the run's own sandbox service while it runs iteration 1's reward programs: it is started again on
    the same port (one line), the commands it cut off are run once more (not counted as wrong answers, nor as
    environment errors), and the run ends with the uninterrupted run's weights and metrics, bit for bit."""
    from rl.rollout.episodes import sandbox_restarts

    run_dir, before = tmp_path / "run", sandbox_restarts()
    inj, _ = _faulted(_cfg(SANDBOXED), run_dir, Trigger("reward", 1), kill_sandbox_service)
    assert re.match(r"sandbox service pid \d+ \(SIGKILL, [1-9]\d* commands running\)$", inj.injection.target)
    assert sandbox_restarts() == before + 1
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["sandbox_restarts"] == before + 1 and records[1]["sandbox_retries"] >= 1
    assert all(r["env_errors"] == 0 for r in records)
    assert same_run(sandboxed_reference, run_dir)


def test_run_max_restarts_bounds_the_recoveries_and_the_next_fault_stops_the_run_in_one_line():
    """Each recovery is one line; the one past run.max_restarts stops the run (TrainingStopped: exit status 1)
    naming the fault and the limit."""
    from rl.errors import TrainingStopped
    from rl.loop.recovery import Restarts, WorkerFailed

    lines: list[str] = []
    restarts = Restarts(1, lines.append)
    fault = WorkerFailed("inference engine", 0, "rollout", "died", 0.04)
    restarts.take(fault, "inference engine 0 replaced in place")
    assert lines == ["recovery 1 of at most 1: inference engine 0 died during rollout (detected in 0.0 s); "
                     "inference engine 0 replaced in place"]
    with pytest.raises(TrainingStopped) as stop:
        restarts.take(WorkerFailed("trainer", 1, "train", "died", 0.5), "the workers restart")
    assert str(stop.value) == ("trainer 1 died during train (detected in 0.5 s), and 1 recoveries already "
                               "(run.max_restarts=1); the last complete checkpoint is intact")
    assert restarts.used == 1 and len(lines) == 1


def test_a_metrics_line_cut_short_by_a_full_disk_does_not_block_the_resume(tmp_path):
    """The disk filled while a record was appended (found by the suite's disk_full fault): the resumed run drops
    the partial line and keeps the records its checkpoint covers."""
    from rl.loop.metrics import MetricsLog

    whole = [{"iteration": 0, "reward_mean": 0.5}, {"iteration": 1, "reward_mean": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"iteration": 2, "rew')
    log = MetricsLog(tmp_path, Console(file=io.StringIO()), resume_at=2)
    assert log.records == whole
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [json.dumps(r) for r in whole]
