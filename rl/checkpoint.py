"""Run checkpoints: weights (Hugging Face format), optimizer state, and loop state.

A checkpoint is written to a temporary directory and renamed into place, so a failure while
saving (or a failed iteration) never damages the last good checkpoint. The trainer state (master
weights, optimizer state) is in ``trainer/``, written by every rank (``engines.training.trainer_state``).
"""

from __future__ import annotations

import errno
import json
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rl.errors import CommandFailed, UserError

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
    rollbacks: int = 0          # collapses rolled back so far (rl.health.CollapseGuard)
    best_accuracy: float | None = None  # the best held-out accuracy so far (what best/ holds)


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / "checkpoints" / f"iter_{iteration:06d}"


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


class SaveFailed(CommandFailed):
    """A checkpoint could not be written (a full or failing disk); the last complete one is untouched."""


def _disk_full(err: BaseException) -> bool:
    """Whether ``err`` (possibly raised in a worker and passed on by Ray) is a full disk or quota."""
    chain = [err, err.__cause__, getattr(err, "cause", None)]
    return any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in chain if e is not None) or \
        "No space left on device" in str(err) or "Disk quota exceeded" in str(err)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def write_aside(final: Path, fill: Callable[[Path], None], noun: str, kept: Path | None, kept_as: str,
                resume: str) -> Path:
    """Fill directory ``final`` (a ``noun``) by ``fill(tmp)`` beside it, then rename it into place. A fill that
    fails removes what it wrote and raises ``SaveFailed`` in one line: why, about how many bytes ``kept`` (the
    copy still in place, described as ``kept_as``; ``resume`` says how to use it) takes, and what is free."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        fill(tmp)
    except Exception as e:
        written = _tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError) and not _disk_full(e):
            raise
        last = f"{kept_as}, {kept}, is intact{resume}" if kept else f"no earlier {noun} exists"
        need = _tree_bytes(kept) if kept else 0
        size = f"a {noun} takes about {need:,} bytes" if need else f"{written:,} bytes written before it failed"
        why = "no space left on the device" if _disk_full(e) else \
            f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        free = shutil.disk_usage(final.parent).free if final.parent.exists() else 0
        raise SaveFailed(f"saving {noun} {final} failed: {why} ({size}, {free:,} free); {last}") from None
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def save_checkpoint(run_dir: Path, state: LoopState, write_weights, tokenizer_dir: Path, keep: int) -> Path:
    """``write_weights(dir)`` writes model and optimizer; then state; then an atomic rename. A save that fails
    removes what it wrote and raises ``SaveFailed`` in one line (the bytes a checkpoint needs, the last one kept)."""
    def fill(tmp: Path) -> None:
        write_weights(str(tmp))
        copy_tokenizer(tokenizer_dir, tmp)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))

    previous = list_checkpoints(run_dir)
    final = write_aside(checkpoint_dir(run_dir, state.iteration), fill, "checkpoint",
                        previous[-1] if previous else None, "the last checkpoint", f" (--resume {run_dir})")
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


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is unreadable (bad header, cut short), or None."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return f"{path.name} has no valid header"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} is unreadable ({e})"
    return f"{path.name} is cut short ({size} of {8 + n + end} bytes)" if 8 + n + end > size else None


def checkpoint_problem(path: Path) -> str | None:
    """What makes a checkpoint directory unusable for a resume (a damaged file), or None when it looks intact."""
    try:
        LoopState(**json.loads((path / STATE_FILE).read_text()))
        json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, TypeError) as e:
        return f"its state or config file is damaged ({e})"
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        return "it holds no weights (*.safetensors)"
    for w in weights:
        problem = _safetensors_problem(w)
        if problem:
            return problem
    optimizer = path / "optimizer.pt"
    if optimizer.exists():
        try:
            with zipfile.ZipFile(optimizer) as z:  # torch.save's format: a zip whose directory sits at the end
                z.namelist()
        except (OSError, zipfile.BadZipFile) as e:
            return f"optimizer.pt is damaged ({e})"
    return None


def latest_checkpoint(run_dir: Path, report=None) -> tuple[Path, LoopState]:
    """The newest intact checkpoint of a run; a damaged newer one is skipped and ``report(message)`` says so."""
    if not run_dir.is_dir():
        raise UserError(f"--resume: run directory {run_dir} does not exist")
    found = list_checkpoints(run_dir)
    if not found:
        raise UserError(f"--resume: {run_dir} has no complete checkpoint under checkpoints/")
    damaged = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            if damaged and report is not None:
                report(f"--resume: skipped damaged checkpoint(s) {'; '.join(damaged)}; resuming from {path.name}")
            return path, LoopState(**json.loads((path / STATE_FILE).read_text()))
        damaged.append(f"{path.name} ({problem})")
    raise UserError(f"--resume: every checkpoint of {run_dir} is damaged: {'; '.join(damaged)}")
