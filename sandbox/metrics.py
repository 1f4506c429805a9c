"""Prometheus metrics of the sandbox service, in their own registry so several servers can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class SandboxMetrics:
    """Runs and execs by verdict, their latency, active sessions, running commands and rejected requests."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.commands = Counter("sandbox_commands", "Commands run, by kind (run or exec) and verdict",
                                ["kind", "verdict"], registry=r)
        self.latency = Histogram("sandbox_command_seconds", "Wall time of a command inside the service, "
                                 "including queueing and sandbox set-up", ["kind"], buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.active_sessions = Gauge("sandbox_active_sessions", "Open sessions", registry=r)
        self.running = Gauge("sandbox_running_commands", "Commands running now", registry=r)
        self.queued = Gauge("sandbox_queued_commands", "Commands waiting for a free slot", registry=r)
        self.rejections = Counter("sandbox_rejections", "Requests refused, by reason", ["reason"], registry=r)
        self.errors = Counter("sandbox_errors", "Requests that failed with an error status, by status",
                              ["status"], registry=r)
