"""Self-critique rubric reward for prompts without a verifiable answer (Kimi K2 report 3.2.2, appendix F).

Self-critiqued policy optimization: the actor samples K responses to a general prompt; the critic
(by default the policy itself, served by the same inference engine, through ``generate``) compares
pairs of them against the core rubrics (F.1), the prescriptive rubrics (F.2) and any per-prompt
rubrics a dataset carries in ``task.meta["rubrics"]``, and ends each critique with ``Verdict: A``,
``Verdict: B`` or ``Verdict: tie``. Each pair is shown in a random order (critics favour one
position) and the verdict is mapped back to the responses. The pairwise outcomes are aggregated
into per-response rewards in [0, 1]: by Bradley–Terry strengths (each response's expected win
probability against the others) or by plain win rate. The rewards feed the same K1.5 update as
verifiable rewards; only the group mean matters to it, so the rewards need only rank well.

Closed-loop critic refinement: the critic is kept honest with verifiable signals. The engineer also
runs the critic on the policy's rollouts for *verifiable* prompts (same ``PairwiseCritic.judge``).
There the environment's reward says which response is better, so

* ``critic_agreement`` measures how often the critic's decided verdicts agree with the verifiable
  order (log it per iteration: it should rise, or at least not fall, as the policy improves), and
* ``critic_training_samples`` turns those judgments into RL samples for the critic itself:
  (critic prompt, critic output, reward 1 if the verdict agrees with the verifiable order else 0).

Adding them to the same batch, trained with the same update in the same run, distils the RLVR
signal into the critic and recalibrates it in lockstep with the policy, which is what grounds its
judgment on tasks with no checkable answer. (The K1.5 loss baselines each sample against its group;
sample each critic prompt several times, by repeating it in ``generate``'s input, so a group exists.)
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml

from envs.base import Env, Task
from envs.registry import register

Aggregate = Literal["bradley_terry", "win_rate"]
#: One pairwise outcome: (i, j, score of i) with 1 = i beat j, 0.5 = tie, 0 = j beat i.
Outcome = tuple[int, int, float]


@dataclass(frozen=True)
class Rubric:
    """One criterion the critic weighs; ``mandatory`` ones are flagged as rules in the prompt."""

    id: str
    title: str
    description: str
    mandatory: bool = False


def _rubric(entry: dict[str, Any] | str | Rubric, default_id: str) -> Rubric:
    if isinstance(entry, Rubric):
        return entry
    if isinstance(entry, str):
        return Rubric(default_id, "Prompt-specific rubric", entry.strip())
    if not isinstance(entry, dict) or not entry.get("description"):
        raise ValueError(f"a rubric needs a description, got {entry!r}")
    return Rubric(str(entry.get("id", default_id)), str(entry.get("title", "Prompt-specific rubric")),
                  " ".join(str(entry["description"]).split()), bool(entry.get("mandatory", False)))


def load_rubrics(names: Iterable[str] = ("core", "prescriptive"),
                 extra: Iterable[dict[str, Any] | str] = ()) -> list[Rubric]:
    """The shipped rubric sets (or YAML files given by path) followed by per-prompt rubrics."""
    out: list[Rubric] = []
    for name in names:
        if name.endswith((".yaml", ".yml")):
            text = Path(name).read_text()
        else:
            text = resources.files("envs").joinpath("rubrics", f"{name}.yaml").read_text()
        out += [_rubric(e, f"{name}_{k}") for k, e in enumerate(yaml.safe_load(text) or [])]
    out += [_rubric(e, f"prompt_{k}") for k, e in enumerate(extra)]
    return out


def format_rubrics(rubrics: Sequence[Rubric]) -> str:
    """The rubrics as a numbered list for the critic prompt."""
    return "\n".join(f"{k}. {r.title}{' (mandatory)' if r.mandatory else ''} [{r.id}]: {r.description}"
                     for k, r in enumerate(rubrics, 1))


def build_pair_prompt(prompt: str, response_a: str, response_b: str, rubrics: Sequence[Rubric]) -> str:
    """The critic prompt comparing responses A and B to ``prompt`` against ``rubrics``."""
    return (
        "You are a strict critic comparing two assistant responses to the same user prompt.\n"
        "Judge them against the rubrics below. Rubrics marked mandatory are rules: a response that "
        "breaks one should normally lose, but use your own judgment when the rules conflict with "
        "being genuinely helpful, correct and safe. Ignore the order in which the responses are shown "
        "and do not prefer a response for being longer.\n\n"
        f"## Rubrics\n{format_rubrics(rubrics)}\n\n"
        f"## User prompt\n{prompt}\n\n"
        f"## Response A\n{response_a}\n\n"
        f"## Response B\n{response_b}\n\n"
        "## Your task\nBriefly compare the two responses rubric by rubric, then decide which is better "
        "overall. End with one final line of exactly `Verdict: A`, `Verdict: B` or `Verdict: tie`."
    )


# The last line that reads "Verdict: X"; markdown emphasis, quotes and "Response X" are tolerated,
# anything else after the choice ("A or B") makes the line unparseable rather than guessed.
_VERDICT = re.compile(r"^[\s*#>_`\"']*verdict[\s*_`]*:[\s*_`\"'\[(]*(?:response\s+)?(a|b|tie)\b[\s*_`\"'.!)\]]*$",
                      re.IGNORECASE | re.MULTILINE)


def parse_verdict(text: str) -> str | None:
    """``"A"``, ``"B"`` or ``"tie"`` from the critic's last verdict line; None if there is none."""
    found = _VERDICT.findall(text)
    if not found:
        return None
    v = found[-1].lower()
    return "tie" if v == "tie" else v.upper()


def bradley_terry(n: int, outcomes: Iterable[Outcome], iters: int = 1000, prior: float = 1.0,
                  tol: float = 1e-10) -> np.ndarray:
    """Bradley–Terry strengths of ``n`` players by Hunter's (2004) MM algorithm, ties as half wins.

    The prior is ``prior`` virtual games of each player against a fixed reference player of
    strength 1, half of them won: it keeps undefeated (or never compared) players finite, makes
    the maximiser unique when the comparison graph is disconnected, and fixes the scale.
    """
    if prior <= 0:
        raise ValueError("prior must be > 0, or an undefeated response gets infinite strength")
    wins = np.full(n, prior / 2)
    games = np.zeros((n, n))
    for i, j, s in outcomes:
        wins[i] += s
        wins[j] += 1 - s
        games[i, j] += 1
        games[j, i] += 1
    p = np.ones(n)
    for _ in range(iters if n else 0):
        denom = (games / (p[:, None] + p[None, :])).sum(axis=1) + prior / (p + 1)
        new = _rescale(wins / denom)
        done = np.max(np.abs(np.log(new) - np.log(p))) < tol
        p = new
        if done:
            break
    return p


def _rescale(p: np.ndarray) -> np.ndarray:
    """``p`` times the factor that maximises the penalised likelihood along the common scale.

    The real games' likelihood is scale-free, so only the weak prior pins the scale and plain MM
    crawls along that direction; the exact maximiser solves Σ p_i c / (p_i c + 1) = n / 2 (an exact
    coordinate step, so the likelihood still never decreases).
    """
    log_c = 0.0
    for _ in range(100):
        q = 1 / (1 + np.exp(-(np.log(p) + log_c)))
        step = float((q.sum() - len(p) / 2) / (q * (1 - q)).sum())
        log_c -= float(np.clip(step, -2.0, 2.0))  # clipped: Newton on a sigmoid can overshoot
        if abs(step) < 1e-13:
            break
    return p * np.exp(log_c)


def expected_win_rate(strengths: np.ndarray) -> np.ndarray:
    """Each player's mean BT win probability against the others, in [0, 1]."""
    n = len(strengths)
    if n < 2:
        return np.full(n, 0.5)
    prob = strengths[:, None] / (strengths[:, None] + strengths[None, :])
    return (prob.sum(axis=1) - 0.5) / (n - 1)  # drop the diagonal's p/(p+p) = 1/2


def win_rate(n: int, outcomes: Iterable[Outcome]) -> np.ndarray:
    """(wins + ties/2) / games per player; 0.5 for a player with no decided comparison."""
    wins, games = np.zeros(n), np.zeros(n)
    for i, j, s in outcomes:
        wins[i] += s
        wins[j] += 1 - s
        games[i] += 1
        games[j] += 1
    return np.where(games > 0, wins / np.maximum(games, 1), 0.5)


@dataclass(kw_only=True)
class PairJudgment:
    """One critic call: responses ``a`` and ``b`` shown as A and B (``i < j`` is the canonical pair)."""

    i: int
    j: int
    a: int
    b: int
    prompt: str
    output: str
    verdict: str | None  # as the critic wrote it: "A", "B", "tie", or None when unparseable

    @property
    def swapped(self) -> bool:
        """Whether j was shown first."""
        return self.a != self.i

    @property
    def winner(self) -> int | None:
        """Index of the winning response; None for a tie or an unparseable critique."""
        return {"A": self.a, "B": self.b}.get(self.verdict or "")

    @property
    def score(self) -> float | None:
        """Outcome for response i: 1 won, 0.5 tie, 0 lost; None if unparseable."""
        if self.verdict is None:
            return None
        return 0.5 if self.verdict == "tie" else float(self.winner == self.i)


@dataclass(kw_only=True)
class Judgments:
    """The critic's pairwise judgments of one prompt's K responses and the rewards from them."""

    n: int
    pairs: list[PairJudgment]
    rewards: np.ndarray
    aggregate: str
    strengths: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def outcomes(self) -> list[Outcome]:
        """The parseable outcomes as (i, j, score of i)."""
        return [(p.i, p.j, s) for p in self.pairs if (s := p.score) is not None]


class PairwiseCritic:
    """Ranks K responses to a prompt by pairwise rubric critiques from ``generate``."""

    def __init__(self, generate: Callable[[list[str]], list[str]], rubrics: Sequence[Rubric] | None = None, *,
                 pairs_per_prompt: int | None = None, seed: int = 0, aggregate: Aggregate = "bradley_terry",
                 prior: float = 1.0) -> None:
        if aggregate not in ("bradley_terry", "win_rate"):
            raise ValueError(f"aggregate must be 'bradley_terry' or 'win_rate', got {aggregate!r}")
        self.generate = generate
        self.rubrics = list(load_rubrics() if rubrics is None else rubrics)
        self.pairs_per_prompt = pairs_per_prompt
        self.aggregate = aggregate
        self.prior = prior
        self.rng = np.random.default_rng(seed)

    def select_pairs(self, n: int) -> list[tuple[int, int]]:
        """All pairs, or ``pairs_per_prompt`` of them: a random cycle first, so every response is
        compared and the comparison graph is connected, then random further pairs."""
        everything = list(itertools.combinations(range(n), 2))
        m = self.pairs_per_prompt
        if m is None or m >= len(everything):
            return everything
        chosen: list[tuple[int, int]] = []
        if m >= n:
            order = self.rng.permutation(n)
            chosen = [tuple(sorted((int(order[k]), int(order[(k + 1) % n])))) for k in range(n)]
        taken = set(chosen)
        rest = [p for p in everything if p not in taken]
        picks = self.rng.choice(len(rest), size=m - len(chosen), replace=False)
        return sorted(chosen + [rest[k] for k in picks])

    def judge(self, prompt: str, responses: Sequence[str],
              extra_rubrics: Iterable[dict[str, Any] | str | Rubric] = ()) -> Judgments:
        """Compare pairs of ``responses`` (each in a random order) and aggregate them into rewards."""
        return self.judge_batch([(prompt, responses, extra_rubrics)])[0]

    def judge_batch(self, items: Sequence[tuple[str, Sequence[str], Iterable[Any]]]) -> list[Judgments]:
        """``judge`` for many prompts with a single ``generate`` call (one engine batch)."""
        plans = []
        for prompt, responses, extra in items:
            if isinstance(extra, str | dict | Rubric):  # one rubric, not an iterable of them
                extra = [extra]
            rubrics = self.rubrics + [_rubric(e, f"prompt_{k}") for k, e in enumerate(extra)]
            shown = []
            for i, j in self.select_pairs(len(responses)):
                a, b = (j, i) if self.rng.random() < 0.5 else (i, j)  # against position bias
                shown.append((i, j, a, b, build_pair_prompt(prompt, responses[a], responses[b], rubrics)))
            plans.append((len(responses), shown))
        critic_prompts = [s[4] for _, shown in plans for s in shown]
        outputs = list(self.generate(critic_prompts)) if critic_prompts else []
        if len(outputs) != len(critic_prompts):
            raise ValueError(f"generate returned {len(outputs)} outputs for {len(critic_prompts)} prompts")
        it = iter(outputs)
        return [self._aggregate(n, [PairJudgment(i=i, j=j, a=a, b=b, prompt=cp, output=out, verdict=parse_verdict(out))
                                    for (i, j, a, b, cp), out in zip(shown, it, strict=False)]) for n, shown in plans]

    def _aggregate(self, n: int, pairs: list[PairJudgment]) -> Judgments:
        outcomes = [(p.i, p.j, s) for p in pairs if (s := p.score) is not None]
        strengths = None
        if self.aggregate == "bradley_terry":
            strengths = bradley_terry(n, outcomes, prior=self.prior)
            rewards = expected_win_rate(strengths)
        else:
            rewards = win_rate(n, outcomes)
        info = {"pairs": len(pairs), "unparseable": sum(p.verdict is None for p in pairs),
                "ties": sum(p.verdict == "tie" for p in pairs), "shown_swapped": sum(p.swapped for p in pairs)}
        return Judgments(n=n, pairs=pairs, rewards=rewards, aggregate=self.aggregate, strengths=strengths, info=info)


def _labelled(judgments: Judgments | Sequence[Judgments], verifiable_rewards: Sequence[Any]):
    """(pair, reward of i, reward of j) over one prompt's or a batch's judgments."""
    if isinstance(judgments, Judgments):
        judgments, verifiable_rewards = [judgments], [verifiable_rewards]
    if len(judgments) != len(verifiable_rewards):
        raise ValueError("need one list of verifiable rewards per Judgments")
    for jd, rewards in zip(judgments, verifiable_rewards, strict=True):
        if len(rewards) != jd.n:
            raise ValueError(f"{len(rewards)} verifiable rewards for {jd.n} responses")
        for p in jd.pairs:
            yield p, float(rewards[p.i]), float(rewards[p.j])


def critic_agreement(judgments: Judgments | Sequence[Judgments], verifiable_rewards: Sequence[Any]) -> float:
    """Fraction of decided pairs with unequal verifiable rewards where the critic chose the higher; nan if none."""
    hits = [p.winner == (p.i if ri > rj else p.j)
            for p, ri, rj in _labelled(judgments, verifiable_rewards) if ri != rj and p.winner is not None]
    return float(np.mean(hits)) if hits else float("nan")


def critic_training_samples(judgments: Judgments | Sequence[Judgments],
                            verifiable_rewards: Sequence[Any]) -> list[tuple[str, str, float]]:
    """(critic prompt, critic output, 1 if its verdict matches the verifiable order else 0) for
    every pair with unequal verifiable rewards; ties and unparseable critiques earn 0."""
    return [(p.prompt, p.output, float(p.winner == (p.i if ri > rj else p.j)))
            for p, ri, rj in _labelled(judgments, verifiable_rewards) if ri != rj]


class GroupLevelRewardError(RuntimeError):
    """Raised by ``RubricEnv.score``: rubric rewards exist only for a whole group of responses."""


class RubricEnv(Env):
    """Non-verifiable prompts rewarded by the self-critic; rewards come per group via ``score_group``.

    ``generate`` (critic prompts -> critic outputs) is usually attached after construction with
    ``attach``, since configs cannot carry callables. Per-prompt rubrics: ``task.meta["rubrics"]``.
    ``step`` (one response, as a Gym user steps it) needs a reference response in the task's answer: the critic
    compares the two, and the reward is 1 when the response wins, 0.5 for a tie, 0 when it loses.
    """

    task_type = "rubric"
    group_level = True
    relative_rewards = True  # the critic ranks a prompt's responses against each other
    requires_answer = False  # prompts, with optional reference answers and ``meta.rubrics``

    def __init__(self, tasks: list[Task] | None = None, *, generate: Callable[[list[str]], list[str]] | None = None,
                 rubrics: Sequence[str] = ("core", "prescriptive"), pairs_per_prompt: int | None = None,
                 aggregate: Aggregate = "bradley_terry", prior: float = 1.0, seed: int = 0) -> None:
        super().__init__(tasks)
        self.critic_options = {"pairs_per_prompt": pairs_per_prompt, "aggregate": aggregate, "prior": prior,
                               "seed": seed}
        self.rubrics = load_rubrics(rubrics)
        self.critic: PairwiseCritic | None = None
        if generate is not None:
            self.attach(generate)

    def attach(self, generate: Callable[[list[str]], list[str]]) -> PairwiseCritic:
        """Use ``generate`` as the critic (typically the policy on the shared inference engine)."""
        self.critic = PairwiseCritic(generate, self.rubrics, **self.critic_options)
        return self.critic

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        """``response`` against the task's reference answer, shown in an order drawn from the episode's seed."""
        if not task.answer:
            raise GroupLevelRewardError(
                "rubric rewards are group-level: the critic compares all K responses of a prompt with each "
                "other, so one response has no reward on its own; call RubricEnv.score_group(task, responses), "
                "or give the task a reference answer to compare a single response with"
            )
        if self.critic is None:
            raise RuntimeError("RubricEnv has no critic: pass generate= or call attach(generate) first")
        swapped = bool(self.np_random.random() < 0.5)  # against position bias, reproducible from reset's seed
        a, b = (task.answer, response) if swapped else (response, task.answer)
        extra = task.meta.get("rubrics", ())
        if isinstance(extra, str | dict | Rubric):  # one rubric, not an iterable of them
            extra = [extra]
        rubrics = self.rubrics + [_rubric(e, f"prompt_{k}") for k, e in enumerate(extra)]
        output = self.critic.generate([build_pair_prompt(task.prompt, a, b, rubrics)])[0]
        verdict = parse_verdict(output)
        if verdict is None:
            raise ValueError(f"the critic's verdict on task {task.id} is unparseable: {output[-200:]!r}")
        won = {"A": not swapped, "B": swapped}.get(verdict)
        return (0.5 if won is None else float(won)), {"verdict": verdict, "shown_swapped": swapped}

    def score_group(self, task: Task, responses: Sequence[str]) -> tuple[list[float], dict[str, Any]]:
        """Rewards in [0, 1] for all K responses to ``task`` and the critic's details for logging."""
        return self.score_groups([task], [responses])[0]

    def score_groups(self, tasks: Sequence[Task],
                     groups: Sequence[Sequence[str]]) -> list[tuple[list[float], dict[str, Any]]]:
        """``score_group`` for many prompts in one critic batch."""
        if self.critic is None:
            raise RuntimeError("RubricEnv has no critic: pass generate= or call attach(generate) first")
        items = [(t.prompt, list(g), t.meta.get("rubrics", ())) for t, g in zip(tasks, groups, strict=True)]
        return [([float(r) for r in jd.rewards], {**jd.info, "judgments": jd})
                for jd in self.critic.judge_batch(items)]


register("rubric", RubricEnv)
