"""Partial rollout: budgeted generation on the real engine, pause/resume across a weight update
(segments and their logprobs against a full recompute), and the buffer of unfinished groups."""

import copy
import json
import zipfile

import numpy as np
import pytest
import torch

from engines.inference.native import InferenceEngine
from engines.inference.requests import Completion
from engines.inference.sampling import SamplingParams
from engines.model.images import ImageRef
from engines.training.engine import TrainingEngine
from rl.algo.schedules import Schedule
from rl.rollout.partial import PartialRolloutBuffer, load_state, save_state
from rl.rollout.turns import generate_with_budget, serve_turns
from rl.sample import Sample, TaskType, TurnResult

KIND = TaskType("text", 12, 0.0, Schedule("constant", 1.0, 1.0, 10))

TEXTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens."]


def engine(model, tok, **kw):
    return InferenceEngine(model, tok.eos_id, tok.pad_id, detokenize=tok.decode, **kw)


def recompute(model, prompt, response, temperature=1.0):
    """Per-token logprobs of ``response`` from one full forward of the trainer."""
    with torch.no_grad():
        lp, mask = TrainingEngine(model, [], 0).response_logprobs([prompt], [response], temperature)
    return lp[0][mask[0]]


def advance(eng, samples, token_budget, version):
    """The current turn of ``samples`` generated in this process until each ends or the budget is spent: each one's
    ``TurnResult`` (the samples are not modified; ``PartialRolloutBuffer.record`` appends the new tokens)."""
    return serve_turns(eng, {}, [s.turn_request() for s in samples], token_budget, version)[0]


def new_tokens(results, prior):
    return sum(len(c.token_ids) - prior.get(c.request_id, 0) for c in results)


def test_budget_pauses_after_the_budget_and_no_budget_finishes(tiny_model, tokenizer):
    prompts = [tokenizer.encode(TEXTS[i % 4]) for i in range(6)]
    lengths = [2, 3, 20, 20, 20, 20]
    params = [SamplingParams(1.0, n, ignore_eos=True, seed=40 + i) for i, n in enumerate(lengths)]
    requests = [(p, s, 100 + i) for i, (p, s) in enumerate(zip(prompts, params, strict=True))]
    ref = engine(tiny_model, tokenizer).generate(prompts, params)
    slots, budget = 4, 25
    eng = engine(tiny_model, tokenizer, max_num_seqs=slots)
    seen = []
    finished, paused = generate_with_budget(eng, requests, [], budget, on_finish=seen.append)
    assert not eng.has_unfinished()
    assert seen == finished
    assert budget <= new_tokens(finished + paused, {}) <= budget + slots
    assert sorted(c.request_id for c in finished + paused) == [100 + i for i in range(6)]
    assert {c.request_id for c in finished} == {100, 101}  # the short ones finish, the rest is cut
    for c in finished + paused:
        r = ref[c.request_id - 100]
        assert c.token_ids == r.token_ids[: len(c.token_ids)]
    assert all(c.finish_reason is None and len(c.token_ids) < 20 for c in paused)
    assert all(c.finish_reason == "length" for c in finished)

    finished, paused = generate_with_budget(engine(tiny_model, tokenizer, max_num_seqs=slots), requests, [], None)
    assert paused == []
    assert [c.token_ids for c in sorted(finished, key=lambda c: c.request_id)] == [r.token_ids for r in ref]


def test_budget_zero_pauses_everything_untouched(tiny_model, tokenizer):
    eng = engine(tiny_model, tokenizer)
    finished, paused = generate_with_budget(eng, [(tokenizer.encode(TEXTS[0]), SamplingParams(seed=1), 7)], [], 0)
    assert finished == [] and [(c.request_id, c.token_ids, c.finish_reason) for c in paused] == [(7, [], None)]
    with pytest.raises(ValueError, match="token_budget"):
        generate_with_budget(eng, [], [], -1)


def test_partials_are_served_before_new_requests(tiny_model, tokenizer):
    params = SamplingParams(1.0, 10, ignore_eos=True, seed=2)
    eng = engine(tiny_model, tokenizer, max_num_seqs=1)  # one slot: whoever is admitted first runs alone
    _, (old,) = generate_with_budget(eng, [(tokenizer.encode(TEXTS[0]), params, 0)], [], 2)
    fin, paused = generate_with_budget(eng, [(tokenizer.encode(TEXTS[1]), params, 1)], [old], 3)
    assert fin == [] and {c.request_id: len(c.token_ids) for c in paused} == {0: 5, 1: 0}


def test_resume_with_unchanged_weights_equals_one_uninterrupted_run(tiny_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS for _ in range(2)]
    params = [SamplingParams(0.8, 16, seed=7 + i) for i in range(len(prompts))]
    ref = engine(tiny_model, tokenizer).generate(prompts, params)
    eng = engine(tiny_model, tokenizer, max_num_seqs=3)
    requests = [(p, s, i) for i, (p, s) in enumerate(zip(prompts, params, strict=True))]
    done, partials, calls = [], [], 0
    while calls == 0 or partials:  # several pauses, each resuming where the last one stopped
        fin, partials = generate_with_budget(eng, requests if calls == 0 else [], partials, 10)
        done += fin
        calls += 1
        assert calls < 20
    assert calls >= 3 and len(done) == len(prompts)
    by_id = {c.request_id: c for c in done}
    for i, r in enumerate(ref):
        assert by_id[i].token_ids == r.token_ids and by_id[i].finish_reason == r.finish_reason
        torch.testing.assert_close(by_id[i].logprobs, r.logprobs, atol=1e-5, rtol=0)


def trajectories(prompts, params, group_size, started=0):
    return [Sample(key=i, group=i // group_size, task_index=i // group_size, task_type=KIND, prompt_ids=p, params=s,
                   started=started) for i, (p, s) in enumerate(zip(prompts, params, strict=True))]


def test_resumed_segment_uses_the_new_weights(tiny_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
    params = [SamplingParams(1.0, 12, ignore_eos=True, seed=3 + i) for i in range(3)]
    buf = PartialRolloutBuffer(max_age=2)
    trajs = trajectories(prompts, params, group_size=3)
    buf.add_group(trajs)
    # two slots and a budget of 4: two requests get 2 tokens, the third is never admitted
    eng = engine(tiny_model, tokenizer, max_num_seqs=2)
    run, _ = buf.pending(0)
    results = advance(eng, run, 4, version=0)
    assert all(len(t.response_ids) == 0 for t in run)  # advance returns the new tokens; record appends them
    buf.record(results)
    prior = {t.key: len(t.response_ids) for t in trajs}
    assert all(r.finish_reason is None for r in results) and all(t.status == "paused" for t in trajs)
    assert sorted(prior.values()) == [0, 2, 2]
    assert buf.stats() == {"paused": 3, "resumed": 0, "dropped": 0, "waiting_groups": 1}
    old_model = copy.deepcopy(tiny_model)
    with torch.no_grad():  # the update lands in place, as the checkpoint engine writes it
        eng.named_tensors()["model.layers.0.mlp.down_proj.weight"].add_(0.3)
        eng.named_tensors()["lm_head.weight"].mul_(1.2)
    eng.weights_loaded()
    run, _ = buf.pending(1)
    results = advance(eng, run, None, version=1)
    assert sorted(len(r.token_ids) for r in results) == [10, 10, 12]  # only the tokens generated in this call
    buf.record(results)
    assert all(r.finish_reason == "length" for r in results) and all(t.status == "truncated" for t in trajs)
    assert buf.stats() == {"paused": 0, "resumed": 3, "dropped": 0, "waiting_groups": 1}
    (group,) = buf.pop_complete()
    assert group == trajs and buf.in_flight_groups() == 0
    for t in trajs:
        assert len(t.response_ids) == len(t.logprobs) == 12 and t.status == "truncated"
        n = prior[t.key]
        assert t.segments.tolist() == ([[0, 0], [2, 1]] if n else [[0, 1]])
        old = recompute(old_model, t.prompt_ids.tolist(), t.response_ids.tolist())
        new = recompute(tiny_model, t.prompt_ids.tolist(), t.response_ids.tolist())
        torch.testing.assert_close(torch.tensor(t.logprobs[:n].tolist()), old[:n], atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(t.logprobs[n:].tolist()), new[n:], atol=1e-5, rtol=0)
        assert (new[n:] - old[n:]).abs().max() > 1e-3  # the update is large enough to tell them apart


def test_invalid_request_fails_alone(tiny_model, tokenizer):
    good = [tokenizer.encode(t) for t in TEXTS[:2]]
    params = SamplingParams(1.0, 16, seed=3)
    ref = engine(tiny_model, tokenizer).generate(good, params)
    eng = engine(tiny_model, tokenizer, max_seq_len=64)
    requests = [(good[0], params, 0), ([5] * 120, params, 1), (good[1], params, 2)]
    seen = []
    fin, paused = generate_with_budget(eng, requests, [], None, on_finish=seen.append)
    by_id = {c.request_id: c for c in fin}
    assert paused == [] and seen == fin and sorted(by_id) == [0, 1, 2]
    assert [by_id[0].token_ids, by_id[2].token_ids] == [c.token_ids for c in ref]
    bad = by_id[1]
    assert bad.finish_reason == "error" and "exceeds the model's context" in bad.error and bad.token_ids == []
    # a paused request that no longer fits comes back as an error with the tokens it had
    part = Completion([9, 9], [-1.0, -2.0], None, [5] * 60, request_id=4, params=params)
    fin, paused = generate_with_budget(eng, [(good[0], params, 5)], [part], None)
    assert paused == [] and {c.request_id: c.finish_reason for c in fin} == {4: "error", 5: "length"}
    assert "does not fit the KV cache" in fin[0].error and fin[0].token_ids == [9, 9]
    assert next(c for c in fin if c.request_id == 5).token_ids == ref[0].token_ids
    with pytest.raises(ValueError, match="not a paused"):
        generate_with_budget(eng, [], [bad], None)


def done(held, tokens, logprobs, reason=None, error=None, version=0):
    """The engine's result for the trajectory ``held``: the tokens it generated in this call."""
    return TurnResult(held.key, tokens, logprobs, reason, error, version)


def same_state(a, b):
    """Two ``state_dict``s are equal: their headers, and their arrays by dtype and value."""
    assert {k: v for k, v in a.items() if k != "arrays"} == {k: v for k, v in b.items() if k != "arrays"}
    assert a["arrays"].keys() == b["arrays"].keys()
    for k, x in a["arrays"].items():
        y = b["arrays"][k]
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k


def test_buffer_groups_age_stats_and_state_round_trip(tmp_path):
    p = SamplingParams(0.7, 8, stop=("\n",), seed=5)
    buf = PartialRolloutBuffer(max_age=1)
    trajs = trajectories([[1, 2]] * 5, [p] * 5, group_size=2)  # groups 0: keys 0,1; 1: keys 2,3; 2: key 4
    for g in range(3):
        buf.add_group(trajs[2 * g : 2 * g + 2])
    with pytest.raises(ValueError, match="already"):
        buf.add_group(trajs[:1])

    run, dropped = buf.pending(0)
    assert [t.key for t in run] == [0, 1, 2, 3, 4] and dropped == []
    t = trajs
    buf.record([done(t[0], [5, 6], [-0.5, -0.25], "stop"), done(t[1], [7], [-1.5]), done(t[2], [8], [-0.1], "length"),
                done(t[3], [], [], "error", "too long"), done(t[4], [], [])])
    assert [g[0].group for g in buf.pop_complete()] == [1]  # group 0 waits for key 1, group 2 for key 4
    assert buf.stats() == {"paused": 2, "resumed": 0, "dropped": 0, "waiting_groups": 2}
    assert trajs[3].error == "too long" and trajs[1].segments.tolist() == [[0, 0]] and len(trajs[4].segments) == 0

    run, dropped = buf.pending(1)
    assert [t.key for t in run] == [1, 4] and dropped == []
    # a resumed request's result carries only the tokens generated after its pause
    buf.record([done(t[1], [3], [-0.75], version=4), done(t[4], [2], [-2.0], version=4)])
    assert (trajs[1].response_ids.tolist(), trajs[1].logprobs.tolist(), trajs[1].segments.tolist()) == \
        ([7, 3], [-1.5, -0.75], [[0, 0], [1, 4]])
    assert trajs[4].segments.tolist() == [[0, 4]]
    assert buf.pop_complete() == [] and buf.in_flight_groups() == 2
    assert buf.stats() == {"paused": 2, "resumed": 2, "dropped": 0, "waiting_groups": 2}
    with pytest.raises(ValueError, match="3 tokens, 2 logprobs"):
        buf.record([done(t[1], [6, 3, 1], [0.0] * 2)])
    with pytest.raises(ValueError, match="already ended"):
        buf.record([done(t[0], [1], [0.0])])
    with pytest.raises(KeyError):
        buf.record([done(t[3], [1], [0.0])])
    assert trajs[1].response_ids.tolist() == [7, 3]  # a refused result appended nothing

    save_state(buf.state_dict(), tmp_path / "partial.npz")
    assert zipfile.is_zipfile(tmp_path / "partial.npz")  # binary: numpy's .npz
    copy_ = PartialRolloutBuffer(max_age=9)
    copy_.load_state_dict(load_state(tmp_path / "partial.npz"))
    same_state(copy_.state_dict(), buf.state_dict())
    assert copy_.max_age == 1 and copy_.stats() == buf.stats()
    assert copy_.pending(1) == buf.pending(1)  # equal Sample objects: task type, params and arrays rebuilt

    for b in (buf, copy_):  # past max_age: key 1 is dropped, group 0 completes with key 0; group 2 is gone
        run, dropped = b.pending(2)
        assert run == [] and [t.key for t in dropped] == [1, 4]
        assert b.stats() == {"paused": 0, "resumed": 0, "dropped": 2, "waiting_groups": 1}
        assert [[t.key for t in g] for g in b.pop_complete()] == [[0]]
        assert b.in_flight_groups() == 0 and b.pending(3) == ([], [])


def test_binary_state_reads_back_every_field_exactly(tmp_path):
    kind = TaskType("code", 9, -0.5, Schedule("cosine", 1.2, 0.4, 50))
    p = SamplingParams(0.9, 9, top_p=0.95, stop=("END",), seed=2**40 + 3)
    rng = np.random.default_rng(0)
    single = [Sample(10 + i, 3, 4, kind, rng.integers(0, 2**40, 5 + i), p, 2) for i in range(3)]
    for i, s in enumerate(single):  # log-probs that no short decimal writes exactly
        s.take(TurnResult(s.key, rng.integers(0, 50_000, 4 + i), -rng.random(4 + i) * np.pi, None, None, 7))
    single[1].take(TurnResult(11, [9], [-1 / 3], "stop", None, 8))
    single[1].reward = 0.1 + 0.2
    single[2].routed_experts = rng.integers(0, 64, (len(single[2].response_ids), 3, 2)).astype(np.int32)
    single[2].images = (ImageRef(path="/data/a.png"), ImageRef(data=bytes(range(256)) + b"\x00"))
    multi = Sample(20, 5, 1, kind, [1, 2, 3], p, 2, loss_mask=[], multi_turn=True)
    multi.take(TurnResult(20, [4, 5], [-0.25, -1e-300], "stop", None, 1))
    multi.observe([6, 7, 8])
    multi.turns, multi.params, multi.status = 1, SamplingParams(0.9, 4, seed=11), "running"
    multi.take(TurnResult(20, [], [], "error", "refused", 1))
    buf = PartialRolloutBuffer(max_age=3)
    buf.add_group(single)
    buf.add_group([multi])
    buf.pending(2)
    save_state(buf.state_dict(), tmp_path / "partial.npz")
    back = PartialRolloutBuffer(max_age=0)
    back.load_state_dict(load_state(tmp_path / "partial.npz"))
    got = [back.get(k) for k in (10, 11, 12, 20)]
    assert got == [*single, multi]
    for a, b in zip(got, [*single, multi], strict=True):
        for name in ("prompt_ids", "response_ids", "logprobs", "segments"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
        assert a.policy_logprob() == b.policy_logprob() and a.reward == b.reward
    assert got[0].loss_mask is None and got[3].loss_mask.tolist() == [1, 1, 0, 0, 0]
    assert got[3].status == "error" and got[3].turn_start == 5 and got[3].turns == 1 and got[3].params.max_tokens == 4
    assert got[2].routed_experts.dtype == np.int32 and got[0].images == ()
    assert [(im.path, im.data) for im in got[2].images] == [("/data/a.png", None), (None, bytes(range(256)) + b"\x00")]
    assert got[1].task_type == kind and got[1].params == p and back.stats() == buf.stats()


def old_sample(key, group, **kw):
    """A sample as the JSON checkpoints before arrays wrote it (``dataclasses.asdict`` of the list-based record)."""
    return {"key": key, "group": group, "task_index": 2, "started": 1, "multi_turn": False, "turn_start": 0,
            "turns": 0, "status": "paused", "reward": None, "error": None, "loss_mask": None,
            "task_type": {"name": "text", "max_tokens": 12, "truncation_penalty": -0.5,
                          "temperature": {"kind": "linear", "start": 1.0, "end": 0.5, "iterations": 10}},
            "params": {"temperature": 0.8, "max_tokens": 12, "seed": 7}, **kw}


def test_checkpoints_of_the_earlier_json_formats_still_load():
    state = json.loads(json.dumps({"max_age": 2, "iteration": 4, "counts": {"resumed": 1, "dropped": 0}, "groups": [
        [old_sample(1, 0, prompt_ids=[3, 4], response_ids=[5, 6, 7], logprobs=[-0.5, -0.1, -2.25],
                    segments=[[0, 1], [2, 3]]),
         old_sample(2, 0, prompt_ids=[3, 4], response_ids=[8], logprobs=[-1.5], segments=[[0, 3]],
                    status="truncated", reward=0.0)],
        [old_sample(5, 1, prompt_ids=[9], response_ids=[1, 2, 3], logprobs=[-1.0, 0.0, -0.5], loss_mask=[1, 0, 1],
                    segments=[[0, 0]], multi_turn=True, turn_start=2, turns=1)]]}))
    buf = PartialRolloutBuffer(max_age=0)
    buf.load_state_dict(state)
    a, b, c = (buf.get(k) for k in (1, 2, 5))
    kind = TaskType("text", 12, -0.5, Schedule("linear", 1.0, 0.5, 10))
    assert a == Sample(1, 0, 2, kind, [3, 4], SamplingParams(0.8, 12, seed=7), 1, [5, 6, 7], [-0.5, -0.1, -2.25],
                       segments=[(0, 1), (2, 3)], status="paused")
    assert a.response_ids.dtype == np.int64 and a.logprobs.dtype == np.float64 and a.segments.shape == (2, 2)
    assert b.status == "truncated" and b.reward == 0.0 and buf.in_flight_groups() == 2 and buf.max_age == 2
    assert c.loss_mask.tolist() == [1, 0, 1] and c.own_tokens() == 2 and c.policy_logprob() == -1.5
    assert buf.stats()["resumed"] == 1

    # the format before samples: paused trajectories, typed by their task index
    older = {"max_age": 1, "iteration": 0, "counts": {}, "groups": [[
        {"key": 3, "group": 0, "task_index": 6, "prompt_ids": [1], "params": {"temperature": 1.0, "max_tokens": 5},
         "started": 0, "token_ids": [4, 4], "logprobs": [-0.5, -0.5], "segments": [[0, 0]], "finish_reason": None}]]}
    with pytest.raises(ValueError, match="type_of"):
        buf.load_state_dict(older)
    buf.load_state_dict(older, type_of=lambda i: kind if i == 6 else None)
    (t,) = buf.pending(0)[0]
    assert t.status == "paused" and t.task_type == kind and t.response_ids.tolist() == [4, 4]


def test_a_sample_grows_in_place_and_what_was_read_stays_as_it_was():
    import pickle
    from dataclasses import replace

    s = Sample(1, 0, 0, KIND, [3, 4], SamplingParams(1.0, 8), 0, loss_mask=[], multi_turn=True)
    read, buffers = [], set()
    for turn in range(100):
        s.take(TurnResult(1, [turn % 50] * 3, [-0.5 * turn] * 3, "stop", None, turn))
        s.observe([7])
        s.status = "running"
        read.append((s.response_ids, s.response_ids.tolist(), s.logprobs, s.logprobs.tolist()))
        buffers.add(id(s.response_ids.base))
    # 400 tokens appended one turn at a time: the buffer doubled a few times, not a copy per turn
    assert len(s.response_ids) == 400 and len(buffers) <= 6
    assert all(ids.tolist() == ids_then and lps.tolist() == lps_then for ids, ids_then, lps, lps_then in read)
    assert s.loss_mask.tolist() == [1, 1, 1, 0] * 100 and s.segments[:, 0].tolist() == list(range(0, 400, 4))
    assert s.turn_start == 400 and s.own_tokens() == 300
    # a copy grows on its own; a pickle (Ray, deepcopy) carries the arrays, never the spare room behind them
    twin = replace(s)
    twin.observe([9, 9])
    s.observe([8])
    assert twin.response_ids[-3:].tolist() == [7, 9, 9] and s.response_ids[-2:].tolist() == [7, 8]
    back = pickle.loads(pickle.dumps(s))
    arrays = sum(a.nbytes for a in (s.prompt_ids, s.response_ids, s.logprobs, s.loss_mask, s.segments))
    assert back == s and back is not s and len(pickle.dumps(s)) < arrays + 2000
    with pytest.raises(ValueError, match="one sequence of token ids"):
        s.prompt_ids = [[1, 2]]


def test_an_update_staged_while_serving_changes_nothing_until_swapped(tiny_model, tokenizer):
    """Disaggregated (``checkpoint_engine.p2p``): an update arrives in the engine's spare copy while generation goes
    on; a round generated meanwhile is the old weights' (version 0), and after the swap the same responses go on under
    the new ones (version 1): segments and log-probs against a full recompute under each."""
    from checkpoint_engine.buckets import plan_buckets, spec_of
    from checkpoint_engine.engine import stage_bucket
    from checkpoint_engine.sinks import whole_sink
    from checkpoint_engine.trailer import TRAILER
    from checkpoint_engine.transfer import WeightReceiver

    prompts = [tokenizer.encode(t) for t in TEXTS[:2]]
    params = [SamplingParams(1.0, 12, ignore_eos=True, seed=3 + i) for i in range(2)]
    buf = PartialRolloutBuffer(max_age=2)
    trajs = trajectories(prompts, params, group_size=2)
    buf.add_group(trajs)
    old_model, new_model = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    eng = engine(tiny_model, tokenizer, max_num_seqs=2)
    buf.record(advance(eng, buf.pending(0)[0], 4, version=0))
    new = {n: t.clone() for n, t in eng.named_tensors().items()}
    with torch.no_grad():
        new["model.layers.0.mlp.down_proj.weight"].add_(0.3)
        new["lm_head.weight"].mul_(1.2)
        for n, t in new_model.state_dict().items():
            t.copy_(new[n])
    plan = plan_buckets([spec_of(n, t) for n, t in new.items()], 4096)
    receiver = WeightReceiver(plan, [], whole_sink(eng))
    receiver.defer_commit = True
    bucket = torch.empty(plan.bucket_bytes + TRAILER, dtype=torch.uint8)
    for k, pieces in enumerate(plan.buckets):
        stage_bucket(plan, pieces, new, {}, None, bucket, plan.used_bytes(k), 1, k, 0)
        receiver.load_from(k, 0, bucket, 1)
        if k == len(plan.buckets) // 2:  # a round in the middle of the update: the old weights still serve
            assert receiver.consistent
            buf.record(advance(eng, buf.pending(0)[0], 4, version=0))
    assert receiver.staged == 1 and receiver.version is None
    buf.record(advance(eng, buf.pending(0)[0], 2, version=0))  # and after it is complete, until the swap
    prior = {t.key: len(t.response_ids) for t in trajs}
    assert sorted(prior.values()) == [5, 5]
    receiver.commit_staged(1)
    buf.record(advance(eng, buf.pending(1)[0], None, version=1))
    (group,) = buf.pop_complete()
    for t in group:
        n = prior[t.key]
        segments = t.segments.tolist()  # one per round: three before the swap, all of version 0
        assert len(t.response_ids) == 12 and segments[-1] == [n, 1] and {v for _, v in segments[:-1]} == {0}
        old = recompute(old_model, t.prompt_ids.tolist(), t.response_ids.tolist())
        upd = recompute(new_model, t.prompt_ids.tolist(), t.response_ids.tolist())
        torch.testing.assert_close(torch.tensor(t.logprobs[:n].tolist()), old[:n], atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(t.logprobs[n:].tolist()), upd[n:], atol=1e-5, rtol=0)
        assert (upd[n:] - old[n:]).abs().max() > 1e-3
