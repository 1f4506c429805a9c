"""Partial rollout: budgeted generation on the real engine, pause/resume across a weight update
(segments and their logprobs against a full recompute), and the buffer of unfinished groups."""

import copy
import json
from dataclasses import replace

import pytest
import torch

from engines.inference.native import InferenceEngine
from engines.inference.requests import Completion
from engines.inference.sampling import SamplingParams
from engines.training.engine import TrainingEngine
from rl.algo.schedules import Schedule
from rl.rollout.partial import PartialRolloutBuffer, advance, generate_with_budget
from rl.sample import Sample, TaskType

KIND = TaskType("text", 12, 0.0, Schedule("constant", 1.0, 1.0, 10))

TEXTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens."]


def engine(model, tok, **kw):
    return InferenceEngine(model, tok.eos_id, tok.pad_id, detokenize=tok.decode, **kw)


def recompute(model, prompt, response, temperature=1.0):
    """Per-token logprobs of ``response`` from one full forward of the trainer."""
    with torch.no_grad():
        lp, mask = TrainingEngine(model, [], 0).response_logprobs([prompt], [response], temperature)
    return lp[0][mask[0]]


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
    assert all(t.response_ids == [] for t in run)  # advance returns updated copies
    buf.record(results)
    prior = {t.key: len(t.response_ids) for t in trajs}
    assert all(r.status == "paused" for r in results) and sorted(prior.values()) == [0, 2, 2]
    assert buf.stats() == {"paused": 3, "resumed": 0, "dropped": 0, "waiting_groups": 1}
    old_model = copy.deepcopy(tiny_model)
    with torch.no_grad():  # the update lands in place, as the checkpoint engine writes it
        eng.named_tensors()["model.layers.0.mlp.down_proj.weight"].add_(0.3)
        eng.named_tensors()["lm_head.weight"].mul_(1.2)
    eng.weights_loaded()
    run, _ = buf.pending(1)
    results = advance(eng, run, None, version=1)
    buf.record(results)
    assert all(r.status == "truncated" for r in results)
    assert buf.stats() == {"paused": 0, "resumed": 3, "dropped": 0, "waiting_groups": 1}
    (group,) = buf.pop_complete()
    assert group == trajs and buf.in_flight_groups() == 0
    for t in trajs:
        assert len(t.response_ids) == len(t.logprobs) == 12 and t.status == "truncated"
        n = prior[t.key]
        assert t.segments == ([(0, 0), (2, 1)] if n else [(0, 1)])
        old = recompute(old_model, t.prompt_ids, t.response_ids)
        new = recompute(tiny_model, t.prompt_ids, t.response_ids)
        torch.testing.assert_close(torch.tensor(t.logprobs[:n]), old[:n], atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(t.logprobs[n:]), new[n:], atol=1e-5, rtol=0)
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
    """The trajectory ``held`` as the engine would hand it back with these tokens so far."""
    return held.extended(Completion(tokens, logprobs, reason, request_id=held.key, error=error), version)


def test_buffer_groups_age_stats_and_state_round_trip():
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
    assert trajs[3].error == "too long" and trajs[1].segments == [(0, 0)] and trajs[4].segments == []

    run, dropped = buf.pending(1)
    assert [t.key for t in run] == [1, 4] and dropped == []
    # a resumed request returns its prior tokens in front of the new ones
    buf.record([done(t[1], [7, 3], [-1.5, -0.75], version=4), done(t[4], [2], [-2.0], version=4)])
    assert (trajs[1].response_ids, trajs[1].logprobs, trajs[1].segments) == ([7, 3], [-1.5, -0.75],
                                                                              [(0, 0), (1, 4)])
    assert trajs[4].segments == [(0, 4)]
    assert buf.pop_complete() == [] and buf.in_flight_groups() == 2
    assert buf.stats() == {"paused": 2, "resumed": 2, "dropped": 0, "waiting_groups": 2}
    with pytest.raises(ValueError, match="does not continue"):
        done(t[1], [6, 3, 1], [0.0] * 3)
    stale = replace(t[1], response_ids=[6, 3, 1], logprobs=[0.0] * 3)
    with pytest.raises(ValueError, match="does not continue"):
        buf.record([stale])
    with pytest.raises(KeyError):
        buf.record([done(t[3], [1], [0.0])])

    state = json.loads(json.dumps(buf.state_dict()))
    copy_ = PartialRolloutBuffer(max_age=9)
    copy_.load_state_dict(state)
    assert copy_.state_dict() == buf.state_dict() and copy_.max_age == 1
    assert copy_.stats() == buf.stats()
    assert copy_.pending(1) == buf.pending(1)  # equal Sample objects: task type, params and segments rebuilt

    for b in (buf, copy_):  # past max_age: key 1 is dropped, group 0 completes with key 0; group 2 is gone
        run, dropped = b.pending(2)
        assert run == [] and [t.key for t in dropped] == [1, 4]
        assert b.stats() == {"paused": 0, "resumed": 0, "dropped": 2, "waiting_groups": 1}
        assert [[t.key for t in g] for g in b.pop_complete()] == [[0]]
        assert b.in_flight_groups() == 0 and b.pending(3) == ([], [])
