"""The native inference engine: batched generation with a preallocated KV cache.

It returns, per prompt, the sampled token ids, their log-probabilities under the sampling
temperature (the π_old of the K1.5 objective) and why generation stopped. Weights are replaced in
place by the checkpoint engine (``named_tensors``), never by handing over a Python object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.model import CausalLM, KVCache, padded_causal_mask, positions_from_valid


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature 0 means greedy; ``max_tokens`` is the response budget."""

    temperature: float = 1.0
    max_tokens: int = 32

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Completion:
    """One generated response. ``finish_reason`` is ``"stop"`` (EOS) or ``"length"`` (budget)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_ids: list[int] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities under the sampling distribution: softmax(logits / T), or T = 1 if greedy."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


class InferenceEngine:
    """Generates batches of responses with a static KV cache and left-padded prompts."""

    def __init__(self, model: CausalLM, eos_id: int, pad_id: int, max_batch: int = 256) -> None:
        self.model = model.eval().requires_grad_(False)
        self.eos_id, self.pad_id, self.max_batch = eos_id, pad_id, max_batch

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors the checkpoint engine writes into, by Hugging Face name."""
        return dict(self.model.state_dict(keep_vars=True))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int = 0) -> list[Completion]:
        """Sample one response per prompt; prompts are processed in chunks of ``max_batch``."""
        if not prompts:
            return []
        ctx = self.model.config.max_position_embeddings
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + params.max_tokens > ctx:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_tokens={params.max_tokens} it exceeds "
                    f"the context of {ctx}"
                )
        gen = torch.Generator().manual_seed(seed)
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch):
            out += self._generate_chunk(prompts[start : start + self.max_batch], params, gen)
        return out

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, gen: torch.Generator):
        b, width = len(prompts), max(map(len, prompts))
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(b, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            valid[i, width - len(p) :] = True
        dtype = next(self.model.parameters()).dtype
        cache = KVCache(self.model.config, b, width + params.max_tokens, dtype)
        logits = self.model(ids, positions_from_valid(valid), padded_causal_mask(valid), cache, 0)[:, -1]
        next_pos = valid.sum(-1)

        tokens = torch.empty(b, params.max_tokens, dtype=torch.long)
        logps = torch.empty(b, params.max_tokens)
        lengths = torch.full((b,), params.max_tokens, dtype=torch.long)
        done = torch.zeros(b, dtype=torch.bool)
        keys_valid = torch.cat([valid, torch.ones(b, params.max_tokens, dtype=torch.bool)], dim=1)
        for step in range(params.max_tokens):
            lp = token_logprobs(logits, params.temperature)
            if params.temperature > 0:
                tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
            else:
                tok = lp.argmax(-1)
            tok = torch.where(done, self.pad_id, tok)
            tokens[:, step] = tok
            logps[:, step] = lp.gather(1, tok[:, None]).squeeze(1)
            finished = ~done & (tok == self.eos_id)
            lengths[finished] = step + 1
            done |= finished
            if bool(done.all()) or step == params.max_tokens - 1:
                break
            col = width + step
            mask = keys_valid[:, None, None, : col + 1]
            logits = self.model(tok[:, None], next_pos[:, None], mask, cache, col)[:, -1]
            next_pos += 1

        out = []
        for i in range(b):
            n = int(lengths[i])
            stopped = n <= params.max_tokens and bool(done[i])
            out.append(
                Completion(
                    token_ids=tokens[i, :n].tolist(),
                    logprobs=logps[i, :n].tolist(),
                    finish_reason="stop" if stopped else "length",
                    prompt_ids=list(prompts[i]),
                )
            )
        return out
