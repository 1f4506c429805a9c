"""The training engine: recomputes log-probabilities with gradients and steps the optimizers.

It owns the trainable model and its optimizers; the RL algorithm (``rl.algorithm``) decides what
loss to build from the log-probabilities it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.model import CausalLM, padded_causal_mask, positions_from_valid
from engines.sampling import token_logprobs


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """Right-pad prompt+response pairs: (ids [B, T], valid [B, T], target mask [B, T-1]).

    ``target[b, t]`` is True where token t+1 of row b is a response token, i.e. where the
    logits at t predict a response token.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    b, width = len(lengths), max(lengths)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    target = torch.zeros(b, width - 1, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : lengths[i]] = torch.tensor(list(p) + list(r))
        valid[i, : lengths[i]] = True
        target[i, len(p) - 1 : lengths[i] - 1] = True
    return ids, valid, target


class TrainingEngine:
    """Model plus optimizers, with log-probability recompute and a clipped optimizer step."""

    def __init__(self, model: CausalLM, optimizers: list[torch.optim.Optimizer], pad_id: int,
                 max_grad_norm: float = 1.0) -> None:
        self.model = model.train()
        self.optimizers = optimizers
        self.pad_id = pad_id
        self.max_grad_norm = max_grad_norm

    def response_logprobs(self, prompts, responses, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the response tokens [B, T-1] (zero elsewhere) and their mask.

        Differentiable; the caller decides whether to wrap it in ``torch.no_grad``.
        """
        ids, valid, target = pack(prompts, responses, self.pad_id)
        logits = self.model(ids, positions_from_valid(valid), padded_causal_mask(valid))[:, :-1]
        lp = token_logprobs(logits, temperature).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return lp * target, target

    def step(self) -> float:
        """Clip gradients, step every optimizer, zero gradients; returns the pre-clip grad norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(norm)

    def state_dict(self) -> dict:
        """Optimizer states (the weights are saved separately, in Hugging Face format)."""
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)
