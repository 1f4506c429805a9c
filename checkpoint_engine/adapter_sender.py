"""A trainer rank's side of a LoRA run's weight updates: the adapters alone, the base staying with the replicas.

``update_sender`` is where a rank's update source is chosen: its model's ``ModelSender`` (every weight, this rank's
shards, planned to the replica's layout) or, for a model that trains adapters, an ``AdapterSender``: the adapters
gathered whole on every rank and sent by rank 0, cast to the replicas' dtype as a full update casts the master
weights (megabytes; each replica serves them on the base it keeps, ``checkpoint_engine.sinks.AdapterSink``).
"""

from __future__ import annotations

import torch
from torch import nn

from checkpoint_engine.model_sender import ModelSender, plan_adapter_update
from engines.model.lora.adapters import adapter_state


class AdapterSender:
    """The adapters of ``model`` (``engines.model.lora.adapters``) as one plan, sent whole."""

    carries_base = False

    def __init__(self, model: nn.Module, bucket_bytes: int, dtype: torch.dtype) -> None:
        self.model = model
        self.plan = plan_adapter_update(adapter_state(model), bucket_bytes, dtype)

    def check_filled(self, replicas: bool) -> None:
        """ValueError in one line unless the start-up read filled the replicas (``replicas``): these updates never
        carry the base."""
        if not replicas:
            raise ValueError("model.lora: the rollout engine must load the checkpoint as it is (rollout.dtype = the "
                             "checkpoint's dtype, no FP8): a LoRA run's updates carry the adapters, not the base")

    def send(self, ckpt, engine, version: int, reloader) -> None:
        """Deliver the adapters of ``engine`` (a ``TrainingEngine``), gathered whole while its tensors are in place.
        Collective."""
        with engine.onloaded():
            adapters = {n: t.reshape(-1) for n, t in adapter_state(engine.model, full=True).items()}
            ckpt.update(self.plan, adapters, version, reloader)


def update_sender(sender: ModelSender, bucket_bytes: int, dtype: torch.dtype) -> ModelSender | AdapterSender:
    """What this rank's updates send: ``sender``'s whole weights, or the adapters where its model trains them."""
    if getattr(sender.model, "lora", None) is None:
        return sender
    return AdapterSender(sender.model, bucket_bytes, dtype)
