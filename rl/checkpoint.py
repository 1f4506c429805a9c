"""Run checkpoints: weights (Hugging Face format), optimizer state, and loop state.

A checkpoint is written to a temporary directory and renamed into place, so a failure while
saving (or a failed iteration) never damages the last good checkpoint. The trainer state (master
weights, optimizer state) is in ``trainer/``, written by every rank (``engines.trainer_state``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rl.errors import UserError

STATE_FILE = "state.json"
#: what a saved model carries over from the starting directory: the tokenizer in every format transformers
#: writes (the chat template may be its own file) and the generation config (EOS lists, sampling defaults)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")


@dataclass
class LoopState:
    """What the loop needs besides weights to continue where it stopped."""

    iteration: int              # last completed iteration
    initial_accuracy: float
    wall_s: float               # time spent by earlier attempts
    weights_version: int = 0    # checkpoint-engine updates so far (tags partial-rollout segments)
    partial: dict[str, Any] = field(default_factory=dict)  # the partial-rollout buffer
    workers: int = 1            # trainer ranks that wrote the trainer state (any count may resume it)
    initial_accuracy_sampled: float | None = None


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / "checkpoints" / f"iter_{iteration:06d}"


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def save_checkpoint(run_dir: Path, state: LoopState, write_weights, tokenizer_dir: Path, keep: int) -> Path:
    """``write_weights(dir)`` writes model and optimizer; then state; then an atomic rename."""
    final = checkpoint_dir(run_dir, state.iteration)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_weights(str(tmp))
    copy_tokenizer(tokenizer_dir, tmp)
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith("iter_") and (p / STATE_FILE).is_file()
                  and not p.name.endswith(".tmp"))


def latest_checkpoint(run_dir: Path) -> tuple[Path, LoopState]:
    """The newest complete checkpoint of a run, or a clear error."""
    if not run_dir.is_dir():
        raise UserError(f"--resume: run directory {run_dir} does not exist")
    found = list_checkpoints(run_dir)
    if not found:
        raise UserError(f"--resume: {run_dir} has no complete checkpoint under checkpoints/")
    try:
        state = LoopState(**json.loads((found[-1] / STATE_FILE).read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise UserError(f"--resume: {found[-1] / STATE_FILE} is damaged: {e}") from None
    return found[-1], state
