"""The trainer's full state (master weights and optimizer state) in ``torch.distributed.checkpoint`` format.

Every rank writes the shards it holds into one directory (``__<rank>_0.distcp`` files and a
``.metadata`` index of which rows of which tensor each file holds), with no gather to rank 0. Loading
reads into whatever sharding the loading model has, so a checkpoint of N ranks resumes on M ranks
(or on one process, unsharded); with the same N every tensor comes back bit for bit.

After its shards are written (and fsynced, by ``dcp``), each rank records their sizes and SHA-256 beside them
(``__<rank>.sums.json``), hashing while the bytes are still in its page cache; ``collect_shard_sums`` then checks
that every shard the index names was written whole by a rank that finished, before the checkpoint is sealed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STATE_DIR = "trainer"
INDEX = ".metadata"  # dcp's index: which bytes of which shard file hold which tensor
SUMS = "__{rank}.sums.json"  # a rank's record of the shard files it wrote (consumed by collect_shard_sums)


class TrainerStateError(ValueError):
    """A trainer state directory that is not whole: a shard missing, cut short or different from what was written."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in large blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _states(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    # an optimizer without state gets it from a zero-gradient step at lr 0 (torch's own initialisation),
    # so that a resumed optimizer has the tensors the checkpoint is read into
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd}


def save_trainer_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], directory: str | Path) -> Path:
    """Write this rank's shards of the weights and optimizer state under ``directory/trainer``; collective."""
    path = Path(directory) / STATE_DIR
    dcp.save(_states(model, optimizers), checkpoint_id=str(path))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    written = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
               for p in sorted(path.glob(f"__{rank}_*.distcp"))}
    with open(path / SUMS.format(rank=rank), "w") as f:
        json.dump(written, f)
        f.flush()
        os.fsync(f.fileno())
    return path


def has_trainer_state(directory: str | Path) -> bool:
    return (Path(directory) / STATE_DIR / INDEX).is_file()


def collect_shard_sums(directory: str | Path) -> dict[str, dict]:
    """Check ``directory/trainer`` as every rank saved it and return ``{path under directory: {"bytes", "sha256"}}``
    for the index and each shard file (empty when there is no trainer state); the ranks' records are removed.
    ``TrainerStateError`` names a shard that the index needs and no rank finished writing, or one cut short."""
    path = Path(directory) / STATE_DIR
    if not path.is_dir():
        return {}
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # missing, or cut short: pickle's errors vary
        raise TrainerStateError(f"{STATE_DIR}/{INDEX} is unreadable ({type(e).__name__}: {e})") from None
    need: dict[str, int] = {}  # shard file -> the end of the last bytes the index points into
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    records = sorted(path.glob(SUMS.format(rank="*")))
    sums: dict[str, dict] = {}
    for record in records:
        sums.update(json.loads(record.read_text()))
    for name, end in sorted(need.items()):
        if name not in sums:
            raise TrainerStateError(f"{STATE_DIR}/{name} has no record of being written whole (the rank that "
                                    f"writes it did not finish; {len(records)} rank(s) did)")
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size != sums[name]["bytes"] or size < end:
            raise TrainerStateError(f"{STATE_DIR}/{name} is {'missing' if size is None else f'{size:,} bytes'}; "
                                    f"its rank wrote {sums[name]['bytes']:,} and the index needs {end:,}")
    for record in records:
        record.unlink()
    out = {f"{STATE_DIR}/{name}": s for name, s in sums.items()}
    out[f"{STATE_DIR}/{INDEX}"] = {"bytes": (path / INDEX).stat().st_size, "sha256": file_sha256(path / INDEX)}
    return out


def load_trainer_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], directory: str | Path) -> None:
    """Read what ``save_trainer_state`` wrote, into this rank's shards (any world size); collective.

    The model's tensors are filled in place, so views of them (offload buffers, weight-update plans) stay valid.
    """
    path = Path(directory) / STATE_DIR
    state = _states(model, optimizers)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
