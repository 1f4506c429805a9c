"""The sandbox's one options schema (sandbox.options): the run config's ``sandbox`` section as is, its unknown keys
named, its keys unchanged, and the very objects the service and its backends are started with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kubernetes
import pytest
import yaml
from pydantic import ValidationError

from rl.config import dump_config, parse_config
from rl.errors import UserError
from sandbox.backend import DEFAULT_LIMITS, Limits
from sandbox.options import KubernetesOptions, LimitsOptions, LocalOptions, SandboxOptions
from sandbox.server import server_from_config
from tests.kube_standin import KubeApiStandIn

ROOT = Path(__file__).resolve().parents[1]

# the public keys of the section: configs, the Helm chart's --set flags and users' files name them
SANDBOX_KEYS = {"address", "backend", "host", "port", "concurrency", "max_queue", "max_sessions", "metrics_port",
                "advertise_address", "drain_s", "limits", "disk_mb", "kubernetes"}
LIMITS_KEYS = {"wall_s", "cpu_s", "memory_mb", "processes", "open_files", "file_size_mb", "output_kb", "cpus"}
KUBERNETES_KEYS = {"namespace", "agent_image", "default_image", "runtime_class", "ttl_s", "max_creates_per_s",
                   "warm_pool", "cpu", "memory", "image_pull_secrets", "labels", "node_selector", "tolerations",
                   "priority_class", "run_as_user", "allowed_images"}


@pytest.mark.parametrize("section, key", [({"bakend": "local"}, "sandbox.bakend"),
                                          ({"limits": {"wall": 3}}, "sandbox.limits.wall"),
                                          ({"kubernetes": {"namspace": "rl"}}, "sandbox.kubernetes.namspace")])
def test_an_unknown_key_fails_with_one_line_naming_it(section, key):
    with pytest.raises(UserError) as e:
        parse_config({"sandbox": section}, "run.yaml")
    assert str(e.value).splitlines() == ["invalid config run.yaml:", f"  {key}: unknown key"]
    # the schema alone (without rl) names it too
    with pytest.raises(ValidationError) as v:
        SandboxOptions.model_validate(section)
    assert [(".".join(map(str, err["loc"])), err["type"]) for err in v.value.errors()] == [
        (key.removeprefix("sandbox."), "extra_forbidden")]


def test_the_cli_names_a_bad_key_or_flag_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sandbox:\n  kubernetes:\n    ttl: 60\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args, line in ((["--config", str(bad)], "  sandbox.kubernetes.ttl: unknown key"),
                       (["--set", "sandbox.limits.cpu=2"], "  sandbox.limits.cpu: unknown key"),
                       (["--port", "70000"], "  sandbox.port: Input should be less than or equal to 65535 "
                                             "(got 70000)")):
        proc = subprocess.run([sys.executable, "-m", "rl.cli", "sandbox", "serve", *args], capture_output=True,
                              text=True, env=env, timeout=60)
        assert proc.returncode == 2 and line in proc.stderr.splitlines(), proc.stderr
        assert "Traceback" not in proc.stderr


def test_the_run_config_embeds_the_schema_and_its_keys_stay():
    from rl import config

    assert config.Config.model_fields["sandbox"].annotation is SandboxOptions
    assert (config.SandboxConfig, config.SandboxLimitsConfig, config.KubernetesSandboxConfig) == (
        SandboxOptions, LimitsOptions, KubernetesOptions)  # the names rl.config always exported
    raw = yaml.safe_load(dump_config(parse_config({})))["sandbox"]
    assert set(raw) == SANDBOX_KEYS
    assert set(raw["limits"]) == LIMITS_KEYS and set(raw["kubernetes"]) == KUBERNETES_KEYS
    assert isinstance(SandboxOptions(), LocalOptions)  # the local backend's keys sit at the top of the section


def test_a_sandbox_section_round_trips():
    section = {"address": "dns:///rl-sandbox.rl.svc:50051", "backend": "kubernetes", "host": "0.0.0.0", "port": 6000,
               "concurrency": 3, "max_queue": 0, "max_sessions": 9, "metrics_port": 9100,
               "advertise_address": "10.0.0.7:6000", "disk_mb": 0, "drain_s": 5.5,
               "limits": {"wall_s": 2.5, "cpu_s": 2, "memory_mb": 64, "processes": 8, "open_files": 32,
                          "file_size_mb": 2, "output_kb": 16, "cpus": 0.5},
               "kubernetes": {"namespace": "rl", "agent_image": "reg/rt:1", "default_image": "task:base",
                              "runtime_class": "gvisor", "ttl_s": 600, "max_creates_per_s": 5,
                              "warm_pool": {"task:base": 2}, "cpu": 2, "memory": "1Gi",
                              "image_pull_secrets": ["creds"], "labels": {"colocated-rl/run": "r1"},
                              "node_selector": {"pool": "sandbox"},
                              "tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
                              "priority_class": "rl-training", "run_as_user": 1000,
                              "allowed_images": ["task:*"]}}
    cfg = parse_config({"sandbox": section})
    dumped = yaml.safe_load(dump_config(cfg))["sandbox"]
    assert dumped == {**section, "kubernetes": {**section["kubernetes"], "cpu": "2"}}  # a quantity is a string
    assert parse_config({"sandbox": dumped}).sandbox == cfg.sandbox
    assert SandboxOptions.model_validate(cfg.sandbox.model_dump()) == cfg.sandbox


def test_limits_have_one_set_of_defaults():
    assert LimitsOptions().to_limits() == DEFAULT_LIMITS == Limits()
    got = LimitsOptions(memory_mb=64, file_size_mb=2, output_kb=16).to_limits()
    assert (got.memory_bytes, got.file_size_bytes, got.output_bytes) == (64 << 20, 2 << 20, 16 << 10)


def test_override_validates_and_keeps_the_sections_it_leaves():
    sc = parse_config({"sandbox": {"limits": {"wall_s": 3}}}).sandbox
    assert sc.override() is sc
    moved = sc.override(port=7000, backend="kubernetes")
    assert (moved.port, moved.backend) == (7000, "kubernetes") and moved.limits is sc.limits
    assert moved.kubernetes is sc.kubernetes and moved.backend_options is sc.kubernetes
    with pytest.raises(ValidationError, match="port"):
        sc.override(port=-1)
    with pytest.raises(ValidationError, match="bogus"):
        sc.override(bogus=1)


class _Wider(SandboxOptions):
    """The schema with a key added: it must reach the backend with no other change."""

    marker: str = "default"


class _WiderPods(KubernetesOptions):
    marker: str = "default"


def test_the_local_service_and_backend_get_the_config_objects_themselves():
    sc = parse_config({"sandbox": {"port": 0, "concurrency": 2, "max_queue": 3, "disk_mb": 8,
                                   "limits": {"wall_s": 4, "memory_mb": 128}}}).sandbox
    with server_from_config(sc) as srv:
        backend = srv.service.backend
        assert srv.options is sc and backend.options is sc
        assert srv.service.default_limits == sc.limits.to_limits() and backend.disk_bytes == 8 << 20
    wider = _Wider(port=0, marker="reached")
    with server_from_config(wider) as srv:
        assert srv.service.backend.options.marker == "reached"


def test_the_pod_backend_gets_the_config_objects_themselves(monkeypatch):
    Configuration = kubernetes.client.Configuration
    monkeypatch.setattr(Configuration, "_default", Configuration._default)  # restored afterwards
    with KubeApiStandIn() as api:
        # "in the cluster" is the stand-in: the backend builds its own client, as `rl sandbox serve` does in a pod
        monkeypatch.setattr(kubernetes.config, "load_incluster_config",
                            lambda: Configuration.set_default(api.api_client().configuration))
        pods = _WiderPods(namespace="rl", cpu="2", marker="reached")
        sc = SandboxOptions(backend="kubernetes", port=0, kubernetes=pods)
        with server_from_config(sc) as srv:
            backend = srv.service.backend
            assert srv.options is sc and backend.options is pods and backend.options.marker == "reached"
            assert backend.namespace == "rl" and backend._pod_options["resources"] == {"cpu": "2", "memory": "2Gi"}


def test_a_run_without_a_sandbox_address_starts_its_service_from_its_own_section():
    """An environment that runs code, in a run with no ``sandbox.address``, reaches a service started from
    the run's ``sandbox`` section: its default limits are the config's (a 1 s wall limit stops a 5 s
    program), not the service's built-in ones."""
    from rl.rollout.episodes import make_env, sandbox_address
    from sandbox.client import connect

    cfg = parse_config({"env": {"name": "code"}, "sandbox": {"limits": {"wall_s": 1}}})
    env = make_env(cfg.env, cfg)
    assert env.sandbox_address == sandbox_address(cfg) and env.sandbox_address.split(":")[1] != "50051"
    with connect(env.sandbox_address) as client:
        res = client.run(["python3", "-c", "import time; time.sleep(5)"])
    assert res.verdict.name == "TIMEOUT" and res.wall_s < 4
