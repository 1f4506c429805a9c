"""The Grafana dashboard helm/colocated-rl/dashboards/rl-run.json: well formed, and every metric its queries use is
one the code exports, as read from ``rl.loop.metrics.MetricsLog`` fed an iteration record with the controller's keys and
from ``sandbox.metrics.SandboxMetrics`` (each in a registry of its own, so nothing touches the process-global one)."""

from __future__ import annotations

import functools
import io
import json
import re
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

import engines.training.qk_clip
import rl.loop.controller
import rl.loop.stream
import rl.rollout.critic_loop
import rl.rollout.evaluate
import rl.rollout.rewards
from rl.loop.controller import step_metrics
from rl.loop.metrics import MetricsLog
from rl.rollout.partial import PartialRolloutBuffer
from sandbox.backend import Verdict
from sandbox.metrics import SandboxMetrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "helm" / "colocated-rl" / "dashboards" / "rl-run.json"
# Labels Prometheus adds to every scraped series (its target's), and the histogram bucket label.
TARGET_LABELS = {"job", "namespace", "instance", "pod", "service", "container", "endpoint"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}
METRIC = re.compile(r"\b(?:rl|sandbox)_\w+")
NAME_REGEX = re.compile(r'__name__\s*=~\s*"([^"]*)"')
MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])  # a collapsed row keeps its panels inside
    return out


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in _panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']!r}", query))
            assert var.get("definition", query) == query, f"variable {var['name']!r}: definition and query differ"
    return out


# --- what the code exports ------------------------------------------------------------------------------------------

def _records() -> list[dict]:
    """Iteration records with the keys ``rl.loop.controller.iteration`` writes: the reward statistics of
    ``rl.rollout.rewards.score`` (per type with several task types, multi-turn included), the critic's, held-out
    accuracy overall and per type (``rl.rollout.evaluate``), the partial-rollout counters and the optimizer-step metrics
    (through the real ``PartialRolloutBuffer.stats`` and ``step_metrics``), and the phase times."""
    sources = {
        rl.rollout.rewards: ["reward_mean", "response_len", "truncation_rate", "env_errors", "trained_samples",
                             "first_env_error", "multi_turn_episodes", "multi_turn_errors", "multi_turn_turns",
                             "multi_turn_truncated"],
        rl.rollout.evaluate: ["accuracy", "response_len"],
        rl.rollout.critic_loop: ["critic_prompts", "critic_agreement", "critic_unparseable", "critic_refused"],
        rl.loop.controller: ["iteration", "accuracy", "temperature", "rollout_tokens", "time_onload", "time_offload",
                             "time_train", "time_weight_update", "time_eval"],
        rl.loop.stream: ["time_rollout", "time_reward"],
    }
    for module, keys in sources.items():  # the keys below are the code's own spelling
        text = Path(module.__file__).read_text()
        # a phase's time is written by ``timed(times, PHASE)`` as ``time_PHASE``
        missing = [k for k in keys if f'"{k}"' not in text and f'timed(times, "{k.removeprefix("time_")}")' not in text]
        assert not missing, f"{module.__name__} no longer writes {missing}: update this test and the dashboard"
    per_type = {rl.rollout.rewards: ['f"truncation_rate/{name}"', 'f"reward_mean/{name}"'],
                rl.rollout.evaluate: ['f"accuracy/{name}"'],
                rl.loop.controller: ['f"temperature/{k}"', 'f"partial_{k}"'],
                engines.training.qk_clip: ['f"max_logit_layer{i}"']}
    for module, snippets in per_type.items():
        text = Path(module.__file__).read_text()
        assert all(s in text for s in snippets), f"{module.__name__}: per-type/per-layer keys changed"
    steps = [{"loss": 0.5, "ptx_loss": 1.2, "grad_norm": 0.8, "max_logit_layer0": 12.0, "max_logit_layer1": 13.5,
              "max_logit": 13.5, "qk_clipped_heads": 1.0}] * 2
    partial = {f"partial_{k}": v for k, v in PartialRolloutBuffer(max_age=2).stats().items()}
    base = {"iteration": 0, "reward_mean": 0.3, "response_len": 22.0, "truncation_rate": 0.01, "env_errors": 0,
            "trained_samples": 512, "first_env_error": "task x: boom", "truncation_rate/math": 0.0,
            "truncation_rate/code": 0.1, "reward_mean/math": 0.4, "reward_mean/code": 0.2, "multi_turn_episodes": 8,
            "multi_turn_errors": 0, "multi_turn_turns": 3.5, "multi_turn_truncated": 1, "critic_prompts": 8,
            "critic_agreement": 0.6, "critic_unparseable": 0.0, "critic_refused": 0, "accuracy": None,
            "temperature": 1.0, "temperature/math": 1.0, "temperature/code": 0.8, "rollout_tokens": 11000,
            **partial, **step_metrics(steps), "time_rollout": 0.5, "time_reward": 0.1, "time_onload": 0.0,
            "time_offload": 0.0, "time_train": 2.0, "time_weight_update": 0.1}
    evaluated = {**base, "iteration": 4, "accuracy": 0.4, "accuracy/math": 0.5, "accuracy/code": 0.3,
                 "time_eval": 0.9}
    return [base, evaluated]


@pytest.fixture(scope="module")
def rl_exported(tmp_path_factory) -> set[str]:
    """Metric names ``MetricsLog`` exports for the records above, collected from a registry of its own."""
    registry = CollectorRegistry()
    with pytest.MonkeyPatch.context() as mp:
        # MetricsLog imports Gauge from prometheus_client when it exports: bind it to this registry
        mp.setattr(prometheus_client, "Gauge", functools.partial(prometheus_client.Gauge, registry=registry))
        log = MetricsLog(tmp_path_factory.mktemp("run"), Console(file=io.StringIO()))
        log.prometheus = True  # what a prometheus_port sets, without starting an HTTP server
        for rec in _records():
            log.record(rec)
    names = {s.name for family in registry.collect() for s in family.samples}
    assert len(names) == len(log.gauges)
    return names


@pytest.fixture(scope="module")
def sandbox_exported() -> dict[str, set[str]]:
    """Sample names of ``SandboxMetrics`` (counters get ``_total``, histograms ``_bucket``/``_sum``/``_count``) with
    their label names."""
    metrics = SandboxMetrics()
    metrics.commands.labels("run", Verdict.OK.value).inc()
    metrics.latency.labels("exec").observe(0.02)
    metrics.rejections.labels("queue_full").inc()
    metrics.errors.labels("INTERNAL").inc()
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_exported_names_follow_the_code(rl_exported, sandbox_exported):
    assert {"rl_reward_mean", "rl_accuracy", "rl_accuracy_math", "rl_time_weight_update", "rl_max_logit_layer0",
            "rl_partial_waiting_groups", "rl_truncation_rate_code"} <= rl_exported
    assert "rl_first_env_error" not in rl_exported  # text is not exported
    assert {"sandbox_commands_total", "sandbox_command_seconds_bucket", "sandbox_rejections_total"} <= set(
        sandbox_exported)
    assert sandbox_exported["sandbox_commands_total"] == {"kind", "verdict"}


# --- the dashboard --------------------------------------------------------------------------------------------------

def test_dashboard_identity_and_datasource_variable(dashboard):
    assert dashboard["title"] == "Colocated RL run"
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job", "sandbox_job"} <= set(variables)
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}"
    for p in _panels(dashboard):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        assert all(t.get("datasource", p["datasource"]) == p["datasource"] for t in p["targets"])


def test_panel_ids_unique_and_grid_without_overlaps(dashboard):
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), p["title"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_every_query_uses_exported_metrics_and_their_labels(dashboard, rl_exported, sandbox_exported):
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    exported = rl_exported | set(sandbox_exported)
    for where, expr in _exprs(dashboard):
        for used in re.findall(r"\$\{?(\w+)", expr):
            assert used in variables | GRAFANA_VARIABLES, f"{where}: unknown variable ${used}"
        metric_labels: set[str] = set()
        for pattern in NAME_REGEX.findall(expr):  # per-type families: rl_accuracy_<type>, ...
            matched = {n for n in rl_exported if re.fullmatch(pattern, n)}
            assert matched, f"{where}: {pattern!r} matches no exported metric"
        names = set(METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))
        assert names or NAME_REGEX.search(expr), f"{where}: no metric in {expr!r}"
        for name in names:
            assert name in exported, f"{where}: {name} is not exported by the code"
            metric_labels |= sandbox_exported.get(name, set())
        allowed = metric_labels | TARGET_LABELS | {"__name__"}
        for label in MATCHER.findall(expr) + [w.strip() for g in GROUPING.findall(expr) for w in g.split(",")]:
            assert label in allowed, f"{where}: label {label!r} is not on {sorted(names)}"


def test_dashboard_covers_the_run_and_the_sandbox_service(dashboard):
    exprs = " ".join(e for _, e in _exprs(dashboard))
    used = set(METRIC.findall(re.sub(r'"[^"]*"', '""', exprs)))
    wanted = {"rl_reward_mean", "rl_accuracy", "rl_time_rollout", "rl_time_reward", "rl_time_train",
              "rl_time_weight_update", "rl_time_eval", "rl_response_len", "rl_truncation_rate", "rl_grad_norm",
              "rl_max_logit", "rl_env_errors", "sandbox_command_seconds_bucket", "sandbox_commands_total",
              "sandbox_running_commands", "sandbox_queued_commands", "sandbox_active_sessions",
              "sandbox_rejections_total"}
    assert wanted <= used, sorted(wanted - used)
    assert {"rl_accuracy_.+", "rl_reward_mean_.+"} <= set(NAME_REGEX.findall(exprs))  # per task type
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le, kind) (rate(sandbox_command_seconds_bucket" in exprs
    assert "sum by (verdict) (rate(sandbox_commands_total" in exprs
