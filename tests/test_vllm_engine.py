"""vLLM behind the rollout engine interface (engines.inference.vllm_engine), against the native engine and the
trainer on the same weights: one vLLM engine per module (its start-up is slow), a small model made here."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import ray
import torch

from benchmarks.harness.child_sender import ChildSender
from checkpoint_engine.buckets import spec_of
from checkpoint_engine.sinks import StreamSink, ViewSink
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import load_pretrained, read_tensors, save_pretrained
from engines.model.layout import hub_state
from engines.model.native.causal_lm import CausalLM
from engines.model.text.tokenizer import TextTokenizer
from engines.training.engine import TrainingEngine
from rl.config import parse_config
from rl.loop.cluster import Cluster
from rl.loop.controller import train
from rl.rollout.turns import generate_with_budget
from rl.settings import for_model
from rl.setup.warmstart import prepare_model
from tests.conftest import make_sample, sharp_model, tiny_config, train_on

vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
vllm_weights = pytest.importorskip("engines.inference.vllm_weights")
if not vllm_engine.vllm_available():
    pytest.skip("vLLM is not installed here (make setup installs it)", allow_module_level=True)

PROMPTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens and 2 more"]


def _model(tokenizer, seed: int, kv_heads: int = 1) -> CausalLM:
    # head_dim 32: vLLM's CPU attention has no kernel for smaller heads
    cfg = tiny_config(tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=kv_heads, max_position_embeddings=256, eos_token_id=tokenizer.eos_id,
                      pad_token_id=tokenizer.pad_id)
    return sharp_model(cfg, seed).eval()


@pytest.fixture(scope="module")
def served(tokenizer, tmp_path_factory):
    """(vLLM engine, the model it started from); tests that change its weights put them back."""
    model = _model(tokenizer, 0)
    d = tmp_path_factory.mktemp("vllm_model")
    save_pretrained(model, tokenizer, d)
    engine = vllm_engine.VllmEngine(d, tokenizer.eos_ids, max_seq_len=256, max_num_seqs=16, dtype="float32",
                                    kv_cache_bytes=64 << 20)
    return engine, model


def _prompts(tokenizer):
    return [tokenizer.encode(t) for t in PROMPTS]


def _trainer_logprobs(model, prompts, responses, temperature):
    with torch.no_grad():
        lp, mask = TrainingEngine(model, [], 0).response_logprobs(prompts, responses, temperature)
    return [lp[i][mask[i]] for i in range(len(prompts))]


def test_vllm_greedy_gives_the_native_engines_tokens_and_the_trainers_logprobs(served, tokenizer):
    engine, model = served
    prompts, greedy = _prompts(tokenizer), SamplingParams(0.0, 24)
    got = engine.generate(prompts, greedy)
    want = InferenceEngine(model, tokenizer.eos_ids, tokenizer.pad_id).generate(prompts, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    ref = _trainer_logprobs(model, prompts, [c.token_ids for c in got], 1.0)
    for c, r in zip(got, ref, strict=True):
        # float32 on both sides, different kernels: the same numbers to rounding
        torch.testing.assert_close(torch.tensor(c.logprobs), r, atol=1e-4, rtol=0)


def test_vllm_steps_on_a_fresh_thread_when_torchs_thread_count_is_not_the_environments(served, tokenizer):
    """A server's loop thread (or a Ray concurrency group's) drives the engine: with torch set to more threads than
    OMP_NUM_THREADS, vLLM's CPU attention must still serve there, the same tokens as on the thread that built it."""
    import threading

    engine, _ = served
    want, got, old = _greedy(engine, tokenizer), [], torch.get_num_threads()
    torch._C.set_num_threads(old + 1)  # vLLM's CPU worker turned torch.set_num_threads into a no-op
    try:
        t = threading.Thread(target=lambda: got.append(_greedy(engine, tokenizer)))
        t.start()
        t.join()
    finally:
        torch._C.set_num_threads(old)
    assert got == [want]


def test_vllm_sampled_logprobs_are_the_trainers_at_the_sampling_temperature(served, tokenizer):
    """π_old of the K1.5 objective: log softmax(logits / T) of each sampled token, per request seed."""
    engine, model = served
    prompts = _prompts(tokenizer)
    params = [SamplingParams(0.7, 24, seed=100 + i) for i in range(len(prompts))]
    got = engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in engine.generate(prompts, params)]  # seeds hold
    ref = _trainer_logprobs(model, prompts, [c.token_ids for c in got], 0.7)
    for c, r in zip(got, ref, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), r, atol=1e-4, rtol=0)


def test_vllm_an_in_place_update_serves_exactly_the_new_weights_and_abort_keeps_the_old(served, tokenizer):
    engine, model = served
    prompts, greedy = _prompts(tokenizer), SamplingParams(0.0, 24)
    before = engine.generate(prompts, greedy)
    new = _model(tokenizer, 1)
    state = {k: v.detach().clone() for k, v in hub_state(new).items()}
    try:
        engine.load_weights(iter(state.items()))
        got = engine.generate(prompts, greedy)
        want = InferenceEngine(new, tokenizer.eos_ids, tokenizer.pad_id).generate(prompts, greedy)
        assert [c.token_ids for c in got] == [c.token_ids for c in want] != [c.token_ids for c in before]
        for k, v in state.items():
            torch.testing.assert_close(engine.served_weights()[k], v, rtol=0, atol=0)

        def failing():  # an update aborted midway: some layers were already given new values
            for i, (k, v) in enumerate(state.items()):
                if i == len(state) // 2:
                    raise RuntimeError("sender died")
                yield k, v * 0.5

        with pytest.raises(RuntimeError, match="sender died"):
            engine.load_weights(failing())
        assert [c.token_ids for c in engine.generate(prompts, greedy)] == [c.token_ids for c in got]
    finally:
        engine.load_weights(iter(hub_state(model).items()))
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == [c.token_ids for c in before]


@pytest.fixture(scope="module")
def sender(served):
    """A checkpoint-engine worker in a child process whose buckets (8 KiB: many, tensors split across them)
    reach the served vLLM engine through shared memory."""
    engine, _ = served
    with ChildSender([spec_of(n, t) for n, t in engine.named_tensors().items()], 8 << 10) as s:
        yield s


def _checkpoint(tokenizer, tmp_path, seed: int, kv_heads: int = 1):
    """A model of another seed, saved as a Hugging Face directory; and the native engine's greedy tokens on
    it as loaded back from disk."""
    save_pretrained(_model(tokenizer, seed, kv_heads), tokenizer, tmp_path)
    want = InferenceEngine(load_pretrained(tmp_path).eval(), tokenizer.eos_ids, tokenizer.pad_id)
    return tmp_path, [c.token_ids for c in want.generate(_prompts(tokenizer), SamplingParams(0.0, 24))]


def _greedy(engine, tokenizer):
    return [c.token_ids for c in engine.generate(_prompts(tokenizer), SamplingParams(0.0, 24))]


@pytest.fixture
def restore(served):
    """Puts the served engine back on its start-up weights after a test that updates it."""
    yield
    engine, model = served
    engine.abort()
    engine.load_weights(iter(hub_state(model).items()))


@pytest.fixture(params=["direct", "reload"])
def load_mode(request, served):
    """Each way an update goes into vLLM: straight into the live parameters, or vLLM's layer-wise reload."""
    engine, _ = served
    assert engine.weight_load == "direct"  # what auto picks for a dense unquantized model
    engine.weight_load = request.param
    yield request.param
    engine.weight_load = "direct"


def test_vllm_update_streamed_bucket_by_bucket_serves_the_new_checkpoint(served, sender, tokenizer, tmp_path,
                                                                         restore, load_mode):
    engine, _ = served
    plan = sender.plan
    split = [n for n in plan.tensors if sum(p.name == n for b in plan.buckets for p in b) > 1]
    assert len(plan.buckets) > 8 and split
    before = _greedy(engine, tokenizer)
    new_dir, want = _checkpoint(tokenizer, tmp_path, 1)
    recv = sender.receiver(StreamSink(engine, engine.named_tensors()))
    _, error = sender.update(recv, new_dir, 3)
    assert error is None and recv.version == engine.weights_version == 3
    assert _greedy(engine, tokenizer) == want != before
    on_disk = read_tensors(new_dir)
    assert all(torch.equal(engine.served_weights()[k], v) for k, v in on_disk.items())
    # the receiver's host copy is what vLLM serves now (a catch-up packs from it): no second copy was kept
    assert all(recv.tensors[k] is engine.served_weights()[k] for k in on_disk)


def test_vllm_streamed_update_is_one_load_that_takes_each_bucket_before_the_next_arrives(
        served, sender, tokenizer, tmp_path, restore, load_mode):
    engine, _ = served
    new_dir, want = _checkpoint(tokenizer, tmp_path, 2)
    recv = sender.receiver(StreamSink(engine, engine.named_tensors()))
    reloads = engine.reloads
    _, error = sender.update(recv, new_dir, 1)
    assert error is None and engine.reloads == reloads + 1
    n = len(sender.plan.buckets)
    # vLLM had loaded every tensor bucket k completed (a reload: and asked for more) before bucket k+1 came
    assert engine.stream_log == [(e, k) for k in range(n) for e in ("delivered", "taken")]
    assert _greedy(engine, tokenizer) == want


def test_vllm_update_aborted_midway_serves_the_old_weights_and_version(served, sender, tokenizer, tmp_path,
                                                                      restore, load_mode):
    engine, _ = served
    first, _ = _checkpoint(tokenizer, tmp_path / "v1", 1)
    recv = sender.receiver(StreamSink(engine, engine.named_tensors()))
    assert sender.update(recv, first, 1)[1] is None
    served_v1 = _greedy(engine, tokenizer)
    second, want = _checkpoint(tokenizer, tmp_path / "v2", 2)
    last = {n: max(k for k, b in enumerate(sender.plan.buckets) for p in b if p.name == n) for n in sender.plan.tensors}
    qkv = [last[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]
    # the bucket that would complete layer 1's fused q/k/v: part of that layer is in vLLM's parameters (direct) or
    # held by its reload, and the layers before it are written
    bad = max(qkv)
    assert min(qkv) < bad and bad > 1
    _, error = sender.update(recv, second, 2, corrupt=bad)
    assert error is not None and "checksum" in error
    # vLLM had taken update 2 up to bucket `bad`: all rolled back
    assert ("taken", bad - 1) in engine.stream_log and ("taken", bad) not in engine.stream_log
    assert recv.consistent and recv.version == engine.weights_version == 1
    assert _greedy(engine, tokenizer) == served_v1 != want
    assert sender.update(recv, second, 2)[1] is None  # the next attempt goes through
    assert _greedy(engine, tokenizer) == want


def test_vllm_refuses_a_mismatched_update_version(served, sender, tokenizer, tmp_path, restore):
    engine, _ = served
    new_dir, _ = _checkpoint(tokenizer, tmp_path, 1)
    recv = sender.receiver(StreamSink(engine, engine.named_tensors()))
    assert sender.update(recv, new_dir, 5)[1] is None
    served_v5, reloads = _greedy(engine, tokenizer), engine.reloads
    _, error = sender.update(recv, new_dir, 6, claim=7)  # the buckets say 6, the sender announces 7
    assert error is not None and "holds bucket 0 of update 6" in error
    _, error = sender.update(recv, new_dir, 4)  # older than what vLLM serves
    assert error is not None and "older than" in error
    assert engine.reloads == reloads and engine.weights_version == 5 and recv.consistent
    engine.begin(6)
    with pytest.raises(vllm_weights.VersionMismatchError, match="update 7 reached vLLM while update 6"):
        engine.feed(7, 0, {})
    with pytest.raises(RuntimeError, match="streaming"):
        engine.generate(_prompts(tokenizer), SamplingParams(0.0, 4))
    engine.abort()
    assert engine.weights_version == 5 and _greedy(engine, tokenizer) == served_v5


@pytest.fixture
def views(served, sender, restore):
    """The served engine taking updates as on a GPU (``ipc_views``): its worker maps the sender's IPC buffers and
    loads each bucket from views of them (shared memory here, the trainer rank's CUDA buffer on a GPU)."""
    engine, _ = served
    engine.ipc_views = True
    sources = engine.attach_ipc([sender.handles])
    yield sources
    engine.ipc_views = False


def test_vllm_update_from_ipc_views_serves_the_checkpoint_and_keeps_no_copy(served, sender, tokenizer, tmp_path,
                                                                            views, load_mode):
    """B2: every bucket is loaded where it lies (whole tensors as views, split ones assembled), one load per update
    taking each bucket before the next; nothing of the weights is kept on the host or by the receiver."""
    engine, _ = served
    assert views == [f"shm:{sender.handles[0][1]}"]
    meta = engine.named_tensors()
    assert set(meta) == set(sender.plan.tensors) and all(t.is_meta for t in meta.values())
    new_dir, want = _checkpoint(tokenizer, tmp_path, 1)
    recv = sender.receiver(ViewSink(engine, meta))
    reloads = engine.reloads
    _, error = sender.update(recv, new_dir, 3)
    assert error is None and recv.version == engine.weights_version == 3 and engine.reloads == reloads + 1
    assert _greedy(engine, tokenizer) == want
    n = len(sender.plan.buckets)
    assert engine.stream_log == [(e, k) for k in range(n) for e in ("delivered", "taken")]
    assert engine.llm.collective_rpc("ipc_held_bytes") == [0]  # every split tensor was completed and let go
    assert recv.tensors is meta  # a view sink holds descriptions only: no journal, no spare copy
    with pytest.raises(RuntimeError, match="keeps no host copy"):
        engine.served_weights()
    with pytest.raises(RuntimeError, match="keeps no copy of its weights to send"):
        recv.pack(0, 0)


def test_vllm_update_from_ipc_views_that_fails_midway_serves_nothing_until_a_complete_one(
        served, sender, tokenizer, tmp_path, views, load_mode):
    """Without a host copy there is nothing to roll back to: the replica refuses to generate (and its receiver says
    it is not consistent) until the next complete update, which then serves exactly."""
    engine, _ = served
    first, _ = _checkpoint(tokenizer, tmp_path / "v1", 1)
    recv = sender.receiver(ViewSink(engine, engine.named_tensors()))
    assert sender.update(recv, first, 1)[1] is None
    second, want = _checkpoint(tokenizer, tmp_path / "v2", 2)
    _, error = sender.update(recv, second, 2, corrupt=len(sender.plan.buckets) // 2)
    assert error is not None and "checksum" in error
    assert not recv.consistent and recv.version == 1
    with pytest.raises(RuntimeError, match="no weights to serve"):
        engine.generate(_prompts(tokenizer), SamplingParams(0.0, 4))
    assert sender.update(recv, second, 2)[1] is None and recv.consistent
    assert _greedy(engine, tokenizer) == want


def test_vllm_loads_run_inside_vllms_config_scope(served):
    """A7: vLLM's layer-wise reload and the direct loads run with the worker's config current
    (``set_current_vllm_config``), as vLLM's own reload_weights does; outside them none is set."""
    from vllm.config import get_current_vllm_config_or_none

    engine, model = served
    state = hub_state(model)
    seen = {}

    class Recorded(list):
        def __iter__(self):
            seen.setdefault("direct", get_current_vllm_config_or_none())
            return super().__iter__()

    def probe(worker):
        def pairs():
            seen["reload"] = get_current_vllm_config_or_none()
            yield from state.items()

        worker.reload_from(pairs())
        worker.stream_begin(-1, "direct")
        worker.stream_feed(0, Recorded(state.items()))
        assert worker.stream_end() is None
        return worker.vllm_config

    assert get_current_vllm_config_or_none() is None
    [config] = engine.llm.collective_rpc(probe)  # tensor parallel 1: the worker is in this process
    assert seen["reload"] is config and seen["direct"] is config
    assert get_current_vllm_config_or_none() is None


def test_vllm_sleep_level_two_wakes_in_two_steps_around_the_update(served, tokenizer, restore):
    """B4: after a level-2 sleep the weights wake first (an update may fill them; generating is refused while the
    KV cache sleeps), then the KV cache; an update into sleeping weights is refused."""
    engine, model = served
    before = _greedy(engine, tokenizer)
    engine.sleep(2)
    assert engine.asleep == {"weights", "kv_cache"}
    with pytest.raises(RuntimeError, match="weights are asleep"):
        engine.begin(0)
    engine.wake_up(kv_cache=False)
    assert engine.asleep == {"kv_cache"} and engine.sleeping == 2
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache\)"):
        engine.generate(_prompts(tokenizer), SamplingParams(0.0, 4))
    engine.load_weights(iter(hub_state(model).items()))
    engine.wake_up()
    assert engine.asleep == set() and engine.sleeping == 0
    assert _greedy(engine, tokenizer) == before


def test_vllm_partial_rollout_pauses_at_the_budget_and_resumes_with_the_same_prefix(served, tokenizer):
    engine, model = served
    prompts = _prompts(tokenizer)
    params = SamplingParams(1.0, 32, ignore_eos=True)
    requests = [(p, params, 50 + i) for i, p in enumerate(prompts)]
    finished, paused = generate_with_budget(engine, requests, [], token_budget=20)
    assert not finished and len(paused) == len(prompts) and not engine.has_unfinished()
    assert all(0 < len(c.token_ids) < 32 and c.finish_reason is None for c in paused)
    finished, still = generate_with_budget(engine, [], paused, token_budget=None)
    assert not still and sorted(c.request_id for c in finished) == [50, 51, 52, 53]
    by_id = {c.request_id: c for c in paused}
    for c in finished:
        assert len(c.token_ids) == 32 and c.token_ids[: len(by_id[c.request_id].token_ids)] == \
            by_id[c.request_id].token_ids
    ref = _trainer_logprobs(model, [c.prompt_ids for c in finished], [c.token_ids for c in finished], 1.0)
    for c, r in zip(finished, ref, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), r, atol=1e-4, rtol=0)


def test_vllm_constrained_tool_calls_are_valid_and_the_native_engines_under_greedy(served, tokenizer):
    """A tool-call constraint (xgrammar structural tag) reaches vLLM's structured outputs: every sampled token is
    one the grammar allows (checked by the project's own matcher), a response that stops is a valid call section
    ending with EOS, and greedy decoding under it gives the native engine's tokens."""
    from engines.inference.constrained import ConstraintCompiler
    from envs.tools import parse_tool_calls
    from tests.test_tool_calling import TOOLS

    engine, model = served
    grammar = ConstraintCompiler(tokenizer, engine.vocab_size).tool_calls(TOOLS, max_calls=1)
    prompt = tokenizer.encode("Read f1.py.")
    outs = engine.generate([prompt] * 6, SamplingParams(1.0, 230, grammar=grammar, seed=3))
    for c in outs:
        m = grammar.matcher()
        assert c.finish_reason in ("stop", "length") and all(m.accept(t) for t in c.token_ids), c.error or c
        if c.finish_reason == "stop":
            calls, errors = parse_tool_calls(tokenizer.decode(c.token_ids), TOOLS)
            assert errors == [] and len(calls) == 1 and c.token_ids[-1] == tokenizer.eos_id and m.is_terminated()
    assert any(c.finish_reason == "stop" for c in outs)
    greedy = SamplingParams(0.0, 230, grammar=grammar)
    native = InferenceEngine(model, tokenizer.eos_ids, tokenizer.pad_id).generate([prompt], greedy)
    assert [c.token_ids for c in engine.generate([prompt], greedy)] == [c.token_ids for c in native]


def test_vllm_sleep_keeps_the_contract(served, tokenizer):
    engine, _ = served
    prompt = _prompts(tokenizer)[:1]
    engine.add_request(prompt[0], SamplingParams(0.0, 4))
    with pytest.raises(RuntimeError, match="pause"):
        engine.sleep(1)
    engine.pause()
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompt, SamplingParams(0.0, 4))
    engine.wake_up()
    assert engine.generate(prompt, SamplingParams(0.0, 4))[0].finish_reason in ("stop", "length")


def test_vllm_refuses_what_it_cannot_serve_with_one_clear_line(served, tokenizer):
    engine, _ = served
    out = engine.generate([[], [10**6], _prompts(tokenizer)[0]], SamplingParams(0.0, 4))
    assert [c.finish_reason for c in out] == ["error", "error", out[2].finish_reason]
    assert out[0].error == "prompt is empty" and "outside the vocabulary" in out[1].error


def test_vllm_missing_is_one_line_saying_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(vllm_engine.VllmUnavailableError, match="pip install vllm"):
        vllm_engine.VllmEngine(tmp_path, [0])


VLLM_ARCH = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1}  # head_dim 32, the smallest vLLM's CPU attention serves


def _vllm_run(**sections):
    from tests.test_run import TINY

    raw = json.loads(json.dumps(TINY))
    raw["warmstart"]["architecture"] = dict(VLLM_ARCH)
    raw["rollout"].update(engine="vllm", kv_cache_mb=64)
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return parse_config(raw)


def test_vllm_replica_gets_the_trainers_weights_through_the_checkpoint_engine(ray_cluster, tokenizer):
    """Train a step, update through the checkpoint engine's IPC buffers (many small buckets, tensors split
    across them): the vLLM replica then holds the trainer's weights bit for bit and generates exactly what
    the native engine generates on them."""
    cfg = _vllm_run(rollout={"sleep_level": 2})
    model_dir = prepare_model(cfg)
    with Cluster(for_model(cfg, str(model_dir)), str(model_dir)) as cluster:
        assert cluster.num_buckets > 3
        before = ray.get(cluster.rollouts[0].state_dict.remote())
        prompts, params = [[5, 6, 7]] * 4, [SamplingParams(1.0, 8)] * 4
        cluster.trainers.offload()
        outs = cluster.rollouts.generate(prompts, params, seed=0)
        cluster.rollouts.sleep()
        cluster.trainers.onload()
        train_on(cluster, [make_sample(0, o.prompt_ids, o.token_ids, o.logprobs, float(i % 2))
                           for i, o in enumerate(outs)])
        cluster.trainers.offload()
        trained = ray.get(cluster.trainers[0].state_dict.remote())
        assert any(not torch.equal(trained[k], before[k]) for k in trained)
        cluster.rollouts.wake()
        cluster.rollouts.update_weights()
        after = ray.get(cluster.rollouts[0].state_dict.remote())
        greedy = [SamplingParams(0.0, 12)] * 4
        got = cluster.rollouts.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], greedy, seed=0)
    assert set(after) == set(trained) and all(torch.equal(after[k], trained[k]) for k in trained)
    model = load_pretrained(model_dir)
    model.load_state_dict({k: v for k, v in trained.items()}, strict=False)
    tok = TextTokenizer.load(model_dir)
    want = InferenceEngine(model.eval(), tok.eos_ids, tok.pad_id).generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]],
                                                                           greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_vllm_replica_on_ipc_views_is_filled_by_the_trainers_and_refilled_after_a_level_two_sleep(
        ray_cluster, tokenizer):
    """The GPU defaults on vLLM's CPU build (B2, B4, B5, A5): a replica that loads from views of the IPC buffers
    starts on placeholder weights and the trainers' start-up stream fills it; after a level-2 sleep it wakes its
    weights only (generating is refused until the KV cache is back), an iteration without an optimizer step
    refills the same weights, and a step's update serves the trained weights: each time the native engine's tokens
    on the same weights."""
    cfg = _vllm_run(rollout={"sleep_level": 2})
    model_dir = prepare_model(cfg)
    settings = for_model(cfg, str(model_dir))
    engine = dataclasses.replace(settings.rollout.engine, ipc_views=True)
    settings = dataclasses.replace(settings, rollout=dataclasses.replace(settings.rollout, engine=engine))
    prompts, greedy = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], [SamplingParams(0.0, 12)] * 4
    tok = TextTokenizer.load(model_dir)

    def native(state=None):
        model = load_pretrained(model_dir)
        if state is not None:
            model.load_state_dict(state, strict=False)
        return InferenceEngine(model.eval(), tok.eos_ids, tok.pad_id).generate(prompts, greedy)

    def same(got, want):  # the same tokens, and log-probs to float32 rounding (different kernels)
        return [c.token_ids for c in got] == [c.token_ids for c in want] and all(
            torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
            for a, b in zip(got, want, strict=True))

    with Cluster(settings, str(model_dir)) as cluster:
        start = cluster.rollouts.generate(prompts, greedy, seed=0)
        cluster.rollouts.sleep()
        cluster.rollouts.wake()
        with pytest.raises(ray.exceptions.RayTaskError, match=r"asleep \(kv_cache\)"):
            ray.get(cluster.rollouts[0].generate.remote(prompts, greedy, 0))
        cluster.rollouts.update_weights(changed=False)  # no optimizer step: the same weights again
        assert cluster.rollouts.weights_version() == 0
        again = cluster.rollouts.generate(prompts, greedy, seed=0)
        outs = cluster.rollouts.generate(prompts, [SamplingParams(1.0, 8)] * 4, seed=0)
        cluster.rollouts.sleep()
        train_on(cluster, [make_sample(0, o.prompt_ids, o.token_ids, o.logprobs, float(i % 2))
                           for i, o in enumerate(outs)])
        trained = ray.get(cluster.trainers[0].state_dict.remote())
        cluster.rollouts.wake()
        cluster.rollouts.update_weights()
        after = cluster.rollouts.generate(prompts, greedy, seed=0)
        assert cluster.rollouts.weights_version() == 1
    assert same(start, native()) and same(again, native())
    assert same(after, native(trained)) and not same(after, native())


@pytest.mark.slow
def test_vllm_run_trains_and_every_update_reaches_the_sampler(ray_cluster, tmp_path):
    """A run with rollout.engine vllm: the sampler's log-probs agree with the trainer's recompute to float32
    rounding in every iteration, which holds only if each update reached vLLM."""
    from tests.test_difficulty import EvenLength  # noqa: F401  (registers "even-length-test": rewards vary)

    cfg = _vllm_run(run={"iterations": 4, "eval_every": 4, "save_every": 4})
    cfg = cfg.model_copy(update={"envs": parse_config({"envs": [
        {"name": "arithmetic", "weight": 0.01, "num_train": 50, "num_eval": 8},
        {"name": "even-length-test", "weight": 1, "num_train": 50, "num_eval": 8}]}).envs})
    train(cfg, tmp_path / "run")
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and sum(r["optimizer_steps"] for r in recs) > 0
    assert all(r["logprob_diff_mean"] < 1e-5 for r in recs)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["iterations"] == 4


def test_vllm_side_by_side_benchmark_prints_both_engines(capsys):
    """`python -m benchmarks.rollout --workload rl --engine both --json`: one JSON line with both engines'
    throughput, their ratio and whether they produced the same tokens."""
    from benchmarks.rollout import main

    main(["--workload", "rl", "--engine", "both", "--prompts", "2", "--samples", "2", "--json"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["native_tok_s"] > 0 and rec["vllm_tok_s"] > 0 and rec["sequences"] == 4
    assert rec["native_over_vllm"] == pytest.approx(rec["native_tok_s"] / rec["vllm_tok_s"], rel=0.01)
    assert rec["same_tokens"] is (rec["identical_sequences"] == 4)
    # B8: like with like, both eager on a CPU (both with decode graphs on a GPU)
    assert rec["device"] == "cpu" and rec["native_mode"] == rec["vllm_mode"] == "eager"
