"""Which package may import which (docs/architecture.md): lower packages never reach up.

Every import statement is read, at any depth (a function's local import counts as much as the
module's), so a lazy import cannot hide a dependency on the controller.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package -> the project's packages it may import (besides itself)
ALLOWED = {
    "engines/model": set(),
    "engines/inference": {"engines.model", "engines.device"},
    "engines/training": {"engines.model", "engines.device"},
    "checkpoint_engine": {"engines"},
    "envs": {"engines.model", "sandbox"},
    "sandbox": set(),
}
PROJECT = ("rl", "engines", "checkpoint_engine", "envs", "sandbox", "benchmarks", "tests")


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "engines":  # `from engines import device`
                found += [(node.lineno, f"engines.{a.name}") for a in node.names]
    return found


def _violations(package: str) -> list[str]:
    own = package.replace("/", ".")
    allowed = ALLOWED[package] | {own}
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, name in _imports(path):
            if name.split(".")[0] not in PROJECT or name == "engines":
                continue
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_lower_packages_never_import_upwards(package):
    assert _violations(package) == []


def test_no_lower_package_imports_rl():
    """The controller (rl/) sits on top: engines, the checkpoint engine, environments and the sandbox
    work without it, so a user can embed any of them alone."""
    offenders = [v for p in ALLOWED for v in _violations(p) if v.split(" imports ")[1].split(".")[0] == "rl"]
    assert offenders == []


def test_the_checker_sees_a_local_import(tmp_path):
    """A lazy import inside a function is found: the checker itself can fail."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from rl.config import Config\n    return Config\n")
    assert _imports(f) == [(2, "rl.config")]
