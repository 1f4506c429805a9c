"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback HTTP."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from checkpoint_engine.update import free_port
from engines.hf_io import save_pretrained
from engines.inference import InferenceEngine, SamplingParams
from engines.server import ServedModel, build_app
from rl.cli import main as rl_main


@pytest.fixture
def server(tiny_model, tokenizer, tmp_path):
    save_pretrained(tiny_model, tokenizer, tmp_path / "tiny")
    served = ServedModel(tmp_path / "tiny", max_num_seqs=4)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    yield served, client, port
    srv.should_exit = True
    thread.join(timeout=10)
    served.loop.close()


def test_completions_match_the_engine(server, tiny_model, tokenizer):
    _, client, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "Question: Mia has 3 apples."
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    # a separate engine on the same weights: the server's engine belongs to its loop thread
    ref = InferenceEngine(tiny_model, tokenizer.eos_id).generate([tokenizer.encode(prompt)], SamplingParams(0.0, 8))[0]
    assert r.choices[0].text == tokenizer.decode(ref.token_ids)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-6)
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_ids) and r.usage.completion_tokens == len(ref.token_ids)


def test_chat_n_samples_and_seed(server):
    _, client, _ = server
    msgs = [{"role": "user", "content": "Question: Leo has 5 pens."}]
    a = client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=10, seed=11, logprobs=True)
    b = client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=10, seed=11)
    assert len(a.choices) == 3 and all(c.message.role == "assistant" for c in a.choices)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert all(len(c.logprobs.content) > 0 for c in a.choices)


def test_bad_requests_get_400_while_others_finish(server):
    _, client, _ = server
    long_prompt = "Question: " + "apples and pears " * 100

    def ask(prompt, **kw):
        try:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, **kw)
        except openai.BadRequestError as e:
            return e

    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(ask, "Question: a b c", seed=i) for i in range(4)]
        futs += [pool.submit(ask, long_prompt), pool.submit(ask, "Q", temperature=-1)]
        results = [f.result() for f in futs]
    assert all(isinstance(r, openai.types.Completion) for r in results[:4])
    assert isinstance(results[4], openai.BadRequestError) and "context" in results[4].message
    assert isinstance(results[5], openai.BadRequestError) and "temperature" in results[5].message


def test_unsupported_and_malformed_bodies(server):
    _, _, port = server
    url = f"http://127.0.0.1:{port}/v1"
    r = httpx.post(f"{url}/completions", json={"prompt": "Q", "stream": True})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_serve_cli_names_a_missing_model(tmp_path, capsys):
    assert rl_main(["serve", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
