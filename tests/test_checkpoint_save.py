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
