"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback HTTP."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from checkpoint_engine.topology import free_port
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.inference.server import ServedModel, build_app
from engines.model.hf_io import save_pretrained
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


def test_top_logprobs_usage_and_model_name(server, tiny_model, tokenizer):
    """top_logprobs are the model's own top alternatives (the sampled token's log-prob among them at temperature
    0), usage counts the prompt once whatever n is, and an unknown model name is refused."""
    _, client, _ = server
    prompt = "Question: Mia has 3 apples."
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, n=2)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) and all(len(t) == 3 for t in lp.top_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(value, abs=1e-4) and token in top  # greedy: the best one
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))  # not multiplied by n=2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=prompt, max_tokens=2)


def test_stop_strings_are_cut_from_text_and_logprobs_alike(server, tiny_model, tokenizer):
    _, client, _ = server
    prompt = "Question: Mia has 3 apples."
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0, stop=stop)
    c = r.choices[0]
    assert c.finish_reason == "stop" and stop not in c.text and text.startswith(c.text)
    assert "".join(c.logprobs.tokens) == c.text and len(c.logprobs.token_logprobs) == len(c.logprobs.tokens)
    assert r.usage.completion_tokens >= len(c.logprobs.tokens)  # usage counts every generated token


def test_saved_weights_have_the_usual_file_mode(tiny_model, tokenizer, tmp_path):
    import os

    save_pretrained(tiny_model, tokenizer, tmp_path / "m")
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~mask, modes


def test_vllm_serve_answers_as_the_native_engine_over_the_same_api(tokenizer, tmp_path):
    """`rl serve --engine vllm`: the OpenAI-compatible server on vLLM gives the native engine's greedy text and
    token log-probs for a completion, cuts stop strings, and answers chat through the model's template."""
    from tests.test_vllm_engine import _model

    vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
    if not vllm_engine.vllm_available():
        pytest.skip("vLLM is not installed here (make setup installs it)")
    model = _model(tokenizer, 0)
    save_pretrained(model, tokenizer, tmp_path / "m")
    served = ServedModel(tmp_path / "m", max_num_seqs=4, kv_cache_bytes=32 << 20, engine="vllm")
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not srv.started:
            assert time.time() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        prompt = "Question: Mia has 3 apples."
        r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
        ref = InferenceEngine(model.eval(), tokenizer.eos_ids).generate([tokenizer.encode(prompt)],
                                                                        SamplingParams(0.0, 12))[0]
        assert r.choices[0].text == tokenizer.decode(ref.token_ids)
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        text = r.choices[0].text
        stop = text[len(text) // 2:][:2]
        if stop.strip():
            cut = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
            assert cut.choices[0].text == text[:text.find(stop)]
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=6, temperature=0)
        assert chat.choices[0].message.role == "assistant"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        served.loop.close()
        served.engine.close()
