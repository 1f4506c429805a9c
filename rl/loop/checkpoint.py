"""Run checkpoints: weights (Hugging Face format), optimizer state, and loop state.

A checkpoint is complete or absent. It is written into ``iter_N.tmp``; the trainer shards are checked (every
rank's, whole: ``engines.training.trainer_state.collect_shard_sums``); every file and directory is fsynced; the
directory is renamed into place and sealed last with ``complete.json`` (each file's size, the shards' SHA-256),
fsynced too. Only a sealed checkpoint is resumed from, after its files are checked against the seal; the one
before it is deleted only once the new one is sealed. So a crash or a full disk at any point of a save leaves the
last complete checkpoint as it was, and a run whose first save was cut short has none (``--auto-resume`` then
starts afresh). The trainer state (master weights, optimizer state) is in ``trainer/``, written by every rank; the
partial-rollout buffer's samples in ``partial.npz`` (their token data as arrays, ``rl.rollout.partial.save_state``),
which state.json names.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engines.training.trainer_state import TrainerStateError, collect_shard_sums, file_sha256
from rl.errors import CommandFailed, UserError
from rl.rollout.partial import load_state, save_state

STATE_FILE = "state.json"
PARTIAL_FILE = "partial.npz"  # the partial-rollout buffer's samples (token data as arrays), which state.json names
MARKER = "complete.json"  # the seal, written last: a checkpoint directory without it is not complete
LAYOUT = 2  # state.json's "layout" from the first sealed checkpoints on (older ones, without it, had no seal)
#: fault injection (tests, the fault suite): RL_CRASH_IN_SAVE=STAGE or STAGE@DIRNAME kills the process with SIGKILL
#: at that stage of a save: "filled" (all written into the .tmp directory) or "renamed" (in place, not yet sealed)
CRASH_ENV = "RL_CRASH_IN_SAVE"
_ITER = re.compile(r"^iter_(\d+)(\.tmp)?$")
#: what a saved model carries over from the starting directory: the tokenizer in every format transformers
#: writes (the chat template may be its own file), the generation config (EOS lists, sampling defaults) and a
#: vision-language model's processor (image processor settings, its own chat template)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json",
                   "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


@dataclass
class LoopState:
    """What the loop needs besides weights to continue where it stopped."""

    iteration: int              # last completed iteration
    initial_accuracy: float | None  # None: the run has no held-out metrics
    wall_s: float               # time spent by earlier attempts
    weights_version: int = 0    # checkpoint-engine updates so far (tags partial-rollout segments)
    partial: dict[str, Any] = field(default_factory=dict)  # the partial-rollout buffer (in state.json: its file)
    workers: int = 1            # trainer ranks that wrote the trainer state (any count may resume it)
    initial_accuracy_sampled: float | None = None
    rollbacks: int = 0          # collapses rolled back so far (rl.loop.health.CollapseGuard)
    best_accuracy: float | None = None  # the best held-out run.best_metric so far (what best/ holds)
    initial_eval_reward: float | None = None
    layout: int = 1             # how the checkpoint was written: LAYOUT when sealed with complete.json


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / "checkpoints" / f"iter_{iteration:06d}"


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


class SaveFailed(CommandFailed):
    """A checkpoint could not be written (a full or failing disk); the last complete one is untouched."""


#: free bytes below which a failed write is taken for a full disk, whatever the writer said (torch's zip writer says
#: "[enforce fail at inline_container.cc] unexpected pos", nothing about space)
FULL_BYTES = 1 << 20


def _disk_full(err: BaseException, free: int) -> bool:
    """Whether ``err`` (possibly raised in a worker and passed on by Ray) is a full disk or quota, the file system
    having ``free`` bytes left when it was raised."""
    chain = [err, err.__cause__, getattr(err, "cause", None)]
    return any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in chain if e is not None) or \
        "No space left on device" in str(err) or "Disk quota exceeded" in str(err) or free < FULL_BYTES


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 where it is not a directory)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _crash_point(stage: str, final: Path) -> None:
    if os.environ.get(CRASH_ENV) in (stage, f"{stage}@{final.name}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # a file system that cannot sync a directory (some network ones) syncs it on its own
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file under ``root`` on stable storage, then every directory (the names in it)."""
    dirs = [root]
    for p in root.rglob("*"):
        if p.is_dir():
            dirs.append(p)
        else:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        _fsync_dir(d)


def _inventory(root: Path) -> dict[str, dict]:
    """What the seal records: every file's size, and the SHA-256 of each trainer shard (its rank's own, checked
    against the index: a shard missing or cut short raises ``TrainerStateError``)."""
    sums = collect_shard_sums(root)
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size}
             for p in sorted(root.rglob("*")) if p.is_file()}
    return {**files, **sums}


def _seal(final: Path, files: dict[str, dict]) -> None:
    with open(final / MARKER, "w") as f:
        json.dump({"layout": LAYOUT, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(final)


def write_aside(final: Path, fill: Callable[[Path], None], noun: str, kept: Path | None, kept_as: str,
                resume: str, need: int | None = None) -> Path:
    """Fill directory ``final`` (a ``noun``) by ``fill(tmp)`` beside it, check its trainer shards, fsync it, rename
    it into place (a directory already there is swapped out and removed once the new one is sealed) and seal it
    (``complete.json``, last). A failure removes what it wrote and raises ``SaveFailed`` in one line: why, about
    how many bytes one takes (``kept``'s, the copy still in place, described as ``kept_as``; else ``need``, the
    estimate; ``resume`` says how to use it), and what is free."""
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    placed = False
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        fill(tmp)
        files = _inventory(tmp)
        _crash_point("filled", final)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        placed = True
        _fsync_dir(final.parent)
        _crash_point("renamed", final)
        _seal(final, files)
    except Exception as e:
        full = _disk_full(e, shutil.disk_usage(final.parent).free if final.parent.exists() else 0)
        written = tree_bytes(final if placed else tmp)
        shutil.rmtree(final if placed else tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            old.rename(final)
        if not isinstance(e, (OSError, TrainerStateError)) and not full:
            raise
        last = f"{kept_as}, {kept}, is intact{resume}" if kept else f"no earlier {noun} exists"
        need = tree_bytes(kept) if kept else need or 0
        size = f"a {noun} takes about {need:,} bytes" if need else f"{written:,} bytes written before it failed"
        why = "no space left on the device" if full else f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        free = shutil.disk_usage(final.parent).free if final.parent.exists() else 0
        raise SaveFailed(f"saving {noun} {final} failed: {why} ({size}, {free:,} free); {last}") from None
    shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(run_dir: Path, state: LoopState, write_weights, tokenizer_dir: Path, keep: int,
                    need: int | None = None) -> Path:
    """``write_weights(dir)`` writes model and optimizer; then state; then ``write_aside`` checks, fsyncs, renames
    and seals it. Older checkpoints beyond ``keep`` are deleted only after that. A save that fails removes what it
    wrote and raises ``SaveFailed`` in one line (the bytes a checkpoint needs: the last one's, else ``need``, the
    estimate; the last one kept)."""
    def fill(tmp: Path) -> None:
        write_weights(str(tmp))
        copy_tokenizer(tokenizer_dir, tmp)
        partial = state.partial
        if "arrays" in partial:  # its token data in a binary file of its own, sealed with the rest
            save_state(partial, tmp / PARTIAL_FILE)
            partial = {"file": PARTIAL_FILE}
        (tmp / STATE_FILE).write_text(json.dumps({**asdict(replace(state, partial={})), "partial": partial,
                                                  "layout": LAYOUT}, indent=2))

    previous = list_checkpoints(run_dir)
    final = write_aside(checkpoint_dir(run_dir, state.iteration), fill, "checkpoint",
                        previous[-1] if previous else None, "the last checkpoint", f" (--resume {run_dir})", need)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(path: Path) -> bool:
    """Sealed; or written before checkpoints were sealed (those were renamed into place whole)."""
    if (path / MARKER).is_file():
        return True
    try:
        return json.loads((path / STATE_FILE).read_text()).get("layout", 1) < LAYOUT
    except (OSError, ValueError, AttributeError):
        return False


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    """``iter_*`` directories (``.tmp`` ones too), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m[1]), bool(m[2]), p) for p in root.iterdir() if p.is_dir() and (m := _ITER.match(p.name))]
    return [p for *_, p in sorted(found)]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in _checkpoint_dirs(run_dir) if not p.name.endswith(".tmp") and _complete(p)]


def incomplete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories whose save did not finish (``.tmp``, or renamed and never sealed), oldest first."""
    return [p for p in _checkpoint_dirs(run_dir) if p.name.endswith(".tmp") or not _complete(p)]


def remove_stale(run_dir: Path, incomplete: bool = False) -> list[str]:
    """Remove what saves that did not finish left: ``.tmp`` directories (of checkpoints and of ``best/``), and with
    ``incomplete`` also checkpoints renamed into place but never sealed; a ``best/`` swapped out by a save cut short
    is put back. Returns the names removed."""
    removed = []
    for p in [*incomplete_checkpoints(run_dir), run_dir / "best.tmp"]:
        if p.is_dir() and (incomplete or p.name.endswith(".tmp")):
            shutil.rmtree(p)
            removed.append(p.name)
    for old in [run_dir / "best.old", *(run_dir / "checkpoints").glob("iter_*.old")]:
        final = old.with_name(old.name.removesuffix(".old"))
        if old.is_dir() and not final.exists():
            old.rename(final)
        elif old.is_dir():
            shutil.rmtree(old)
            removed.append(old.name)
    return removed


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


def _seal_problem(path: Path) -> str | None:
    """How the files differ from what the seal recorded (missing, another size, another SHA-256), or None."""
    try:
        files = json.loads((path / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its seal {MARKER} is unreadable ({e})"
    for name, rec in files.items():
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size != rec["bytes"]:
            return f"{name} is {'missing' if size is None else f'{size:,} bytes'} ({rec['bytes']:,} were saved)"
    hashed = [name for name, rec in files.items() if "sha256" in rec]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib reads and hashes without the GIL
        for name, digest in zip(hashed, pool.map(lambda n: file_sha256(path / n), hashed), strict=True):
            if digest != files[name]["sha256"]:
                return f"{name} differs from what was saved (SHA-256)"
    return None


def checkpoint_problem(path: Path) -> str | None:
    """What makes a checkpoint directory unusable for a resume (a damaged file), or None when it looks intact."""
    try:
        state = LoopState(**json.loads((path / STATE_FILE).read_text()))
        json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, TypeError) as e:
        return f"its state or config file is damaged ({e})"
    partial = state.partial.get("file")
    if partial is not None:
        try:
            if not isinstance(partial, str) or Path(partial).name != partial:
                raise ValueError(f"state.json names {partial!r}")
            load_state(path / partial)  # read whole: the zip's CRCs find a changed byte
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            return f"its partial-rollout state is damaged ({e})"
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
    return _seal_problem(path) if (path / MARKER).is_file() else None


def latest_checkpoint(run_dir: Path, report: Callable[[str], Any] | None = None) -> tuple[Path, LoopState]:
    """The newest complete, intact checkpoint of a run, which ``report(message)`` names; newer ones whose save
    did not finish, or that are damaged, are skipped in one line before it."""
    if not run_dir.is_dir():
        raise UserError(f"--resume: run directory {run_dir} does not exist")
    found, unfinished = list_checkpoints(run_dir), incomplete_checkpoints(run_dir)
    if not found:
        cut = f" ({', '.join(p.name for p in unfinished)}: a save that did not finish)" if unfinished else ""
        raise UserError(f"--resume: {run_dir} has no complete checkpoint under checkpoints/{cut}; rl train CONFIG "
                        f"--run-dir {run_dir} --auto-resume starts it afresh")
    damaged = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            newer = [p.name for p in unfinished if _iteration(p) >= _iteration(path)]
            skipped = ([f"incomplete checkpoint(s) {', '.join(newer)} (a save that did not finish)"] if newer
                       else []) + ([f"damaged checkpoint(s) {'; '.join(damaged)}"] if damaged else [])
            if report is not None and skipped:
                report(f"skipped {'; '.join(skipped)}")
            state = LoopState(**json.loads((path / STATE_FILE).read_text()))
            state.partial = read_partial(path, state.partial)
            if report is not None:
                report(f"resuming from {path.name} (after iteration {state.iteration}) in {path.parent}")
            return path, state
        damaged.append(f"{path.name} ({problem})")
    raise UserError(f"--resume: every checkpoint of {run_dir} is damaged: {'; '.join(damaged)}")


def read_partial(path: Path, partial: dict[str, Any]) -> dict[str, Any]:
    """The partial-rollout state that checkpoint ``path``'s state.json holds as ``partial``: read from the file it
    names, or as it is (written before the binary file: JSON, which ``PartialRolloutBuffer`` still loads)."""
    return load_state(path / partial["file"]) if "file" in partial else partial


def _iteration(path: Path) -> int:
    return int(_ITER.match(path.name)[1])
