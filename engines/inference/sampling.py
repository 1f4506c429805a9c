"""Sampling parameters and the batched sampler of the inference engine.

Every row of a decode batch carries its own temperature, top-k, top-p and seed, so one call
samples for hundreds of requests. Randomness is counter-based: the uniform draw of a request's
n-th token is a hash of (seed, n), so a request samples the same tokens whatever else is in the
batch, and a paused request resumes exactly where it would have gone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engines.device import to_device
from engines.inference.uploads import upload

if TYPE_CHECKING:
    from engines.inference.constrained import Constraint, Matcher


#: Most alternatives a request may ask each step for (``SamplingParams.top_logprobs``).
MAX_TOP_LOGPROBS = 1024


class InvalidRequestError(ValueError):
    """A request the engine cannot serve (bad sampling parameters, too long for the context...)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable those filters;
    ``max_tokens`` is the response budget; generation also stops at EOS (unless ``ignore_eos``),
    at any of ``stop_token_ids`` and after any of the ``stop`` strings; ``seed`` makes the request
    reproducible on its own (None: derived from the engine's seed and the request's arrival order).
    ``grammar`` constrains decoding (e.g. ``engines.inference.constrained.ConstraintCompiler.tool_calls``):
    disallowed tokens are masked before sampling, and the request stops when the grammar terminates.
    ``top_logprobs`` > 0: each step also reports that many of the most likely tokens at the position, with their
    log-probs under the model's own distribution (temperature 1, no filters, no grammar), from the step's logits.
    """

    temperature: float = 1.0
    max_tokens: int = 32
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    grammar: Constraint | None = None
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = []
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            problems.append(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not (isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            problems.append(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            problems.append(f"grammar must have a matcher() method, got {type(self.grammar).__name__}")
        if problems:
            raise InvalidRequestError("; ".join(problems))


def token_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Log-probabilities under the sampling distribution: softmax(logits / T), or T = 1 if greedy.

    ``temperature`` is one number, or a tensor with one per row (first dimension) of ``logits``.
    """
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        temps = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
        logits = logits / temps.view(-1, *[1] * (logits.ndim - 1))
    elif temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values < 2**32."""
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & _M32  # the multiplier is < 2**27, so the product never overflows
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) (53 random bits) that depend only on each row's (seed, counter)."""
    base = _mix32(_mix32(seeds & _M32) ^ ((seeds >> 32) & _M32))
    c = (counters & 0x7FFFFFFF) * 2
    hi = _mix32(base ^ _mix32(c))
    lo = _mix32(base ^ _mix32(c + 1))
    return ((hi << 21) | (lo >> 11)).double() * 2.0**-53


@dataclass
class RowParams:
    """Sampling parameters of the rows of a batch, as tensors (one entry per row)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64

    def __getitem__(self, rows) -> RowParams:
        return RowParams(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.seed[rows])


#: Rows whose top-k is at most this draw from ``topk`` of this many candidates instead of a full sort.
TOPK_CANDIDATES = 1024


def filter_kind(top_k: int, top_p: float, vocab: int) -> int:
    """How a row with these parameters is drawn: 0 from the whole distribution, 1 from the top
    ``TOPK_CANDIDATES`` (its top-k fits in them), 2 from a full sort (top-p alone, or a larger top-k).
    A row's kind depends on its own parameters only, so it draws the same token in any batch."""
    if top_k <= 0 and top_p >= 1:
        return 0
    return 1 if 0 < top_k <= min(vocab, TOPK_CANDIDATES) else 2


def sample(logits: torch.Tensor, rows: RowParams, counters: torch.Tensor,
           kinds: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [n, V]; returns (tokens [n], logprobs [n]).

    The logprob is the token's log-probability under softmax(logits / T) over the whole vocabulary
    (T = 1 for greedy rows), which is what the trainer recomputes; top-k/top-p only restrict which
    tokens may be drawn. ``kinds`` gives each row's ``filter_kind`` (the caller knows the parameters;
    None: worked out here, which reads the parameters back from the device). Otherwise nothing waits for
    the device: each row draws by inverse CDF from its own counter-based uniform, and greedy rows take the
    argmax through a ``where``.
    """
    logits = logits.float()
    v = logits.shape[1]
    greedy = rows.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    u = counter_uniform(rows.seed, counters)
    probs = logp.exp()
    if kinds is None:
        kinds = [filter_kind(k, p, v) for k, p in zip(rows.top_k.tolist(), rows.top_p.tolist(), strict=True)]
    tokens = _draw(probs, u)
    for kind in (1, 2):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if idx:
            sel = upload(idx, logits.device)  # the host knows the kinds: no read back, no blocking copy
            sub = rows[sel]
            if kind == 1:
                top, order = probs[sel].topk(min(v, TOPK_CANDIDATES), dim=-1)
            else:
                top, order = probs[sel].sort(dim=-1, descending=True)
            k = torch.where(sub.top_k > 0, sub.top_k, v)
            rank = torch.arange(top.shape[1], device=logits.device)
            before = top.cumsum(-1) - top  # mass of the tokens ranked above this one
            keep = (rank[None] < k[:, None]) & (before < sub.top_p[:, None])
            tokens[sel] = order.gather(1, _draw(top * keep, u[sel])[:, None]).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                 counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` for rows without top-k, top-p or a grammar: the same (tokens [n], logprobs [n]) from the same
    draws, as one log-softmax, one scan and two row reductions that a decode graph captures (and torch.compile
    could fuse into a couple of passes over the vocabulary)."""
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
    # the same inverse-CDF draw as ``_draw``, exponentiated and summed in place: a graph's pool then holds two
    # [n, V] float buffers at most, not four
    cdf = logp.exp().cumsum_(-1)
    total = cdf[:, -1:]
    u = counter_uniform(seed, counters)
    target = torch.minimum((u[:, None] * total.double()).float(), torch.nextafter(total, torch.zeros_like(total)))
    # the columns at or below the target, counted: what searchsorted(right=True) returns on the nondecreasing cdf,
    # as a reduction a compiler fuses with the scan instead of a binary search it cannot
    drawn = (cdf <= target).sum(-1).clamp_(max=logits.shape[-1] - 1)
    # the argmax of the logits themselves, as ``sample`` takes it (a float32 copy has the same order and ties)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of a column per row of (unnormalised) ``probs`` at the uniforms ``u``."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # strictly below the total, so the draw never lands past the last column with mass
    target = torch.minimum((u[:, None] * total.double()).float(), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)


# --- constrained decoding (SamplingParams.grammar; the matchers come from engines.inference.constrained) ------


def new_matcher(params: SamplingParams, prior: Sequence[int] = ()) -> Matcher | None:
    """A fresh matcher of ``params.grammar`` advanced past ``prior`` tokens (a resumed request); None without one."""
    if params.grammar is None:
        return None
    matcher = params.grammar.matcher()
    for t in prior:
        if not matcher.accept(int(t)):
            raise InvalidRequestError(f"resumed request's token {int(t)} violates its grammar")
    return matcher


def mask_logits(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """``logits`` [n, V] with the tokens each row's matcher disallows set to -inf (rows without one untouched).

    Sampling from these logits makes the reported logprobs those of the masked, renormalised
    distribution: the one the tokens were actually drawn from (the behaviour policy). The trainer
    recomputes logprobs from the unmasked model, so for constrained tokens the two differ (masked >=
    unmasked); a grammar that only removes tokens the model would almost never pick changes little.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
    for j, i in enumerate(rows):
        mask = matchers[i].allowed_mask()
        width = min(logits.shape[-1], mask.shape[0])  # logits past the grammar's vocabulary stay disallowed
        allowed[j, :width] = mask[:width]
    idx = upload(rows, logits.device)
    logits = logits.clone()
    logits[idx] = logits[idx].masked_fill(~to_device(allowed, logits.device), float("-inf"))
    return logits


def advance_matchers(matchers: Sequence[Matcher | None], tokens: torch.Tensor) -> torch.Tensor:
    """Feed each row's sampled token to its matcher; returns a bool [n]: the rows whose grammar ended."""
    done = [False] * len(matchers)
    for i, (m, t) in enumerate(zip(matchers, tokens.tolist(), strict=True)):
        # a token outside the mask cannot be drawn; if one were, stop rather than go on unconstrained
        if m is not None and (not m.accept(t) or m.is_terminated()):
            done[i] = True
    return torch.tensor(done, dtype=torch.bool, device=tokens.device)
