"""Learning health: warnings, in the log and as metrics, when the policy or its training goes wrong.

Each iteration's record is checked against the run's own history (so a resumed run replays its
``metrics.jsonl`` first):
- ``warn_entropy_collapse``: the policy entropy fell below ``entropy_ratio`` of its first measured value
  (the policy became nearly deterministic: the K samples of a prompt stop differing, and so do rewards);
- ``warn_entropy_blowup``: the entropy rose above ``blowup_ratio`` times its first value and by more than
  ``blowup_nats`` (the policy is turning to noise: what a too large update does to a pretrained model first);
- ``warn_reward_collapse``: the mean reward of the last ``window`` iterations fell below ``reward_ratio``
  of the best such mean so far (a too large learning rate typically does this within a few iterations);
- ``warn_update_spike``: an optimizer update's RMS (``update_rms/*``) above ``spike_ratio`` times the median of
  the last ``window`` iterations' (a step much larger than the run's own);
- ``warn_logit_growth``: the largest attention logit (``max_logit``) above ``logit_ratio`` times its first value
  (QK-Clip caps it at ``optimizer.qk_clip_tau`` where it is on);
- ``warn_no_signal``: no prompt group had rewards that differ, so the RL loss was empty; ``no_signal_share``
  (a metric) is the share of the iteration's groups whose rewards were all equal;
- ``warn_router_collapse`` (MoE): the busiest expert's load (``router_max_load``, over the even share) above
  ``router_ratio`` times its first value, or the routers' entropy below ``entropy_ratio`` of its first: tokens are
  crowding onto a few experts, which MoE RL without care is known to end in;
- ``warn_route_mismatch`` (MoE): the trainer's own routes differ from the rollout's on more than ``mismatch_limit``
  of token-layer pairs (``route_mismatch``), so those tokens' importance ratios compare two different networks.
Each is 1 on the iterations where it holds and 0 otherwise.

``CollapseGuard`` turns them into action (``run.collapse_guard``): the held-out ``run.best_metric`` (accuracy or
mean reward) ``collapse_drop`` below the best evaluated so far, a reward collapse or an entropy blow-up makes the
controller roll back to the best weights (``best/``, saved with their trainer state at each new best), scale the
learning rate by ``rollback_lr_factor`` and go on; after ``max_rollbacks`` the run stops. So does a router collapse
(an MoE's routers crowding tokens onto a few experts). The other signals warn.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class HealthMonitor:
    #: an MoE's router thresholds (``warn_router_collapse``, ``warn_route_mismatch``): the busiest expert's load over
    #: its first, and the share of token-layer routes that may differ from the rollout's
    router_ratio, mismatch_limit = 2.0, 0.1

    def __init__(self, entropy_ratio: float = 0.25, reward_ratio: float = 0.5, window: int = 5,
                 min_reward: float = 0.05, blowup_ratio: float = 3.0, blowup_nats: float = 0.5,
                 spike_ratio: float = 5.0, logit_ratio: float = 2.0) -> None:
        self.entropy_ratio, self.reward_ratio, self.window, self.min_reward = (entropy_ratio, reward_ratio, window,
                                                                               min_reward)
        self.blowup_ratio, self.blowup_nats, self.spike_ratio, self.logit_ratio = (blowup_ratio, blowup_nats,
                                                                                   spike_ratio, logit_ratio)
        self.first_entropy: float | None = None
        self.first_logit: float | None = None
        self.first_router: dict[str, float] = {}  # router_max_load and router_entropy at their first measurement
        self.rewards: deque[float] = deque(maxlen=window)
        self.updates: dict[str, deque[float]] = {}
        self.best_reward_mean = float("-inf")

    def check(self, rec: dict[str, Any]) -> list[str]:
        """Add the ``warn_*`` flags to ``rec``; returns the warnings to print."""
        out = []
        entropy = rec.get("entropy")
        flag = False
        if entropy is not None:
            if self.first_entropy is None:
                self.first_entropy = entropy
            elif entropy < self.entropy_ratio * self.first_entropy:
                flag = True
                out.append(f"policy entropy collapsed: {entropy:.3f} nats per token, {self.entropy_ratio:.0%} of the "
                           f"first iteration's {self.first_entropy:.3f} is the floor (lower optimizer.lr?)")
        rec["warn_entropy_collapse"] = int(flag)
        first = self.first_entropy
        blowup = entropy is not None and first is not None and entropy > max(self.blowup_ratio * first,
                                                                             first + self.blowup_nats)
        if blowup:
            out.append(f"policy entropy blew up: {entropy:.3f} nats per token against the first iteration's "
                       f"{first:.3f} (the policy is turning to noise: lower optimizer.lr?)")
        rec["warn_entropy_blowup"] = int(blowup)
        out += self._spikes(rec)
        out += self._routers(rec)
        flag = False
        if "reward_mean" in rec:
            self.rewards.append(rec["reward_mean"])
            if len(self.rewards) == self.window:
                mean = sum(self.rewards) / self.window
                if self.best_reward_mean > self.min_reward and mean < self.reward_ratio * self.best_reward_mean:
                    flag = True
                    out.append(f"reward collapsed: {mean:.3f} over the last {self.window} iterations against a best "
                               f"of {self.best_reward_mean:.3f} (lower optimizer.lr?)")
                self.best_reward_mean = max(self.best_reward_mean, mean)
        rec["warn_reward_collapse"] = int(flag)
        groups = (rec.get("groups_trained") or 0) + (rec.get("groups_equal_reward") or 0)
        if groups:
            rec["no_signal_share"] = round((rec.get("groups_equal_reward") or 0) / groups, 4)
        stepless = bool(rec.get("trained_samples", 1)) and rec.get("optimizer_steps") == 0
        no_signal = rec.get("groups_trained") == 0 or stepless
        rec["warn_no_signal"] = int(bool(no_signal))
        if no_signal:
            out.append("no prompt group had rewards that differ: the RL loss was empty this iteration")
        return out

    def _spikes(self, rec: dict[str, Any]) -> list[str]:
        """``warn_update_spike`` and ``warn_logit_growth`` on ``rec``; their lines."""
        out, spike = [], False
        for key in sorted(k for k in rec if k.startswith("update_rms/")):
            value, seen = rec[key], self.updates.setdefault(key, deque(maxlen=self.window))
            if value is None:
                continue
            if len(seen) == self.window:
                median = sorted(seen)[self.window // 2]
                if median > 0 and value > self.spike_ratio * median:
                    spike = True
                    out.append(f"{key} spiked: {value:.3g} against a median of {median:.3g} over the last "
                               f"{self.window} iterations")
            seen.append(value)
        rec["warn_update_spike"] = int(spike)
        logit, grew = rec.get("max_logit"), False
        if logit is not None:
            if self.first_logit is None:
                self.first_logit = logit
            elif logit > self.logit_ratio * self.first_logit:
                grew = True
                out.append(f"attention logits grew: the largest is {logit:.1f}, {self.logit_ratio:g} times the first "
                           f"iteration's {self.first_logit:.1f} (optimizer.qk_clip_tau caps them)")
        rec["warn_logit_growth"] = int(grew)
        return out

    def _routers(self, rec: dict[str, Any]) -> list[str]:
        """``warn_router_collapse`` and ``warn_route_mismatch`` on an MoE's ``rec`` (nothing for a dense model)."""
        if "router_max_load" not in rec:
            return []
        out = []
        first = self.first_router
        for key in ("router_max_load", "router_entropy"):
            if rec.get(key) is not None:
                first.setdefault(key, rec[key])
        load, entropy = rec.get("router_max_load"), rec.get("router_entropy")
        crowded = load is not None and load > self.router_ratio * first["router_max_load"]
        narrowed = entropy is not None and entropy < self.entropy_ratio * first.get("router_entropy", entropy)
        if crowded or narrowed:
            out.append(f"MoE routers collapsed: the busiest expert takes {load:.2f}x an even share (first "
                       f"{first['router_max_load']:.2f}x), router entropy {entropy:.3f} nats (first "
                       f"{first.get('router_entropy', float('nan')):.3f}): tokens crowd onto a few experts")
        rec["warn_router_collapse"] = int(crowded or narrowed)
        mismatch = rec.get("route_mismatch")
        rec["warn_route_mismatch"] = int(mismatch is not None and mismatch > self.mismatch_limit)
        if rec["warn_route_mismatch"]:
            out.append(f"the trainer routes {mismatch:.1%} of token-layer pairs otherwise than the rollout did: those "
                       "importance ratios compare two networks (algorithm.routing_replay: rollout replays them)")
        return out

    def rolled_back(self) -> None:
        """The weights went back to an earlier, better state: the collapsed iterations' rewards no longer count
        (the window fills again before a reward collapse can be flagged), the best mean stays the bar."""
        self.rewards.clear()

    def replay(self, records: list[dict[str, Any]]) -> None:
        """Catch up with the iterations of an earlier attempt (``--resume``)."""
        for rec in records:
            self.check(dict(rec))
            if rec.get("rollback"):
                self.rolled_back()


class CollapseGuard:
    """Judges each iteration's record; keeps the best held-out ``metric`` seen (the warm start's included):
    ``accuracy`` or ``eval_reward`` (``run.best_metric``).

    A drop counts as a collapse when the metric falls below best − min(drop, relative · |best|): an absolute drop on
    a task the model mostly solves, a share of the best on one it rarely does (0.152 → 0.095 is a third lost,
    though under 0.1). With ``eval_tasks`` known, the margin is at least two standard errors of the estimate
    (accuracy: √(best(1 − best)/n); mean reward: the evaluation's ``eval_reward_std``/√n), so evaluation noise alone
    does not roll a run back."""

    def __init__(self, drop: float, best: float | None = None, relative: float = 0.3,
                 eval_tasks: int | None = None, metric: str = "accuracy") -> None:
        self.drop, self.best, self.relative, self.eval_tasks, self.metric = drop, best, relative, eval_tasks, metric

    def improved(self, rec: dict[str, Any]) -> bool:
        """Whether ``rec`` evaluated a new best held-out metric (then ``best`` is it)."""
        value = rec.get(self.metric)
        if value is None or (self.best is not None and value <= self.best):
            return False
        self.best = value
        return True

    def margin(self, spread: float | None = None) -> float:
        """How far below the best an evaluation may fall before it is a collapse (``spread``: the evaluation's
        reward standard deviation, for ``eval_reward``)."""
        assert self.best is not None
        m = min(self.drop, self.relative * abs(self.best))
        if self.eval_tasks:
            std = (self.best * (1 - self.best)) ** 0.5 if self.metric == "accuracy" else spread or 0.0
            m = max(m, 2 * std / self.eval_tasks ** 0.5)
        return m

    def verdict(self, rec: dict[str, Any]) -> str | None:
        """Why the run is collapsing at this record (``HealthMonitor.check`` ran on it), or None."""
        value = rec.get(self.metric)
        if value is not None and self.best is not None:
            margin = self.margin(rec.get("eval_reward_std"))
            if value < self.best - margin:
                name = "accuracy" if self.metric == "accuracy" else "mean reward"
                return f"held-out {name} {value:.3f} is more than {margin:.3g} below the best {self.best:.3f}"
        if rec.get("warn_reward_collapse"):
            return "the mean reward collapsed"
        if rec.get("warn_entropy_blowup"):
            return f"the policy's entropy blew up ({rec.get('entropy', 0):.3f} nats per token)"
        if rec.get("warn_router_collapse"):
            return (f"the MoE routers collapsed (the busiest expert at {rec.get('router_max_load', 0):.2f}x an even "
                    f"share)")
        return None
