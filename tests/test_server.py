"""The OpenAI-compatible server, driven by the official ``openai`` client and lm-eval over loopback HTTP: one
server per model for the whole module."""

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn

from checkpoint_engine.topology import free_port
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.inference.server import ServedModel, build_app
from engines.model.io.hf_io import save_pretrained
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from rl.cli import main as rl_main
from tests.conftest import sharp_model, tiny_config


@contextlib.contextmanager
def running(served: ServedModel):
    """``served`` over HTTP on a free port of loopback, until the block ends: (openai client, port)."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not srv.started:
            assert time.time() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), port
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        served.close()


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    """The conftest's tiny model (the same weights as its ``tiny_model``) served by the native engine."""
    model = sharp_model(tiny_config(tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id))
    d = tmp_path_factory.mktemp("served") / "tiny"
    save_pretrained(model, tokenizer, d)
    served = ServedModel(d, max_num_seqs=4)
    with running(served) as (client, port):
        yield served, client, port


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
    # streaming is served (it was refused before): events, then [DONE]
    r = httpx.post(f"{url}/completions", json={"prompt": "Q", "stream": True, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")
    r = httpx.post(f"{url}/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_serve_cli_names_a_missing_model(tmp_path, capsys):
    assert rl_main(["serve", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_serve_cli_names_a_device_it_does_not_have(tiny_model, tokenizer, tmp_path, capsys):
    save_pretrained(tiny_model, tokenizer, tmp_path / "m")
    assert rl_main(["serve", str(tmp_path / "m"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


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
    token log-probs for a completion, cuts stop strings, answers chat through the model's template, streams what
    it answers unstreamed, and scores an echoed prompt as the model does."""
    from tests.test_vllm_engine import _model

    vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
    if not vllm_engine.vllm_available():
        pytest.skip("vLLM is not installed here (make setup installs it)")
    model = _model(tokenizer, 0)
    save_pretrained(model, tokenizer, tmp_path / "m")
    served = ServedModel(tmp_path / "m", max_num_seqs=4, kv_cache_bytes=32 << 20, engine="vllm")
    with running(served) as (client, _):
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
        chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                                stream=True))
        whole = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
        got = _joined(chunks, 0)
        assert got["pieces"] > 2 and got["text"] == whole.choices[0].text == text
        assert got["token_logprobs"] == whole.choices[0].logprobs.token_logprobs
        _same_tops(got["top_logprobs"], whole.choices[0].logprobs.top_logprobs)
        ids = tokenizer.encode(prompt)
        echo = client.completions.create(model="m", prompt=prompt, echo=True, logprobs=1, max_tokens=0).choices[0]
        assert echo.text == served.decode(ids) and echo.logprobs.token_logprobs[0] is None
        assert echo.logprobs.token_logprobs[1:] == pytest.approx(_prompt_logprobs(model.eval(), ids).tolist(),
                                                                 abs=1e-4)
        assert echo.logprobs.text_offset[0] == 0 and len(echo.logprobs.tokens) == len(ids)


# --- streaming, echo and max_tokens ------------------------------------------------------------


def _joined(chunks, index: int) -> dict:
    """One choice of a streamed completion, its chunks put together."""
    out = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "finish": None,
           "pieces": 0}
    for ch in chunks:
        for c in ch.choices:
            if c.index != index:
                continue
            out["pieces"] += 1
            out["text"] += c.text
            if c.logprobs is not None:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    out[key] += getattr(c.logprobs, key)
                out["top_logprobs"] += c.logprobs.top_logprobs or []
            out["finish"] = c.finish_reason or out["finish"]
    return out


def _same_tops(got: list, want: list | None) -> None:
    """Top alternatives alike: the same tokens, log-probs to rounding (each chunk scores its own prefix)."""
    want = want or []
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()), abs=1e-5)


@pytest.mark.parametrize("kw", [dict(temperature=0, logprobs=2), dict(temperature=1.0, seed=5, n=2, logprobs=0),
                                dict(temperature=0, echo=True, logprobs=1), dict(temperature=0.8, seed=3)],
                         ids=["greedy-top2", "sampled-n2", "echo", "plain"])
def test_streamed_completions_add_up_to_the_unstreamed_ones(server, kw):
    _, client, _ = server
    prompt = "Question: Mia has 3 apples."
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **kw)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    for c in whole.choices:
        got = _joined(chunks, c.index)
        assert got["pieces"] > 2  # streamed as it was generated, not in one piece at the end
        assert got["text"] == c.text and got["finish"] == c.finish_reason
        if c.logprobs is None:
            assert got["tokens"] == []
            continue
        assert got["tokens"] == c.logprobs.tokens and got["text_offset"] == c.logprobs.text_offset
        assert got["token_logprobs"] == c.logprobs.token_logprobs
        _same_tops(got["top_logprobs"], c.logprobs.top_logprobs)
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_streamed_text_holds_back_a_stop_string(server):
    """A stop string arrives over several tokens: what was streamed before it was cut is still the final text."""
    _, client, _ = server
    prompt = "Question: Mia has 3 apples."
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    for stop in (text[len(text) // 2:][:3], text[len(text) // 3:][:2]):
        assert stop.strip(), text
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                                stop=stop, stream=True))
        got = _joined(chunks, 0)
        assert whole.choices[0].finish_reason == "stop" and stop not in whole.choices[0].text
        assert got["text"] == whole.choices[0].text and got["finish"] == "stop"


def test_streamed_chat_adds_up_to_the_unstreamed_one(server):
    _, client, _ = server
    msgs = [{"role": "user", "content": "Question: Leo has 5 pens."}]
    kw = dict(model="tiny", messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2, n=2)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for c in whole.choices:
        mine = [x for ch in chunks for x in ch.choices if x.index == c.index]
        assert mine[0].delta.role == "assistant" and len(mine) > 3
        assert "".join(x.delta.content or "" for x in mine) == c.message.content
        assert [x.finish_reason for x in mine][-1] == c.finish_reason
        content = [e for x in mine if x.logprobs is not None for e in x.logprobs.content]
        assert [(e.token, e.logprob) for e in content] == [(e.token, e.logprob) for e in c.logprobs.content]
        for e, w in zip(content, c.logprobs.content, strict=True):
            assert [t.token for t in e.top_logprobs] == [t.token for t in w.top_logprobs]


def _prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from a plain forward of the project's model (no engine)."""
    x = torch.tensor([ids])
    valid = torch.ones_like(x, dtype=torch.bool)
    with torch.no_grad():
        logits = model(x, positions_from_valid(valid), padded_causal_mask(valid))[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(1, x[0, 1:, None])[:, 0]


def test_echo_scores_the_prompt_and_offsets_count_in_the_echoed_text(server, tiny_model, tokenizer):
    served, client, _ = server
    prompt = "Question: Leo has 5 pens and 2 more."
    ids = tokenizer.encode(prompt)
    only = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    c, lp = only.choices[0], only.choices[0].logprobs
    assert c.text == served.decode(ids) and c.finish_reason == "length" and only.usage.completion_tokens == 0
    assert lp.tokens == [served.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has nothing before it
    ref = _prompt_logprobs(tiny_model.eval(), ids)
    assert lp.token_logprobs[1:] == pytest.approx(ref.tolist(), abs=1e-5)
    assert all(len(top) == 1 and max(top.values()) >= v - 1e-6 for top, v in
               zip(lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True))
    assert lp.text_offset[0] == 0 and all(c.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens,
                                                                                      strict=True))
    # with tokens generated after it: the prompt's entries, then the completion's own, offsets going on
    echo = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=4,
                                     temperature=0).choices[0]
    plain = client.completions.create(model="tiny", prompt=prompt, logprobs=1, max_tokens=4,
                                      temperature=0).choices[0]
    assert echo.text == c.text + plain.text and echo.logprobs.tokens == lp.tokens + plain.logprobs.tokens
    assert echo.logprobs.token_logprobs[0] is None
    assert echo.logprobs.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert echo.logprobs.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert echo.logprobs.text_offset[len(ids)] == len(c.text)
    assert all(echo.text[o:].startswith(t) for o, t in zip(echo.logprobs.text_offset, echo.logprobs.tokens,
                                                           strict=True))


def test_max_tokens_rules(server, tokenizer):
    """0 only with echo, negative refused, None the context's room (the tiny model's 128 tokens)."""
    _, client, _ = server
    prompt = "Question: Mia has 3 apples."
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=0)
    room = client.completions.create(model="tiny", prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert room.usage.completion_tokens == 128 - len(tokenizer.encode(prompt))
    assert room.choices[0].finish_reason == "length"
    full = tokenizer.encode("apples and pears " * 60)[:128]
    with pytest.raises(openai.BadRequestError, match="no room"):
        client.completions.create(model="tiny", prompt=full)


# --- lm-eval's local-completions on a transformers-made model ---------------------------------

MC_DOCS = [
    {"question": "Mia has 3 apples and buys 2 more. How many apples?", "choices": ["5", "6", "32"], "answer": 0},
    {"question": "Leo has 5 pens and gives 1 away. How many pens?", "choices": ["4", "six", "1 5"], "answer": 0},
    {"question": "What is 2*3+1?", "choices": ["7", "61", "8", "0"], "answer": 0},
]
MC_TASK = """task: colocated_rl_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def hf_model_server(tokenizer, tmp_path_factory):
    """A Llama made with transformers' own classes (random weights) and saved by transformers, served natively."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                                   eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(d)
    tokenizer.save(d)
    with running(ServedModel(d, max_num_seqs=4)) as (_, port):
        yield model, d, port


def test_lm_eval_loglikelihoods_equal_transformers(hf_model_server, tmp_path, monkeypatch):
    """lm-eval's local-completions (echo, logprobs=1, max_tokens=1) on a multiple-choice task made of local files:
    every choice's log-likelihood and greedy flag as transformers computes them on the same weights."""
    import json

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, d, port = hf_model_server
    # one choice that is the model's own greedy next token, so that lm-eval's greedy flag is seen true too: the first
    # question whose argmax token is a space and a word that tokenizes back to itself after the context
    tok = AutoTokenizer.from_pretrained(d)
    extra = None
    for n in range(2, 60):
        ctx = tok(f"Question: What is {n}+{n}?\nAnswer:", add_special_tokens=False).input_ids
        with torch.no_grad():
            best = int(model(torch.tensor([ctx])).logits[0, -1].argmax())
        text = tok.decode([best])
        if text.startswith(" ") and text[1:].isprintable() and text.strip() and \
                tok(tok.decode(ctx) + text, add_special_tokens=False).input_ids == [*ctx, best]:
            extra = {"question": f"What is {n}+{n}?", "choices": [text[1:], "9"], "answer": 0}
            break
    assert extra is not None, "no question has a greedy next token that round-trips"
    docs = [*MC_DOCS, extra]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    out = simple_evaluate(model="local-completions", tasks=["colocated_rl_tiny_mc"], log_samples=True,
                          task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
                          model_args=f"model=llama,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={d},"
                                     "tokenizer_backend=huggingface,max_retries=1")
    samples = out["samples"]["colocated_rl_tiny_mc"]
    assert len(samples) == len(docs)
    checked, greedy_seen = 0, 0
    for s in samples:
        for args, resp in zip(s["arguments"], s["resps"], strict=True):
            context, continuation = args[0], args[1]
            ctx = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0, :-1].float(), -1)
            targets = torch.tensor(whole[len(ctx):])
            mine = lp[len(ctx) - 1:].gather(1, targets[:, None])[:, 0]
            ll, greedy = resp[0]
            assert ll == pytest.approx(mine.sum().item(), abs=1e-4), (context, continuation)
            assert greedy == bool((lp[len(ctx) - 1:].argmax(-1) == targets).all())
            checked, greedy_seen = checked + 1, greedy_seen + greedy
    assert checked == sum(len(doc["choices"]) for doc in docs) and greedy_seen >= 1
