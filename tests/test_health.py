"""Learning-health warnings: entropy and reward collapse, iterations without signal, and their replay on resume."""

import pytest

from rl.loop.health import CollapseGuard, HealthMonitor


def _rec(it, reward, entropy=None, **kw):
    return {"iteration": it, "reward_mean": reward, **({"entropy": entropy} if entropy is not None else {}),
            "optimizer_steps": 2, "groups_trained": 10, **kw}


def test_entropy_collapse_is_flagged_against_the_first_measured_entropy():
    h = HealthMonitor(entropy_ratio=0.25)
    flags = []
    for it, e in enumerate([1.2, 1.0, 0.5, 0.31, 0.29, 0.8]):
        rec = _rec(it, 0.3, e)
        warnings = h.check(rec)
        flags.append(rec["warn_entropy_collapse"])
        assert bool(warnings) == bool(rec["warn_entropy_collapse"])
    assert flags == [0, 0, 0, 0, 1, 0]  # below 0.25 x 1.2 = 0.3 only at 0.29


def test_reward_collapse_compares_a_window_mean_with_the_best_so_far():
    h = HealthMonitor(reward_ratio=0.5, window=3)
    rewards = [0.4, 0.5, 0.6, 0.6, 0.3, 0.1, 0.1, 0.05]
    flags = []
    for it, r in enumerate(rewards):
        rec = _rec(it, r)
        h.check(rec)
        flags.append(rec["warn_reward_collapse"])
    # window means from the third iteration on: .5 .567 .5 .333 .167 .083; below half the best (.567) at .167
    assert flags == [0, 0, 0, 0, 0, 0, 1, 1]
    low = HealthMonitor(window=2)  # a reward that never rose above min_reward is no collapse
    recs = [_rec(i, r) for i, r in enumerate([0.02, 0.04, 0.0, 0.0])]
    assert not any(low.check(r) for r in recs) and not any(r["warn_reward_collapse"] for r in recs)


def test_an_iteration_without_signal_is_flagged_and_a_resume_replays_history():
    h = HealthMonitor()
    rec = {"iteration": 0, "reward_mean": 0.0, "trained_samples": 64, "optimizer_steps": 0}
    assert h.check(rec) and rec["warn_no_signal"] == 1
    history = [_rec(i, 0.3, e) for i, e in enumerate([1.0, 0.9])]
    fresh, resumed = HealthMonitor(), HealthMonitor()
    for r in history:
        fresh.check(dict(r))
    resumed.replay(history)
    a, b = _rec(2, 0.3, 0.2), _rec(2, 0.3, 0.2)
    assert fresh.check(a) == resumed.check(b) and a["warn_entropy_collapse"] == b["warn_entropy_collapse"] == 1


def test_collapse_guard_keeps_the_best_and_judges_drops_and_reward_collapse():
    guard = CollapseGuard(drop=0.1, best=None)
    assert guard.improved({"accuracy": 0.34}) and guard.best == 0.34  # the warm start is the first best
    assert guard.verdict({"accuracy": None}) is None  # no evaluation, no reward collapse: nothing to judge
    assert not guard.improved({"accuracy": 0.30}) and guard.verdict({"accuracy": 0.30}) is None  # within the drop
    assert guard.improved({"accuracy": 0.40}) and guard.best == 0.40
    why = guard.verdict({"accuracy": 0.29})
    assert why == "held-out accuracy 0.290 is more than 0.1 below the best 0.400"
    assert guard.verdict({"accuracy": None, "warn_reward_collapse": 1}) == "the mean reward collapsed"
    assert CollapseGuard(0.1, best=0.5).verdict({"accuracy": 0.41}) is None  # resumed with its best


def test_collapse_guard_on_a_task_the_model_rarely_solves_judges_the_share_lost_not_noise():
    """A Qwen2-format model at the schema's old learning rate went 0.152 → 0.095 on 296 held-out prompts: over a
    third lost, under the absolute 0.1. The guard calls it; a dip within two standard errors it does not."""
    guard = CollapseGuard(drop=0.1, best=0.152, relative=0.3, eval_tasks=296)
    assert guard.margin() == pytest.approx(0.3 * 0.152)  # two standard errors are 0.042, a little less
    assert "below the best 0.152" in guard.verdict({"accuracy": 0.095})
    assert guard.verdict({"accuracy": 0.12}) is None
    noisy = CollapseGuard(drop=0.1, best=0.152, relative=0.3, eval_tasks=40)  # a small eval: ±0.057 per σ
    assert noisy.margin() == pytest.approx(2 * (0.152 * 0.848 / 40) ** 0.5)
    assert noisy.verdict({"accuracy": 0.095}) is None
    assert CollapseGuard(0.1, best=0.6, relative=0.3).margin() == 0.1  # the absolute drop where it is less


def test_collapse_guard_on_the_mean_reward_uses_the_evaluations_own_spread():
    """run.best_metric: eval_reward. The best is the highest mean reward; a drop counts past min(drop, 0.3·best)
    unless the evaluation's spread (eval_reward_std / √n, twice) is wider; records without it are not judged."""
    guard = CollapseGuard(drop=0.1, best=None, relative=0.3, eval_tasks=100, metric="eval_reward")
    assert not guard.improved({"accuracy": 0.9, "eval_reward": None})
    assert guard.improved({"accuracy": 0.0, "eval_reward": 0.6}) and guard.best == 0.6
    assert guard.verdict({"eval_reward": 0.45, "eval_reward_std": 0.1}) == \
        "held-out mean reward 0.450 is more than 0.1 below the best 0.600"
    assert guard.verdict({"eval_reward": 0.45, "eval_reward_std": 1.0}) is None  # 2 · 1.0 / √100 = 0.2 of noise
    assert guard.verdict({"accuracy": 0.0, "eval_reward": None}) is None


def test_after_a_rollback_the_reward_window_fills_again_before_it_can_flag():
    health = HealthMonitor(window=2)
    recs = [{"reward_mean": r} for r in (0.6, 0.6, 0.1, 0.1)]
    for r in recs:
        health.check(r)
    assert recs[-1]["warn_reward_collapse"] == 1
    health.rolled_back()
    after = [{"reward_mean": 0.1}, {"reward_mean": 0.6}]
    health.check(after[0])
    health.check(after[1])
    assert after[0]["warn_reward_collapse"] == 0  # one iteration: the window is not full yet
    assert after[1]["warn_reward_collapse"] == 0  # (0.1 + 0.6) / 2 is no collapse against 0.6
    replayed = HealthMonitor(window=2)
    replayed.replay([*recs[:3], {**recs[3], "rollback": 1}])
    probe = {"reward_mean": 0.1}
    replayed.check(probe)
    assert probe["warn_reward_collapse"] == 0  # the replay cleared the window at the rollback too


def test_entropy_blowup_is_flagged_and_rolls_back():
    """The policy turning to noise: entropy above 3x its first value and 0.5 nats more; tiny entropies that triple
    without rising half a nat are not (the quick start's is 0.1)."""
    h = HealthMonitor()
    flags = []
    for it, e in enumerate([0.4, 0.6, 1.1, 1.3, 0.5]):
        rec = _rec(it, 0.3, e)
        h.check(rec)
        flags.append(rec["warn_entropy_blowup"])
    assert flags == [0, 0, 0, 1, 0]  # over max(3 x 0.4, 0.4 + 0.5) = 1.2 only at 1.3
    tiny = HealthMonitor()
    recs = [_rec(i, 0.3, e) for i, e in enumerate([0.1, 0.35])]
    for r in recs:
        tiny.check(r)
    assert recs[1]["warn_entropy_blowup"] == 0
    guard = CollapseGuard(drop=0.1, best=0.4)
    why = guard.verdict({"warn_entropy_blowup": 1, "entropy": 1.3})
    assert why == "the policy's entropy blew up (1.300 nats per token)"


def test_update_spikes_logit_growth_and_the_share_without_signal_are_watched():
    h = HealthMonitor(window=3, spike_ratio=5.0, logit_ratio=2.0)
    spikes, logits = [], []
    for it, (rms, logit) in enumerate([(0.01, 10.0), (0.012, 11.0), (0.011, 12.0), (0.04, 15.0), (0.2, 21.0)]):
        rec = _rec(it, 0.3, **{"update_rms/muon": rms, "max_logit": logit, "groups_equal_reward": it})
        h.check(rec)
        spikes.append(rec["warn_update_spike"])
        logits.append(rec["warn_logit_growth"])
        assert rec["no_signal_share"] == round(it / (10 + it), 4)
    # median of the last three before: 0.011 (x5 = 0.055: 0.04 is not a spike), then 0.012 (0.2 is)
    assert spikes == [0, 0, 0, 0, 1]
    assert logits == [0, 0, 0, 0, 1]  # over 2 x 10 only at 21


def test_moe_router_collapse_and_route_mismatch_are_watched_and_the_guard_rolls_back_on_a_collapse():
    """The routers' health (``router_*``, ``route_mismatch`` from rl.algo.update) against their first values: a dense
    model's records carry none and get no router flags."""
    m, guard = HealthMonitor(), CollapseGuard(0.1)
    dense = {"entropy": 1.0}
    m.check(dense)
    assert "warn_router_collapse" not in dense and "warn_route_mismatch" not in dense
    first = {"router_max_load": 1.4, "router_entropy": 1.8, "route_mismatch": 0.02}
    assert m.check(first) == [] and first["warn_router_collapse"] == first["warn_route_mismatch"] == 0
    assert guard.verdict(first) is None
    fine = {"router_max_load": 2.7, "router_entropy": 1.0, "route_mismatch": 0.1}  # under 2x and over 25 %: no flag
    assert m.check(fine) == [] and fine["warn_router_collapse"] == 0
    crowded = {"router_max_load": 2.9, "router_entropy": 1.5, "route_mismatch": 0.02}
    lines = m.check(crowded)
    assert crowded["warn_router_collapse"] == 1 and "MoE routers collapsed" in lines[0]
    assert "routers collapsed" in guard.verdict(crowded)
    narrowed = {"router_max_load": 1.5, "router_entropy": 0.4, "route_mismatch": 0.02}  # under a quarter of 1.8
    assert m.check(narrowed) and narrowed["warn_router_collapse"] == 1
    drift = {"router_max_load": 1.4, "router_entropy": 1.8, "route_mismatch": 0.25}
    lines = m.check(drift)
    assert drift["warn_route_mismatch"] == 1 and drift["warn_router_collapse"] == 0
    assert "routing_replay" in lines[0] and guard.verdict(drift) is None  # a warning, not a rollback
