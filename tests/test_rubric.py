"""The self-critique rubric reward: rubric files, critic prompts and verdicts, pairwise aggregation,
position randomisation, closed-loop critic samples and the group-level environment."""

import itertools
import re

import numpy as np
import pytest

from envs import Task, make, registered
from envs.rubric import (
    GroupLevelRewardError,
    Judgments,
    PairJudgment,
    PairwiseCritic,
    RubricEnv,
    bradley_terry,
    build_pair_prompt,
    critic_agreement,
    critic_training_samples,
    expected_win_rate,
    load_rubrics,
    parse_verdict,
    win_rate,
)

_RESP = re.compile(r"## Response A\n(.*?)\n\n## Response B\n(.*?)\n\n## Your task", re.S)


def shown(critic_prompt: str) -> tuple[str, str]:
    """The two responses as the critic prompt shows them."""
    return _RESP.search(critic_prompt).groups()


def by_quality(prompts: list[str]) -> list[str]:
    """A deterministic critic: the response with the larger number after 'q=' wins; equal is a tie."""
    outs = []
    for p in prompts:
        a, b = (int(x.split("q=")[1]) for x in shown(p))
        outs.append("Fine.\nVerdict: " + ("A" if a > b else "B" if b > a else "tie"))
    return outs


def simulate(strengths, games_per_pair, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i, j in itertools.combinations(range(len(strengths)), 2):
        p = strengths[i] / (strengths[i] + strengths[j])
        out += [(i, j, float(rng.random() < p)) for _ in range(games_per_pair)]
    return out


def penalised_loglik(theta, outcomes, prior):
    """The BT log-likelihood bradley_terry maximises: games plus ``prior`` half-won games vs strength 1."""
    theta = np.atleast_2d(theta)
    ll = np.zeros(theta.shape[0])
    for i, j, s in outcomes:
        d = theta[:, i] - theta[:, j]
        ll += s * -np.logaddexp(0, -d) + (1 - s) * -np.logaddexp(0, d)
    ll += (prior / 2 * (-np.logaddexp(0, -theta) - np.logaddexp(0, theta))).sum(axis=1)
    return ll


def newton_reference(n, outcomes, prior, steps=100):
    """Independent maximiser of ``penalised_loglik`` by Newton's method in log-strengths."""
    theta = np.zeros(n)
    for _ in range(steps):
        g, h = np.zeros(n), np.zeros((n, n))
        for i, j, s in outcomes:
            q = 1 / (1 + np.exp(-(theta[i] - theta[j])))
            g[i] += s - q
            g[j] -= s - q
            w = q * (1 - q)
            h[i, i] -= w
            h[j, j] -= w
            h[i, j] += w
            h[j, i] += w
        q0 = 1 / (1 + np.exp(-theta))
        g += prior * (0.5 - q0)
        h -= np.diag(prior * q0 * (1 - q0))
        theta -= np.linalg.solve(h, g)
    return theta


def test_rubric_files_load_with_the_report_ids():
    core, presc = load_rubrics(["core"]), load_rubrics(["prescriptive"])
    assert [r.id for r in core] == ["clarity_and_relevance", "conversational_fluency_and_engagement",
                                    "objective_and_grounded_interaction"]
    assert [r.id for r in presc] == ["initial_praise", "explicit_justification"]
    assert all(r.mandatory for r in presc) and not any(r.mandatory for r in core)
    assert [r.title for r in presc] == ["Initial Praise", "Explicit Justification"]
    assert all(len(r.description) > 40 and "\n" not in r.description for r in core + presc)
    extra = ["Must mention the capital city.", {"id": "x", "title": "Rhyme", "description": "It rhymes."}]
    both = load_rubrics(extra=extra)
    assert [r.id for r in both][-2:] == ["prompt_0", "x"] and len(both) == 7


def test_pair_prompt_has_rubrics_responses_and_verdict_format():
    rubrics = load_rubrics(extra=["Answer in exactly three lines."])
    text = build_pair_prompt("Write a haiku.", "first one", "second one", rubrics)
    for r in rubrics:
        assert r.title in text and r.description in text
    assert "Answer in exactly three lines." in text and "Initial Praise (mandatory)" in text
    assert shown(text) == ("first one", "second one")
    assert "Verdict: A" in text and "Verdict: tie" in text


def test_per_prompt_rubrics_reach_the_critic():
    seen = []
    critic = PairwiseCritic(lambda ps: seen.extend(ps) or ["Verdict: tie"] * len(ps), load_rubrics())
    critic.judge("p", ["q=1", "q=2"], extra_rubrics="Cite the 1998 treaty.")
    env = RubricEnv(generate=lambda ps: seen.extend(ps) or ["Verdict: tie"] * len(ps))
    env.score_group(Task("t", "p", "", {"rubrics": [{"title": "Tone", "description": "Stay warm and brief."}]}),
                    ["q=1", "q=2"])
    assert "Cite the 1998 treaty." in seen[0] and "Tone [prompt_0]: Stay warm and brief." in seen[1]


@pytest.mark.parametrize(("text", "want"), [
    ("reasoning...\nVerdict: A", "A"),
    ("Verdict: b.", "B"),
    ("**Verdict:** Tie", "tie"),
    ("Verdict: Response A", "A"),
    ("Verdict: A\nOn reflection...\nVerdict: B", "B"),
    ("  verdict : [A]  ", "A"),
    ("I prefer A.", None),
    ("Verdict: A or B", None),
    ("Verdict: C", None),
    ("Verdict:", None),
    ("", None),
    ("The verdict: A is better because", None),
])
def test_parse_verdict(text, want):
    assert parse_verdict(text) == want


def test_bradley_terry_recovers_order_and_matches_newton():
    true = np.array([0.3, 0.6, 1.0, 2.0, 4.0, 8.0])
    outcomes = simulate(true, 150, seed=1)
    p = bradley_terry(6, outcomes, prior=1.0, iters=5000, tol=1e-12)
    assert list(np.argsort(p)) == list(range(6))
    ref = newton_reference(6, outcomes, prior=1.0)
    np.testing.assert_allclose(np.log(p), ref, atol=1e-6)
    np.testing.assert_allclose(np.log(p / p[2]), np.log(true / true[2]), atol=0.35)


def test_bradley_terry_matches_a_brute_force_grid_for_three():
    outcomes = [(0, 1, 1.0), (0, 1, 1.0), (0, 1, 0.0), (1, 2, 1.0), (0, 2, 0.5), (2, 0, 0.0), (1, 2, 0.0)]
    p = bradley_terry(3, outcomes, prior=0.5, iters=5000, tol=1e-12)
    axis = np.linspace(-3, 3, 121)
    grid = np.stack(np.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    best = grid[np.argmax(penalised_loglik(grid, outcomes, prior=0.5))]
    np.testing.assert_allclose(np.log(p), best, atol=0.05 + 1e-9)
    assert penalised_loglik(np.log(p), outcomes, 0.5)[0] >= penalised_loglik(best, outcomes, 0.5)[0] - 1e-9


def test_undefeated_response_gets_a_finite_top_score():
    outcomes = [(0, 1, 1.0), (0, 2, 1.0), (0, 3, 1.0), (1, 2, 1.0), (2, 3, 0.5), (1, 3, 0.0)]
    p = bradley_terry(4, outcomes)
    assert np.all(np.isfinite(p)) and np.all(p > 0)
    r = expected_win_rate(p)
    assert r.argmax() == 0 and 0.5 < r[0] < 1 and np.all((r >= 0) & (r <= 1))
    with pytest.raises(ValueError, match="prior"):
        bradley_terry(2, [(0, 1, 1.0)], prior=0.0)


def test_ties_count_as_half_wins():
    all_ties = [(i, j, 0.5) for i, j in itertools.combinations(range(4), 2)]
    np.testing.assert_allclose(expected_win_rate(bradley_terry(4, all_ties)), 0.5)
    np.testing.assert_allclose(win_rate(4, all_ties), 0.5)
    # a tie is worth exactly one win and one loss
    tie = bradley_terry(3, [(0, 1, 0.5), (0, 2, 1.0)])
    split = bradley_terry(3, [(0, 1, 1.0), (0, 1, 0.0), (0, 2, 1.0)])
    assert tie[0] > tie[1] and tie[0] > tie[2]
    assert expected_win_rate(tie)[0] > 0.5
    assert np.all(np.isfinite(split))


def test_win_rate_on_a_hand_made_table():
    outcomes = [(0, 1, 1.0), (0, 2, 1.0), (1, 2, 0.5), (2, 0, 1.0), (1, 3, 0.0)]
    # 0: W L W -> 2/3; 1: L T L -> 0.5/3; 2: L T W -> 1.5/3; 3: W -> 1; 4 never compared -> 0.5
    np.testing.assert_allclose(win_rate(5, outcomes), [2 / 3, 0.5 / 3, 0.5, 1.0, 0.5])


def test_critic_ranks_responses_and_both_aggregates_agree_on_order():
    responses = [f"answer q={q}" for q in (3, 1, 4, 2)]
    for aggregate in ("bradley_terry", "win_rate"):
        jd = PairwiseCritic(by_quality, load_rubrics(), aggregate=aggregate, seed=3).judge("p", responses)
        assert len(jd.pairs) == 6 and list(np.argsort(jd.rewards)) == [1, 3, 0, 2]
        assert np.all((jd.rewards >= 0) & (jd.rewards <= 1))
    assert (jd.strengths is None) and jd.aggregate == "win_rate"
    with pytest.raises(ValueError, match="aggregate"):
        PairwiseCritic(by_quality, aggregate="elo")


def test_verdicts_map_back_through_the_shown_order():
    critic = PairwiseCritic(by_quality, load_rubrics(), seed=0)
    seen_swapped = set()
    for _ in range(20):
        jd = critic.judge("p", ["x q=1", "y q=5"])
        (pair,) = jd.pairs
        seen_swapped.add(pair.swapped)
        assert (pair.i, pair.j) == (0, 1) and {pair.a, pair.b} == {0, 1}
        assert shown(pair.prompt) == (["x q=1", "y q=5"][pair.a], ["x q=1", "y q=5"][pair.b])
        assert pair.verdict == ("A" if pair.swapped else "B") and pair.winner == 1 and pair.score == 0.0
        assert jd.outcomes == [(0, 1, 0.0)] and jd.rewards[1] > jd.rewards[0]
    assert seen_swapped == {True, False}
    # and directly: a swapped pair's "A" is response j
    p = PairJudgment(i=2, j=5, a=5, b=2, prompt="", output="Verdict: A", verdict="A")
    assert p.swapped and p.winner == 5 and p.score == 0.0


def test_position_randomisation_cancels_an_always_A_critic():
    critic = PairwiseCritic(lambda ps: ["Verdict: A"] * len(ps), load_rubrics(), seed=7)
    rewards, swapped, total = [], 0, 0
    for _ in range(300):
        jd = critic.judge("p", ["r0", "r1", "r2", "r3"])
        rewards.append(jd.rewards)
        swapped += jd.info["shown_swapped"]
        total += len(jd.pairs)
    assert 0.4 < swapped / total < 0.6
    np.testing.assert_allclose(np.mean(rewards, axis=0), 0.5, atol=0.03)


def test_unparseable_critiques_are_recorded_and_left_out():
    outs = iter(["Verdict: A", "no idea", "Verdict: tie"])
    jd = PairwiseCritic(lambda ps: [next(outs) for _ in ps], load_rubrics(), seed=1).judge("p", ["a", "b", "c"])
    assert jd.info["unparseable"] == 1 and jd.info["ties"] == 1 and len(jd.outcomes) == 2
    bad = next(p for p in jd.pairs if p.verdict is None)
    assert bad.score is None and bad.winner is None and bad.output == "no idea"
    with pytest.raises(ValueError, match="outputs"):
        PairwiseCritic(lambda ps: [], load_rubrics()).judge("p", ["a", "b"])


def test_pair_subsets_cover_every_response():
    critic = PairwiseCritic(by_quality, load_rubrics(), pairs_per_prompt=10, seed=2)
    for _ in range(20):
        pairs = critic.select_pairs(8)
        assert len(pairs) == len(set(pairs)) == 10 and all(i < j for i, j in pairs)
        assert {k for p in pairs for k in p} == set(range(8))
    critic.aggregate = "win_rate"
    jd = critic.judge("p", [f"q={q}" for q in range(8)])
    assert len(jd.pairs) == 10 and jd.rewards[7] == 1.0 and jd.rewards[0] == 0.0
    assert len(PairwiseCritic(by_quality, load_rubrics(), pairs_per_prompt=3).select_pairs(8)) == 3
    assert len(PairwiseCritic(by_quality, load_rubrics(), pairs_per_prompt=99).select_pairs(4)) == 6


def _judgments(verdicts):
    """Hand-built judgments of 3 responses: pairs (0,1), (0,2), (1,2) with the given (swapped, verdict)."""
    pairs = [PairJudgment(i=i, j=j, a=j if sw else i, b=i if sw else j, prompt=f"cp{i}{j}", output=f"out{i}{j}",
                          verdict=v)
             for (i, j), (sw, v) in zip(itertools.combinations(range(3), 2), verdicts, strict=True)]
    return Judgments(n=3, pairs=pairs, rewards=np.zeros(3), aggregate="win_rate")


def test_critic_agreement_and_training_samples():
    # verifiable: 0 correct, 1 and 2 wrong. (0,1): picks 0 (agrees); (0,2): swapped, "A" = 2 (disagrees);
    # (1,2): rewards equal, so it carries no signal whatever the verdict.
    jd = _judgments([(False, "A"), (True, "A"), (False, "B")])
    assert critic_agreement(jd, [1.0, 0.0, 0.0]) == 0.5
    assert critic_training_samples(jd, [1.0, 0.0, 0.0]) == [("cp01", "out01", 1.0), ("cp02", "out02", 0.0)]
    # ties and unparseable verdicts are not decided: left out of agreement, rewarded 0 for training
    jd2 = _judgments([(True, "B"), (False, "tie"), (False, None)])
    assert critic_agreement(jd2, [1.0, 0.0, 0.5]) == 1.0
    assert [r for *_, r in critic_training_samples(jd2, [1.0, 0.0, 0.5])] == [1.0, 0.0, 0.0]
    assert np.isnan(critic_agreement(jd2, [1.0, 1.0, 1.0]))
    # batches of prompts
    assert critic_agreement([jd, jd2], [[1.0, 0.0, 0.0], [1.0, 0.0, 0.5]]) == pytest.approx(2 / 3)
    assert len(critic_training_samples([jd, jd2], [[1, 0, 0], [1, 0, 0.5]])) == 5
    with pytest.raises(ValueError):
        critic_agreement(jd, [1.0, 0.0])


def test_rubric_env_is_group_level_and_registered():
    assert "rubric" in registered()
    env = make("rubric", pairs_per_prompt=None, aggregate="win_rate")
    assert env.task_type == "rubric"
    task = Task("t", "Say hi.", "")
    env.reset(options={"task": task})
    with pytest.raises(GroupLevelRewardError, match="group-level"):
        env.step("hi")
    with pytest.raises(RuntimeError, match="attach"):
        env.score_group(task, ["q=1", "q=2"])
    env.attach(by_quality)
    rewards, info = env.score_group(task, ["q=2", "q=9", "q=1"])
    assert rewards == [0.5, 1.0, 0.0] and info["pairs"] == 3 and isinstance(info["judgments"], Judgments)
    both = env.score_groups([task, task], [["q=1", "q=2"], ["q=3", "q=3"]])
    assert [r for r, _ in both] == [[0.0, 1.0], [0.5, 0.5]]


def test_a_single_response_needs_no_critic_call():
    calls = []
    jd = PairwiseCritic(lambda ps: calls.append(ps) or [], load_rubrics()).judge("p", ["only"])
    assert calls == [] and jd.pairs == [] and list(jd.rewards) == [0.5]
