"""The sandbox service's options: one typed schema, read by the service and its backends as is.

A run config embeds ``SandboxOptions`` as its ``sandbox`` section, and ``rl sandbox serve`` hands that very object to
``sandbox.server.server_from_config``; no layer copies its fields into other arguments. Unknown keys are refused
(with their name) and no number may be NaN or infinite.

The local backend's keys sit at the top of the section (``sandbox.disk_mb``), where run configs have always had
them, so ``SandboxOptions`` extends ``LocalOptions``; the pod backend's keys are ``sandbox.kubernetes``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from typing_extensions import Self

from sandbox.backend import Limits


class StrictOptions(BaseModel):
    """Immutable, and refuses unknown keys and non-finite numbers (like the run config it is part of)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def override(self, **fields: Any) -> Self:
        """These options with ``fields`` replaced, validated as a config is (pydantic's ValidationError names a bad
        or unknown key); the sections left alone stay the same objects."""
        if not fields:
            return self
        return self.model_validate({**dict(self), **fields})


class LimitsOptions(StrictOptions):
    """Default limits of one sandboxed command (a request may ask for others, up to the server's maximum)."""

    # the defaults are Limits' own (the in-pod agent uses Limits without pydantic), in the units of a config
    wall_s: float = Field(Limits.wall_s, gt=0)
    cpu_s: float = Field(Limits.cpu_s, gt=0)
    memory_mb: int = Field(Limits.memory_bytes >> 20, ge=16)
    processes: int = Field(Limits.processes, ge=1)
    open_files: int = Field(Limits.open_files, ge=16)
    file_size_mb: int = Field(Limits.file_size_bytes >> 20, ge=1)
    output_kb: int = Field(Limits.output_bytes >> 10, ge=1, description="per stream (stdout and stderr each)")
    cpus: float = Field(Limits.cpus, gt=0, description="CPUs the whole sandbox may use at once (cgroup cpu.max)")

    def to_limits(self) -> Limits:
        """These limits as the backends take them (bytes, not MiB or KiB)."""
        return Limits(wall_s=self.wall_s, cpu_s=self.cpu_s, memory_bytes=self.memory_mb << 20,
                      processes=self.processes, open_files=self.open_files,
                      file_size_bytes=self.file_size_mb << 20, output_bytes=self.output_kb << 10, cpus=self.cpus)


class LocalOptions(StrictOptions):
    """The local (bubblewrap) backend's keys."""

    disk_mb: int = Field(256, ge=0, description="local backend: disk quota of each session's /work and /tmp "
                                                "together (a tmpfs); 0 = none")

    @property
    def disk_bytes(self) -> int:
        """The disk quota in bytes (0: none)."""
        return self.disk_mb << 20


class KubernetesOptions(StrictOptions):
    """The pod backend: one pod per session, from the task's image (see docs/sandbox-kubernetes.md)."""

    namespace: str = "default"
    agent_image: str = Field("colocated-rl:cpu", description="runtime image whose init container copies the agent")
    default_image: str = Field("python:3.11-slim", description="image of sessions that name none")
    runtime_class: str | None = Field(
        "auto", description="RuntimeClass of session pods, for a kernel boundary between sandboxes and the node: "
                            "auto (gVisor, RuntimeClass gvisor, where the cluster has it; else the node's runtime, "
                            "with a warning), a name (e.g. gvisor, kata), or none/null for the node's runtime")
    ttl_s: float = Field(3600, gt=0, description="pods are deleted after this long, even if the service dies")
    max_creates_per_s: float = Field(20, gt=0, description="client-side pod-creation rate limit")
    warm_pool: dict[str, int] = Field(default_factory=dict, description="image -> ready pods kept waiting")
    allowed_images: list[str] = Field([], description="images a session may ask for, as fnmatch patterns "
                                      "(python:3.11-*, registry.example.com/swe/*); default_image and the warm_pool "
                                      "images are always allowed. Empty (the default): only those, since a session "
                                      "pod runs with the run's pull secrets; ['*'] allows any image")
    cpu: str = Field("1", description="Kubernetes quantity per session pod, e.g. 1 or 500m")
    memory: str = Field("2Gi", description="Kubernetes quantity per session pod")
    image_pull_secrets: list[str] = Field([], description="Secrets for a private registry of the session images")
    labels: dict[str, str] = Field({}, description="extra labels on session pods (the chart: the run's)")
    node_selector: dict[str, str] = Field({}, description="where session pods may run")
    tolerations: list[dict[str, Any]] = Field([], description="taints session pods tolerate")
    priority_class: str | None = Field(None, description="PriorityClass of session pods")
    run_as_user: int = Field(65534, ge=1, description="uid (and gid, fsGroup) of session pods, never root; an image "
                             "that brings its own work directory must let this uid write it")

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> Any:
        # `--set sandbox.kubernetes.cpu=2` reads as a number; Kubernetes takes quantities as strings
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


class SandboxOptions(LocalOptions):
    """A sandbox service: where it listens, how much it takes on, its backend, and commands' default limits."""

    address: str | None = Field(None, description="host:port of a running `rl sandbox serve`; None starts a local "
                                                  "service inside the run when an environment needs one")
    backend: Literal["local", "kubernetes"] = "local"
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    concurrency: int = Field(8, ge=1, description="commands running at once")
    max_queue: int = Field(256, ge=0, description="commands waiting for a slot before requests are refused")
    max_sessions: int = Field(256, ge=1)
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus /metrics of the service")
    advertise_address: str | None = Field(None, description="host:port clients reach this replica at (its pod "
                                          "IP on Kubernetes): sessions created here are used through it")
    drain_s: float = Field(20, ge=0, description="at shutdown (SIGTERM): how long running commands and open "
                           "sessions get to finish before they are cut; keep it below the pod's "
                           "terminationGracePeriodSeconds")
    limits: LimitsOptions = Field(default_factory=LimitsOptions)
    kubernetes: KubernetesOptions = Field(default_factory=KubernetesOptions)

    @property
    def backend_options(self) -> LocalOptions | KubernetesOptions:
        """The options of the chosen backend, as they are: this object (local) or its ``kubernetes`` section."""
        return self.kubernetes if self.backend == "kubernetes" else self
