"""Learning-health warnings: entropy and reward collapse, iterations without signal, and their replay on resume."""

from rl.health import HealthMonitor


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
