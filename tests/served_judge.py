"""A tiny LLM judge trained here and served by `rl serve`'s server (``engines.inference.server``) on a thread, shared
by the judge environment's tests (test_reward_judge.py) and the run that a judge rewards (test_reward_sources_run.py)
through the session fixture ``served_judge`` of conftest.py.

The judge is trained to reply ``Score: N`` to the judge prompts of CASES (right responses 9, wrong ones 2). The
server's app is wrapped so that every chat completion it answers is kept (the request and the reply), so a test can
say what the judge said about each response it was asked about."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs import Task

RUBRIC = "Is it right?"
TASKS = [Task("j1", "What is 2 + 3?", "5"), Task("j2", "What is 7 * 6?", "42")]
CASES = [(TASKS[0], "The answer is 5.", 9), (TASKS[0], "Sorry, no idea.", 2),
         (TASKS[1], "The answer is 42.", 9), (TASKS[1], "Sorry, no idea.", 2)]


def trained_judge(directory: Path) -> None:
    """A tiny model that replies ``Score: N`` (then EOS) to the judge prompts of CASES, saved to ``directory``."""
    import torch
    import torch.nn.functional as F

    from engines.model.io.hf_io import save_pretrained
    from engines.model.native.arch import ModelConfig
    from engines.model.native.attention import padded_causal_mask, positions_from_valid
    from engines.model.native.causal_lm import CausalLM
    from engines.model.text.tokenizer import train_tokenizer
    from envs.reward_judge import judge_prompt

    texts = [judge_prompt(task, response, RUBRIC, 10) for task, response, _ in CASES]
    tok = train_tokenizer(texts * 3 + [f"Score: {i}" for i in range(11)], vocab_size=500)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]  # as the server renders
    targets = [[*tok.encode(f"Score: {score}"), tok.eos_id] for *_, score in CASES]
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    length = max(len(p) + len(t) for p, t in zip(prompts, targets, strict=True))
    ids = torch.full((len(CASES), length), tok.pad_id)
    labels = torch.full((len(CASES), length), -100)
    valid = torch.zeros(len(CASES), length, dtype=torch.bool)
    for i, (p, t) in enumerate(zip(prompts, targets, strict=True)):
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        valid[i, :len(p) + len(t)] = True
        labels[i, len(p) - 1:len(p) + len(t) - 1] = torch.tensor(t)  # the reply only
    mask, positions = padded_causal_mask(valid), positions_from_valid(valid)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared machine
    try:
        for _ in range(400):
            loss = F.cross_entropy(model(ids, positions, mask).flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.02:
                break
    finally:
        torch.set_num_threads(threads)
    save_pretrained(model.eval(), tok, directory)


@dataclass
class ServedJudge:
    """The judge's API root (``.../v1``) and every chat completion it answered: (request body, reply text)."""

    url: str
    answered: list[tuple[dict[str, Any], str]] = field(default_factory=list)


def recording(app: Any, answered: list[tuple[dict[str, Any], str]]) -> Any:
    """``app`` (ASGI) keeping each non-streamed chat completion it answers with 200: the request and the reply."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            return await app(scope, receive, send)
        request, reply, status = bytearray(), bytearray(), [0]

        async def receive_kept():
            message = await receive()
            request.extend(message.get("body", b""))
            return message

        async def send_kept(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                reply.extend(message.get("body", b""))
            await send(message)

        await app(scope, receive_kept, send_kept)
        if status[0] == 200:
            answered.append((json.loads(request), json.loads(reply)["choices"][0]["message"]["content"]))

    return wrapped


@contextmanager
def serve_judge(directory: Path) -> Iterator[ServedJudge]:
    """The judge trained into ``directory``, served on a free local port until the block ends."""
    import uvicorn

    from checkpoint_engine.topology import free_port
    from engines.inference.server import ServedModel, build_app

    trained_judge(directory)
    served = ServedModel(directory, max_num_seqs=4, name="judge")
    port = free_port()
    judge = ServedJudge(f"http://127.0.0.1:{port}/v1")
    srv = uvicorn.Server(uvicorn.Config(recording(build_app(served), judge.answered), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not srv.started:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield judge
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        served.loop.close()
