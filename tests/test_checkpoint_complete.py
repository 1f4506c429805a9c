"""A checkpoint is complete or absent: a process killed (SIGKILL) at any point of a save leaves the last complete
checkpoint as it was and loadable, and what the cut-short save left is never resumed from. The kills are real: a
child process saves a real model's weights and trainer state and is killed while writing its files, after writing
them (all in ``iter_N.tmp``), or after renaming the directory into place but before sealing it
(``RL_CRASH_IN_SAVE``, the save's fault-injection point, makes the kill land there every time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.inference.sampling import SamplingParams
from engines.model.native.causal_lm import CausalLM
from engines.training.optim import build_optimizers
from engines.training.trainer_state import load_trainer_state, save_trainer_state
from rl.algo.schedules import Schedule
from rl.errors import UserError
from rl.loop.checkpoint import (
    CRASH_ENV,
    MARKER,
    LoopState,
    SaveFailed,
    checkpoint_problem,
    latest_checkpoint,
    list_checkpoints,
    remove_stale,
    save_checkpoint,
)
from rl.rollout.partial import PartialRolloutBuffer
from rl.sample import Sample, TaskType, TurnResult
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]

# The child: a tiny model and its optimizer, a step, a checkpoint (keep=1: the save after it deletes it once that
# one is complete), another step and a second checkpoint. ``writing`` kills it between the weights and the trainer
# state of the checkpoint named by CRASH_AT; RL_CRASH_IN_SAVE kills it inside save_checkpoint.
CHILD = """
import json, os, signal, sys
from pathlib import Path
import torch
from engines.model.io.hf_io import save_pretrained
from engines.training.trainer_state import save_trainer_state
from rl.loop.checkpoint import LoopState, save_checkpoint
from tests.test_checkpoint_complete import build, step

run, tok, crash_at = Path(sys.argv[1]), Path(sys.argv[2]), os.environ.get("CRASH_AT")
model, opts = build()

def write(d):
    save_pretrained(model, None, d)
    if Path(d).name == f"{crash_at}.tmp":
        os.kill(os.getpid(), signal.SIGKILL)  # the weights are written, the trainer state is not
    save_trainer_state(model, opts, d)

for it in range(2):
    step(model, opts, seed=it)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, run.parent / f"weights_{it}.pt")
    save_checkpoint(run, LoopState(it, 0.5, float(it)), write, tok, keep=1)
"""


def build() -> tuple[CausalLM, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = CausalLM(tiny_config(37))
    return model, build_optimizers(model, "adamw", 1e-2, 0.0)


def step(model: CausalLM, opts: list[torch.optim.Optimizer], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():  # a gradient of known values: the step gives the optimizer its state
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _run_child(tmp_path: Path, env: dict[str, str]) -> tuple[Path, subprocess.CompletedProcess]:
    run, tok = tmp_path / "run", tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), str(tok)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    return run, proc


def _loads_as_saved(ckpt: Path, weights: Path) -> None:
    """The trainer state of ``ckpt`` loads into a fresh model and gives back the weights the child had saved."""
    model, opts = build()
    step(model, opts, seed=99)  # other values, and optimizer state to be overwritten
    load_trainer_state(model, opts, ckpt)
    want = torch.load(weights)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize(("kill", "left"), [({"CRASH_AT": "iter_000001"}, "iter_000001.tmp"),
                                            ({CRASH_ENV: "filled@iter_000001"}, "iter_000001.tmp"),
                                            ({CRASH_ENV: "renamed@iter_000001"}, "iter_000001")],
                         ids=["while-writing", "all-written", "renamed-not-sealed"])
def test_a_save_killed_at_any_point_leaves_the_last_checkpoint_whole(tmp_path, kill, left):
    run, proc = _run_child(tmp_path, kill)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    first = run / "checkpoints" / "iter_000000"
    assert (run / "checkpoints" / left).is_dir() and not (run / "checkpoints" / left / MARKER).exists()
    # keep=1, yet the first checkpoint is still there: it is deleted only once the next one is complete
    assert list_checkpoints(run) == [first]
    said: list[str] = []
    path, state = latest_checkpoint(run, report=said.append)
    assert path == first and state.iteration == 0
    assert said == [f"skipped incomplete checkpoint(s) {left} (a save that did not finish)",
                    f"resuming from iter_000000 (after iteration 0) in {run / 'checkpoints'}"]
    _loads_as_saved(first, tmp_path / "weights_0.pt")
    assert remove_stale(run) == ([left] if left.endswith(".tmp") else [])  # what a resume removes at start
    assert remove_stale(run, incomplete=True) == ([] if left.endswith(".tmp") else [left])


def test_a_first_save_killed_after_its_rename_leaves_no_checkpoint_to_resume(tmp_path):
    """Renamed into place but not sealed: it is not complete, even though every file is there."""
    run, proc = _run_child(tmp_path, {CRASH_ENV: "renamed@iter_000000"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    cut = run / "checkpoints" / "iter_000000"
    assert (cut / "trainer" / ".metadata").is_file() and (cut / "state.json").is_file()
    assert list_checkpoints(run) == []
    with pytest.raises(UserError, match=r"has no complete checkpoint under checkpoints/ \(iter_000000: a save that "
                                        r"did not finish\); rl train CONFIG --run-dir .* --auto-resume starts it"):
        latest_checkpoint(run)


def _real_checkpoint(tmp_path: Path, it: int, shard_hook=None, partial: dict | None = None):
    """A save of a real model through save_checkpoint, with the partial-rollout state ``partial``;
    ``shard_hook(trainer_dir)`` runs after the trainer state is written (what a failing disk or a lost shard would
    do)."""
    model, opts = build()
    step(model, opts, seed=it)
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)

    def write(d: str) -> None:
        from engines.model.io.hf_io import save_pretrained

        save_pretrained(model, None, d)
        save_trainer_state(model, opts, d)
        if shard_hook:
            shard_hook(Path(d) / "trainer")

    return save_checkpoint(tmp_path / "run", LoopState(it, 0.5, 1.0, partial=partial or {}), write, tok, keep=2)


def test_the_seal_records_every_file_and_a_damaged_shard_is_never_resumed_from(tmp_path):
    first, second = _real_checkpoint(tmp_path, 0), _real_checkpoint(tmp_path, 1)
    seal = json.loads((second / MARKER).read_text())
    on_disk = {p.relative_to(second).as_posix(): p.stat().st_size for p in second.rglob("*")
               if p.is_file() and p.name != MARKER}
    assert {k: v["bytes"] for k, v in seal["files"].items()} == on_disk
    assert {k for k, v in seal["files"].items() if "sha256" in v} == {"trainer/.metadata", "trainer/__0_0.distcp"}
    shard = second / "trainer" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(data))
    said: list[str] = []
    assert latest_checkpoint(tmp_path / "run", report=said.append)[0] == first
    assert said[0] == "skipped damaged checkpoint(s) iter_000001 (trainer/__0_0.distcp differs from what was saved " \
                      "(SHA-256))"
    shard.write_bytes(bytes(data[:100]))
    assert latest_checkpoint(tmp_path / "run", report=said.append)[0] == first
    assert f"iter_000001 (trainer/__0_0.distcp is 100 bytes ({len(data):,} were saved))" in said[-2]


def test_a_shard_lost_during_the_save_fails_it_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    first = _real_checkpoint(tmp_path, 0)
    with pytest.raises(SaveFailed) as err:
        _real_checkpoint(tmp_path, 1, shard_hook=lambda d: (d / "__0_0.distcp").unlink())
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"saving checkpoint {tmp_path / 'run/checkpoints/iter_000001'} failed: "
                                              "TrainerStateError: trainer/__0_0.distcp is missing")
    assert msg.endswith(f"the last checkpoint, {first}, is intact (--resume {tmp_path / 'run'})")
    assert list_checkpoints(tmp_path / "run") == [first]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["iter_000000"]


def test_every_file_and_directory_is_on_disk_before_the_rename_and_the_seal_after(tmp_path, monkeypatch):
    """The order of the syscalls, watched (they still run): fsync of each file and directory of the .tmp tree, the
    rename, then the seal and its directory."""
    events: list[str] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd: int) -> None:
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rename(self: Path, target: Path) -> Path:
        events.append(f"rename {self} {target}")
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    final = _real_checkpoint(tmp_path, 0)
    tmp = f"{final}.tmp"
    at = events.index(f"rename {tmp} {final}")
    before = {e.removeprefix("fsync ") for e in events[:at]}
    written = {str(p).replace(str(final), tmp) for p in final.rglob("*") if p.name != MARKER}
    assert written | {tmp} <= before
    assert events[at + 1:] == [f"fsync {final.parent}", f"fsync {final / MARKER}", f"fsync {final}"]


def test_a_checkpoint_written_before_seals_existed_still_resumes(tmp_path):
    """Older checkpoints have no complete.json and no "layout" in state.json: they were renamed into place whole,
    so they count as complete; one of this layout without its seal does not."""
    older = _real_checkpoint(tmp_path, 0)
    (older / MARKER).unlink()
    state = json.loads((older / "state.json").read_text())
    (older / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "layout"}))
    newer = _real_checkpoint(tmp_path, 1)
    (newer / MARKER).unlink()
    assert list_checkpoints(tmp_path / "run") == [older]
    said: list[str] = []
    assert latest_checkpoint(tmp_path / "run", report=said.append)[0] == older
    assert said[0] == "skipped incomplete checkpoint(s) iter_000001 (a save that did not finish)"


def _buffer() -> PartialRolloutBuffer:
    """A buffer holding a paused sample (two segments) and its group's finished one."""
    kind = TaskType("text", 8, 0.0, Schedule("constant", 1.0, 1.0, 1))
    buf = PartialRolloutBuffer(max_age=2)
    samples = [Sample(k, 0, 3, kind, [5, 6, 7], SamplingParams(1.0, 8, seed=k), 0) for k in (0, 1)]
    buf.add_group(samples)
    buf.pending(0)
    buf.record([TurnResult(0, [8, 9], [-0.1, -2 / 3], None, None, 0), TurnResult(1, [4], [-0.3], "stop", None, 0)])
    buf.pending(1)
    buf.record([TurnResult(0, [10], [-1e-7], None, None, 1)])
    return buf


def test_the_partial_rollout_buffer_is_a_sealed_binary_file_of_the_checkpoint(tmp_path):
    buf = _buffer()
    first = _real_checkpoint(tmp_path, 0, partial=buf.state_dict())
    state_json = json.loads((first / "state.json").read_text())
    assert state_json["partial"] == {"file": "partial.npz"}  # no token data in the JSON
    assert "partial.npz" in json.loads((first / MARKER).read_text())["files"]
    path, state = latest_checkpoint(tmp_path / "run")
    back = PartialRolloutBuffer(max_age=0)
    back.load_state_dict(state.partial)
    assert path == first and back.max_age == 2 and [back.get(k) for k in (0, 1)] == [buf.get(k) for k in (0, 1)]
    assert back.get(0).logprobs.tobytes() == buf.get(0).logprobs.tobytes()
    assert back.get(0).segments.tolist() == [[0, 0], [2, 1]] and back.stats() == buf.stats()

    # a damaged file is never resumed from: one cut short, one with a byte changed
    second = _real_checkpoint(tmp_path, 1, partial=buf.state_dict())
    data = (second / "partial.npz").read_bytes()
    for damaged in (data[:-10], data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]):
        (second / "partial.npz").write_bytes(damaged)
        said: list[str] = []
        assert latest_checkpoint(tmp_path / "run", report=said.append)[0] == first
        assert said[0].startswith("skipped damaged checkpoint(s) iter_000001 (its partial-rollout state is damaged")
        assert checkpoint_problem(second).startswith("its partial-rollout state is damaged")


def test_a_checkpoint_with_the_earlier_json_partial_state_still_resumes(tmp_path):
    """Before the binary file, state.json held the buffer itself (each sample's lists, ``Sample.to_dict``)."""
    buf = _buffer()
    old = {"max_age": 2, "iteration": 1, "counts": {"resumed": 1, "dropped": 0},
           "groups": [[buf.get(0).to_dict(), buf.get(1).to_dict()]]}
    first = _real_checkpoint(tmp_path, 0, partial=json.loads(json.dumps(old)))
    assert not (first / "partial.npz").exists()
    back = PartialRolloutBuffer(max_age=0)
    back.load_state_dict(latest_checkpoint(tmp_path / "run")[1].partial)
    assert [back.get(k) for k in (0, 1)] == [buf.get(k) for k in (0, 1)]
