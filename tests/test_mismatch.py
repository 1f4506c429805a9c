"""Train–inference mismatch correction (rl.algo.mismatch): TIS and MIS at sequence and token level, against
ratios computed here by hand, and in the update on a real model."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from rl.algo.mismatch import Correction
from rl.algo.mismatch import correct as correct_tensors
from rl.algo.mismatch import metrics as correction_metrics
from rl.algo.objectives import group_advantages
from rl.config import parse_config
from rl.settings import resolve
from tests.test_algorithm import _random_samples, settings, update

# two sequences: the second has one token whose sampler probability is far below the trainer's
OLD = [[-1.0, -2.0, -0.5], [-1.0, -0.2, -3.0]]
SAMPLER = [[-1.1, -1.9, -0.5], [-1.0, -2.2, -3.0]]  # Δ: (0.1, -0.1, 0) and (0, 2.0, 0)


def correct(old, sampler, masks, how):
    """``rl.algo.mismatch.correct`` on rows given as lists (a mask None: every token is the model's own): the
    factors, the masks after it (as given, unless token-level MIS rewrote them) and the metrics."""
    own = torch.tensor([m if m is not None else [1] * len(o) for o, m in zip(old, masks, strict=True)]).bool()
    factors, new_own, stats = correct_tensors(torch.tensor(old), torch.tensor(sampler), own, how)
    token_mis = how.kind == "mis" and how.level == "token"
    out = [row.int().tolist() if token_mis else m for m, row in zip(masks, new_own, strict=True)]
    return factors.tolist(), out, correction_metrics(stats.tolist(), how)


def trainer_logprobs(engine, samples) -> list[list[float]]:
    """Each sample's per-token log-probs under ``engine``'s weights (its own computation, one batch)."""
    with torch.no_grad():
        lp, mask = engine.response_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                            [s.temperature for s in samples])
    return [lp[i][mask[i]].tolist() for i in range(len(samples))]


def test_sequence_tis_truncates_the_whole_ratio_at_the_cap():
    factors, masks, m = correct(OLD, SAMPLER, [None, None], Correction("tis", "sequence", 2.0))
    assert factors == pytest.approx([1.0, 2.0])  # exp(0) and min(exp(2), 2)
    assert masks == [None, None]
    assert m["is_ratio_max"] == pytest.approx(math.exp(2.0)) and m["is_ratio_min"] == pytest.approx(1.0)
    assert m["is_truncated_share"] == 0.5


def test_token_tis_truncates_each_token_before_the_product():
    factors, _, m = correct(OLD, SAMPLER, [None, None], Correction("tis", "token", 1.5))
    assert factors == pytest.approx([math.exp(0.1) * math.exp(-0.1), 1.5])
    assert m["is_truncated_share"] == pytest.approx(1 / 6)


def test_sequence_mis_drops_sequences_whose_ratio_leaves_the_band_either_way():
    flipped = [SAMPLER[1], SAMPLER[0]]  # now the second ratio is exp(-2): below 1/C
    factors, _, m = correct([OLD[1], OLD[0]], flipped, [None, None], Correction("mis", "sequence", 2.0))
    assert factors == [0.0, 1.0] and m["is_masked_share"] == 0.5
    factors, _, _ = correct([SAMPLER[1]], [OLD[1]], [None], Correction("mis", "sequence", 2.0))
    assert factors == [0.0]


def test_token_mis_masks_only_the_tokens_out_of_band_and_only_the_models_own():
    factors, masks, m = correct(OLD, SAMPLER, [None, [1, 1, 0]], Correction("mis", "token", 2.0))
    assert factors == [1.0, 1.0] and masks == [[1, 1, 1], [1, 0, 0]]
    assert m["is_masked_share"] == pytest.approx(1 / 5)  # 5 own tokens, one masked
    env_token = [[-1.0, -0.2, -3.0]], [[-1.0, -0.2, -9.0]]
    _, masks, _ = correct(*env_token, [[1, 1, 0]], Correction("mis", "token", 2.0))
    assert masks == [[1, 1, 0]]  # the environment's token is not the model's: never counted


def test_a_cap_not_above_one_is_refused():
    with pytest.raises(ValueError, match="cap must be > 1"):
        Correction("tis", "sequence", 1.0)


@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_the_update_weights_each_sequence_by_its_corrected_ratio(tiny_model, tokenizer, kind):
    """First step of an update (log π_θ = log π_old after the recompute, so each residual is the advantage):
    its loss is Σ_i f_i·w_i·A_i², with f_i the ratio trainer/sampler truncated (TIS) or 0/1 (MIS), computed
    here from the trainer's own log-probs and the sampler's."""
    rng = random.Random(5)
    samples = _random_samples(rng, tokenizer.vocab_size, n_groups=3)
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    trainer = trainer_logprobs(engine, samples)
    # a sampler close to the trainer except on a few sequences
    sampler = [replace(s, logprobs=[x + (1.5 if i % 3 == 0 else 0.01) for x in t])
               for i, (s, t) in enumerate(zip(samples, trainer, strict=True))]
    adv = group_advantages(sampler)
    sizes = {g: sum(s.group == g for s in sampler) for g in {s.group for s in sampler}}
    want = 0.0
    for s, t, a in zip(sampler, trainer, adv, strict=True):
        log_rho = sum(t) - sum(s.logprobs)
        f = min(math.exp(log_rho), 2.0) if kind == "tis" else float(abs(log_rho) <= math.log(2.0))
        want += f * a * a / (sizes[s.group] * len(sizes))
    engine.optimizers = build_optimizers(tiny_model, "muon", 1e-2, 0.0)
    (step,) = update(engine, sampler, settings(correction=Correction(kind, "sequence", 2.0)))
    assert step["loss"] == pytest.approx(want, rel=1e-5)
    assert any(sum(t) - sum(s.logprobs) < -math.log(2) for s, t in zip(sampler, trainer, strict=True))
    assert step["is_ratio_min"] < 0.5 and ("is_truncated_share" in step) == (kind == "tis")


def test_without_a_mismatch_the_correction_changes_nothing(tiny_model, tokenizer):
    samples = _random_samples(random.Random(6), tokenizer.vocab_size, n_groups=3)
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    exact = [replace(s, logprobs=lp) for s, lp in zip(samples, trainer_logprobs(engine, samples), strict=True)]
    losses = []
    for correction in (None, Correction("tis", "token", 2.0), Correction("mis", "token", 2.0)):
        (step,) = update(TrainingEngine(tiny_model, [], tokenizer.pad_id), exact,
                         settings(correction=correction, recompute_old=True))
        losses.append(step["loss"])
        if correction is not None:
            assert step["is_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-6)


def test_auto_corrects_with_vllm_only(tiny_model):
    def mismatch_correction(cfg):
        return resolve(cfg, tiny_model.config, "unused", 64).update.correction

    def cfg(**rollout):
        return parse_config({"rollout": rollout})

    assert mismatch_correction(cfg(engine="native")) is None
    assert mismatch_correction(cfg(engine="vllm")) == Correction("tis", "sequence", 2.0)
    forced = parse_config({"rollout": {"engine": "native"},
                           "algorithm": {"mismatch": {"correction": "mis", "level": "token", "cap": 3.0}}})
    assert mismatch_correction(forced) == Correction("mis", "token", 3.0)
    with pytest.raises(Exception, match="cap"):
        parse_config({"algorithm": {"mismatch": {"cap": 0.5}}})

