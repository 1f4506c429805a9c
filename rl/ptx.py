"""The PTX dataset: curated chat samples whose token-mean NLL is mixed into every RL step.

A JSONL file, one sample per line, either ``{"messages": [{"role": ..., "content": ...}, ...]}``
(the last message is the assistant's reply the loss is taken on) or ``{"prompt": ..., "response": ...}``.
Messages before the reply are rendered with the tokenizer's chat template if it has one, else as
``role: content`` lines ending in ``assistant:``; a model trained on plain prompts (the embedded
default) should use the prompt/response form so PTX text looks like its rollouts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from envs.tasks import TaskFileError, read_jsonl
from rl.algorithm import PtxBatch
from rl.errors import UserError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PtxSample:
    prompt: str
    response: str


def _render(messages: list[dict], where: str) -> PtxSample:
    if not messages or not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                               for m in messages):
        raise UserError(f"{where}: messages must be a non-empty list of {{role: {'|'.join(ROLES)}, "
                        "content: string}")
    if messages[-1]["role"] != "assistant":
        raise UserError(f"{where}: the last message must be the assistant's reply (the loss is taken on it)")
    context = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1])
    return PtxSample(context + "assistant:", " " + messages[-1]["content"])


def load_ptx(path: Path) -> list[PtxSample]:
    """Read and validate a PTX JSONL file; a bad line stops the run with its file and line number."""
    samples = []
    try:
        for where, _, rec in read_jsonl(path, "algorithm.ptx.data:"):
            if "messages" in rec:
                samples.append(_render(rec["messages"], where))
            elif isinstance(rec.get("prompt"), str) and isinstance(rec.get("response"), str) and rec["response"]:
                samples.append(PtxSample(rec["prompt"], rec["response"]))
            else:
                raise UserError(f"{where}: needs 'messages' or non-empty string 'prompt' and 'response'")
    except TaskFileError as e:
        raise UserError(str(e)) from None
    if not samples:
        raise UserError(f"algorithm.ptx.data: {path} holds no samples")
    return samples


def ptx_batches(samples: list[PtxSample], tok, batch_size: int, steps: int, seed: int, iteration: int
                ) -> list[PtxBatch]:
    """``steps`` batches of prompt ids and response ids + EOS, a deterministic function of the iteration."""
    rng = random.Random(seed * 7_000_003 + iteration)
    out = []
    for _ in range(steps):
        chosen = [samples[rng.randrange(len(samples))] for _ in range(batch_size)]
        out.append(PtxBatch([tok.encode(s.prompt) for s in chosen],
                            [[*tok.encode(s.response), tok.eos_id] for s in chosen]))
    return out
