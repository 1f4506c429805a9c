"""The trainer's full state (master weights and optimizer state) in ``torch.distributed.checkpoint`` format.

Every rank writes the shards it holds into one directory (``__<rank>_0.distcp`` files and a
``.metadata`` index of which rows of which tensor each file holds), with no gather to rank 0. Loading
reads into whatever sharding the loading model has, so a checkpoint of N ranks resumes on M ranks
(or on one process, unsharded); with the same N every tensor comes back bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STATE_DIR = "trainer"


def _states(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    # an optimizer without state gets it from a zero-gradient step at lr 0 (torch's own initialisation),
    # so that a resumed optimizer has the tensors the checkpoint is read into
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd}


def save_trainer_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], directory: str | Path) -> Path:
    """Write this rank's shards of the weights and optimizer state under ``directory/trainer``; collective."""
    path = Path(directory) / STATE_DIR
    dcp.save(_states(model, optimizers), checkpoint_id=str(path))
    return path


def has_trainer_state(directory: str | Path) -> bool:
    return (Path(directory) / STATE_DIR / ".metadata").is_file()


def load_trainer_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], directory: str | Path) -> None:
    """Read what ``save_trainer_state`` wrote, into this rank's shards (any world size); collective.

    The model's tensors are filled in place, so views of them (offload buffers, weight-update plans) stay valid.
    """
    path = Path(directory) / STATE_DIR
    state = _states(model, optimizers)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
