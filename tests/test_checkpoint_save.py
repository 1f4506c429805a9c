"""A checkpoint save that meets a full disk: one line naming the path and the bytes, the last checkpoint whole
and loadable, nothing half-written left behind. The disk is a real 4 MiB tmpfs (mounting needs root)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl.cli import main as rl_main
from rl.loop.checkpoint import LoopState, SaveFailed, latest_checkpoint, list_checkpoints, save_checkpoint


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _weights(mib: float):
    """What a trainer writes into a checkpoint: a Hugging Face config, the weights, the optimizer state."""
    def write(d: str) -> None:
        Path(d, "config.json").write_text('{"model_type": "llama"}')
        save_file({"w": torch.arange(int(mib * 2**18), dtype=torch.float32)}, f"{d}/model.safetensors")
        torch.save({"exp_avg": torch.ones(2**16)}, f"{d}/optimizer.pt")
    return write


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_says_so_in_one_line(small_disk, tmp_path):
    run, tok = small_disk / "run", tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    first = save_checkpoint(run, LoopState(0, 0.25, 1.0), _weights(1), tok, keep=3)
    before = load_file(first / "model.safetensors")["w"]
    with pytest.raises(SaveFailed) as err:
        save_checkpoint(run, LoopState(1, 0.25, 2.0), _weights(6), tok, keep=3)  # 6 MiB on a 4 MiB disk
    msg = str(err.value)
    assert "\n" not in msg and "iter_000001" in msg and "no space left on the device" in msg
    assert f"a checkpoint takes about {sum(f.stat().st_size for f in first.rglob('*')):,} bytes" in msg
    assert f"the last checkpoint, {first}, is intact (--resume {run})" in msg
    assert list_checkpoints(run) == [first] and not (run / "checkpoints" / "iter_000001.tmp").exists()
    path, state = latest_checkpoint(run)
    assert path == first and state.iteration == 0
    assert torch.equal(load_file(first / "model.safetensors")["w"], before)
    again = save_checkpoint(run, LoopState(1, 0.25, 2.0), _weights(1), tok, keep=3)  # space back: it saves
    assert list_checkpoints(run) == [first, again]


def test_a_save_failure_reaches_the_command_line_as_one_line_with_exit_status_1(monkeypatch, capsys, tmp_path):
    def full(*a, **k):
        raise SaveFailed("saving checkpoint X failed: no space left on the device (...)")

    monkeypatch.setattr("rl.loop.controller.train", full)  # the run itself: the failure it ends with
    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    status = rl_main(["train", str(config), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and err[-1].startswith("error: saving checkpoint X failed: no space left")


def test_a_runs_first_save_onto_a_full_disk_is_one_line_naming_the_run_and_the_space(ray_cluster, tmp_path, capsys):
    """A real run whose run directory is a 256 KiB tmpfs: its config and metrics fit, its first checkpoint does
    not. The run ends with one line naming the checkpoint in the run directory and the space a checkpoint takes (the
    estimate, as no earlier checkpoint exists), and leaves nothing half-written. torch's zip writer reports such a
    write as "unexpected pos", nothing about space: the free space at the failure says it."""
    import json

    import yaml

    from rl.cli import main as rl_main
    from tests.test_run import TINY

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        config = tmp_path / "tiny.yaml"
        config.write_text(yaml.safe_dump(json.loads(json.dumps(TINY))))
        run = disk / "run"
        sets = ["run.collapse_guard=false", "run.iterations=1", "run.save_every=1", "run.eval_samples=0",
                "env.num_eval=8"]
        code = rl_main(["train", str(config), "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]])
        stderr = capsys.readouterr().err
        err = stderr.strip().splitlines()
        assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert err[-1].startswith(f"error: saving checkpoint {run}/checkpoints/iter_000000 failed: no space left on "
                                  "the device (a checkpoint takes about "), err[-1]
        assert "no earlier checkpoint exists" in err[-1]
        assert not (run / "checkpoints" / "iter_000000.tmp").exists() and list_checkpoints(run) == []
        assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
