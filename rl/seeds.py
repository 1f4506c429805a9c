"""Every random stream of a run, seeded from one place.

Each stream's seed is a stable hash (BLAKE2b, not Python's salted ``hash``) of the stream's name and its
coordinates: the run seed, the iteration, an index. So a resumed run draws exactly what the uninterrupted
run drew (no generator state to checkpoint), the same config and seed reproduce a run, and no two streams
share a seed (arithmetic such as ``seed * 1_000_003 + it`` let the critic loop reuse the prompt seed, and
runs with nearby seeds overlap one another's streams).

Seeds are 63-bit non-negative integers: what ``SamplingParams.seed`` accepts, and within what
``torch.manual_seed`` and ``random.Random`` take.

Seed values changed with this module (previously ad-hoc arithmetic per caller): a run reproduces runs made
since, not bit for bit those made before it. The fixed task-set seeds are unchanged, so generated training and
held-out sets stay the same.
"""

from __future__ import annotations

import hashlib
from typing import Literal

SEED_BITS = 63
_PERSON = b"rl-seeds"  # domain separation from any other BLAKE2b use

# Environments generate their task sets from these: fixed (not the run seed), so every run of an environment
# is evaluated on the same held-out set and accuracies are comparable across runs.
TASK_SET_SEEDS: dict[str, int] = {"train": 1, "eval": 2, "sft": 3}


def derive(stream: str, *parts: int) -> int:
    """The seed of ``stream`` at coordinates ``parts``: a 63-bit hash, the same on every machine and Python."""
    # repr of a tuple of ints is unambiguous ((1, 23) vs (12, 3)), negative seeds included
    key = f"{stream}{tuple(int(p) for p in parts)!r}".encode()
    digest = hashlib.blake2b(key, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def task_set_seed(split: Literal["train", "eval", "sft"]) -> int:
    """Seed an environment generates the ``split`` task set with (fixed across runs)."""
    return TASK_SET_SEEDS[split]


def prompt_seed(run_seed: int, iteration: int) -> int:
    """Seed of the draw of the iteration's new prompts."""
    return derive("prompts", run_seed, iteration)


def sampling_seed(run_seed: int, iteration: int, key: int) -> int:
    """Sampling seed of rollout trajectory ``key``, started at ``iteration`` (kept when a partial rollout resumes)."""
    return derive("sampling", run_seed, iteration, key)


def episode_seed(run_seed: int, iteration: int) -> int:
    """Seed of the iteration's multi-turn episodes; each turn of each episode derives its own (``turn_seed``)."""
    return derive("episodes", run_seed, iteration)


def turn_seed(episode_seed: int, key: int, turn: int) -> int:
    """Sampling seed of turn ``turn`` of multi-turn episode ``key``, from its iteration's ``episode_seed``."""
    return derive("turn", episode_seed, key, turn)


def critic_seed(run_seed: int, iteration: int) -> int:
    """Seed of the policy's samples when it judges as critic in the iteration's rewards."""
    return derive("critic", run_seed, iteration)


def critic_training_seed(run_seed: int, iteration: int) -> int:
    """Seed of the iteration's closed-loop critic training: which pairs, their order, the judgments' samples."""
    return derive("critic_training", run_seed, iteration)


def train_seed(run_seed: int, iteration: int) -> int:
    """Seed of the iteration's K1.5 update (the split of prompt groups into minibatches)."""
    return derive("train", run_seed, iteration)


def ptx_seed(run_seed: int, iteration: int) -> int:
    """Seed of the iteration's draw of PTX samples."""
    return derive("ptx", run_seed, iteration)


def eval_seed(prompt: int, sample: int) -> int:
    """Sampling seed of sample ``sample`` of held-out prompt ``prompt``. Independent of the run seed and the
    iteration on purpose: every evaluation of every run draws the same noise, so sampled accuracies compare."""
    return derive("eval", prompt, sample)


def warmstart_seed(seed: int) -> int:
    """Seed of the warm start's SFT (model init and batch order), from ``warmstart.seed``: not the run seed, as
    the warm start is cached by its own settings and shared by runs."""
    return derive("warmstart", seed)


def difficulty_seed(seed: int, batch: int) -> int:
    """Seed of batch ``batch`` of the difficulty filter's samples (``batch=-1``: before the first batch)."""
    return derive("difficulty", seed, batch)


def chunk_seed(call_seed: int, chunk: int) -> int:
    """Engine seed of chunk ``chunk`` of a ``Cluster.generate`` call made with ``call_seed``."""
    return derive("chunk", call_seed, chunk)
