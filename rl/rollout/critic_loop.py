"""Closed-loop critic refinement (report 3.2.2) inside the run.

After rewards, pairs of responses to the same verifiable prompt whose verifiable rewards differ are
shown to the policy acting as critic (order randomised against position bias), ``samples`` times
each. A judgment is rewarded 1 when it picks the response with the higher verifiable reward, 0
otherwise (a tie or an unparseable verdict included); these critic samples join the iteration's
training batch as their own prompt groups, so the same K1.5 update that improves the policy also
makes its judgments agree with verifiable signals, which then carries over to the rubric reward on
non-verifiable prompts. ``critic_agreement`` (the mean of those rewards) is logged every iteration.
"""

from __future__ import annotations

import random
from collections import defaultdict

from engines.inference.sampling import SamplingParams
from engines.model.text.tokenizer import TextTokenizer
from envs.rubric import build_pair_prompt, load_rubrics, parse_verdict
from rl.algo.schedules import Schedule
from rl.config import Config
from rl.rollout.data import GROUPS_PER_ITERATION
from rl.sample import Sample, TaskType
from rl.seeds import critic_training_seed

CRITIC_GROUP_OFFSET = 500_000  # critic groups of iteration it: it * GROUPS_PER_ITERATION + this + index


def critic_pairs(samples: list[Sample], n: int, rng: random.Random) -> list[tuple[Sample, Sample]]:
    """Up to ``n`` (better, worse) pairs of responses to the same prompt with different verifiable rewards."""
    by_group: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        if not s.multi_turn:  # single-turn responses only: a conversation is not one response
            by_group[s.group].append(s)
    candidates = []
    for members in by_group.values():
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if a.reward != b.reward:
                    candidates.append((a, b) if a.reward > b.reward else (b, a))
    rng.shuffle(candidates)
    return candidates[:n]


def critic_training_batch(rollouts, tok: TextTokenizer, cfg: Config, samples: list[Sample],
                          it: int) -> tuple[list[Sample], dict[str, float]]:
    """Critic samples for this iteration and the critic's agreement with the verifiable rewards."""
    c = cfg.algorithm.critic_training
    rng = random.Random(critic_training_seed(cfg.run.seed, it))
    pairs = critic_pairs(samples, c.pairs, rng)
    if not pairs:
        return [], {}
    rubrics = load_rubrics(c.rubrics)
    prompts, better_is_a = [], []
    for better, worse in pairs:
        swap = rng.random() < 0.5  # position bias: the better response is shown first half of the time
        a, b = (worse, better) if swap else (better, worse)
        prompts.append(build_pair_prompt(tok.decode(better.prompt_ids.tolist()), tok.decode(a.response_ids.tolist()),
                                         tok.decode(b.response_ids.tolist()), rubrics))
        better_is_a.append(not swap)
    ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(c.temperature, c.max_tokens)
    outs = rollouts.generate([p for p in ids for _ in range(c.samples)], [params] * (len(ids) * c.samples),
                            seed=rng.randrange(2**31))
    kind = TaskType("critic_training", c.max_tokens, 0.0, Schedule("constant", c.temperature, c.temperature, 1))
    out, refused, unparseable = [], 0, 0
    for n, comp in enumerate(outs):
        p = n // c.samples
        if comp.finish_reason == "error":
            refused += 1
            continue
        verdict = parse_verdict(tok.decode(comp.token_ids))
        unparseable += verdict is None
        right = "A" if better_is_a[p] else "B"
        group = it * GROUPS_PER_ITERATION + CRITIC_GROUP_OFFSET + p
        out.append(Sample(group * c.samples + n % c.samples, group, -1, kind, ids[p], params, it,
                          list(comp.token_ids), list(comp.logprobs), status="finished",
                          reward=float(verdict == right)))
    stats = {"critic_prompts": len(pairs), "critic_agreement": sum(s.reward for s in out) / max(1, len(out)),
             "critic_unparseable": unparseable / max(1, len(out)), "critic_refused": refused}
    return out, stats
