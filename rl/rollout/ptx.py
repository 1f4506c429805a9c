"""The PTX dataset: curated chat samples whose token-mean NLL is mixed into every RL step.

A JSONL file, one sample per line, either ``{"messages": [{"role": ..., "content": ...}, ...]}``
(the last message is the assistant's reply the loss is taken on) or ``{"prompt": ..., "response": ...}``.
With a chat template, the conversation is rendered as transformers renders it: the prompt is the
messages before the reply with the generation prompt, the response is what the whole conversation
adds after it, up to and including the template's end-of-turn token when that is an EOS id (so the
model learns to stop as its template stops). Without a template, messages become ``role: content``
lines ending in ``assistant:``; a model trained on plain prompts (the embedded default) should use
the prompt/response form so PTX text looks like its rollouts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from envs.tasks import TaskFileError, read_jsonl
from rl.algo.batches import PtxBatch
from rl.errors import UserError
from rl.seeds import ptx_seed

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PtxSample:
    prompt: str
    response: str
    messages: tuple[dict, ...] | None = None  # the conversation, when the chat template should render it


def _render(messages: list[dict], where: str) -> PtxSample:
    if not messages or not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                               for m in messages):
        raise UserError(f"{where}: messages must be a non-empty list of {{role: {'|'.join(ROLES)}, "
                        "content: string}")
    if messages[-1]["role"] != "assistant":
        raise UserError(f"{where}: the last message must be the assistant's reply (the loss is taken on it)")
    context = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1])
    return PtxSample(context + "assistant:", " " + messages[-1]["content"], tuple(messages))


def sample_ids(sample: PtxSample, tok) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids ending in an EOS id) of a sample, through the chat template when it has one."""
    if sample.messages and tok.has_chat_template:
        messages = list(sample.messages)
        prompt = tok.apply_chat_template(messages[:-1])
        full = tok.apply_chat_template(messages, add_generation_prompt=False)
        if full[:len(prompt)] != prompt:
            raise UserError("algorithm.ptx.data: the chat template renders a conversation that does not begin with "
                            "its own generation prompt, so the reply cannot be separated from the context")
        response = full[len(prompt):]
        stop = next((i for i, t in enumerate(response) if t in tok.eos_ids), None)
        return prompt, response[:stop + 1] if stop is not None else [*response, tok.eos_id]
    return tok.encode(sample.prompt), [*tok.encode(sample.response), tok.eos_id]


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
    rng = random.Random(ptx_seed(seed, iteration))
    out = []
    for _ in range(steps):
        chosen = [samples[rng.randrange(len(samples))] for _ in range(batch_size)]
        prompts, responses = zip(*(sample_ids(s, tok) for s in chosen), strict=True)
        out.append(PtxBatch(list(prompts), list(responses)))
    return out
