"""Log-probabilities of chosen tokens without the full logits: the vocabulary is scored in chunks.

``selected_logprobs(hidden, weight, targets, inv_temp)`` returns log softmax(hidden·Wᵀ·inv_temp)[target]
for every row, and the entropy of each row's distribution, holding at most one [N, chunk] block of
logits at a time in the forward and again in the backward (which recomputes the chunks instead of
keeping them). Peak memory grows with N·chunk, not with N·vocabulary. Each chunk's logits are the
matmul in the weights' dtype, then float32 (float64 for a float64 model), exactly as the inference engine scores a
token (its ``lm_head`` output, ``.float()``, divided by the temperature), so the two agree to float32 rounding.
"""

from __future__ import annotations

import torch

#: Elements of one [N, chunk] block of float32 logits (64 Mi elements = 256 MiB).
CHUNK_ELEMENTS = 1 << 26
MIN_CHUNK = 256


def vocab_chunk(rows: int, vocab: int, budget: int | None = None) -> int:
    """Vocabulary entries per chunk: as many as fit ``budget`` (default ``CHUNK_ELEMENTS``) elements for ``rows``
    rows, at least MIN_CHUNK."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    return max(min(vocab, MIN_CHUNK), min(vocab, budget // max(1, rows)))


def _in_chunk(targets: torch.Tensor, lo: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each target falls in vocabulary chunk [lo, lo + width) [N] bool, its column there [N, 1]
    clamped into the chunk): masks and gathers of a fixed size, so no ``nonzero`` makes the host wait."""
    inside = (targets >= lo) & (targets < lo + width)
    return inside, (targets - lo).clamp(0, width - 1)[:, None]


def _accumulation_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32, or the weights' dtype where that is wider (a float64 model keeps float64 log-probs)."""
    return torch.promote_types(weight.dtype, torch.float32)


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk, softcap):
        n, vocab = hidden.shape[0], weight.shape[0]
        dev, acc = hidden.device, _accumulation_dtype(weight)
        best = torch.full((n,), float("-inf"), device=dev, dtype=acc)
        total = torch.zeros(n, device=dev, dtype=acc)        # Σ exp(z - best)
        weighted = torch.zeros(n, device=dev, dtype=acc)     # Σ exp(z - best)·z, for the entropy
        chosen = torch.zeros(n, device=dev, dtype=acc)
        scale = inv_temp[:, None]
        for lo in range(0, vocab, chunk):
            z = _capped((hidden @ weight[lo:lo + chunk].T).to(acc), softcap) * scale
            inside, col = _in_chunk(targets, lo, z.shape[1])
            chosen = torch.where(inside, z.gather(1, col).squeeze(1), chosen)
            new_best = torch.maximum(best, z.amax(dim=-1))
            keep = torch.exp(best - new_best)
            e = torch.exp(z - new_best[:, None])
            total = total * keep + e.sum(dim=-1)
            weighted = weighted * keep + (e * z).sum(dim=-1)
            best = new_best
        lse = best + total.log()
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse)
        ctx.chunk, ctx.softcap = chunk, softcap
        entropy = lse - weighted / total
        ctx.mark_non_differentiable(entropy)
        return chosen - lse, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, inv_temp, lse = ctx.saved_tensors
        chunk, softcap, vocab = ctx.chunk, ctx.softcap, weight.shape[0]
        # d log p(y) / d z_v = 1[v = y] − p_v, and z = inv_temp · h·wᵀ
        acc = _accumulation_dtype(weight)
        g = (grad_logp.to(acc) * inv_temp)[:, None]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        for lo in range(0, vocab, chunk):
            w = weight[lo:lo + chunk]
            raw = (hidden @ w.T).to(acc)
            z = _capped(raw, softcap) * inv_temp[:, None]
            coef = torch.exp(z - lse[:, None]).mul_(-g)
            inside, col = _in_chunk(targets, lo, w.shape[0])
            coef.scatter_add_(1, col, g * inside[:, None])  # adds 0 where the target is in another chunk
            if softcap is not None:  # d cap·tanh(x / cap) / dx = 1 − tanh²(x / cap)
                coef.mul_(1 - torch.tanh(raw / softcap).square())
            coef = coef.to(hidden.dtype)
            if need_h:
                grad_h += (coef @ w).to(acc)
            if need_w:
                grad_w[lo:lo + chunk] = coef.T @ hidden
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None, None, None


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capped logits cap·tanh(logits / cap), or ``logits`` (no cap)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def selected_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      inv_temp: torch.Tensor | float = 1.0,
                      chunk: int | None = None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of ``targets`` [N] float32, entropy [N] float32 without gradient) under
    softmax(hidden·weightᵀ·inv_temp) for hidden [N, D], weight [V, D]; ``inv_temp`` one number or [N].
    ``softcap``: the logits are soft-capped, cap·tanh(hidden·weightᵀ / cap), before the temperature."""
    n = hidden.shape[0]
    if isinstance(inv_temp, torch.Tensor):
        inv = inv_temp.to(device=hidden.device, dtype=torch.float32).expand(n).contiguous()
    else:  # filled on the device: no copy of a Python number
        inv = torch.full((n,), float(inv_temp), dtype=torch.float32, device=hidden.device)
    chunk = chunk or vocab_chunk(n, weight.shape[0])
    return _SelectedLogprobs.apply(hidden, weight, targets, inv, chunk, softcap)
