"""Records are built by keyword: no call in the production packages builds one of the project's dataclasses from more
than four positional arguments (``EngineSettings(kind, model_dir, ...)`` with fifteen of them reads as a riddle, and
a field added in the middle silently shifts the rest). Read from the source, as ``tests/test_layering.py`` reads
imports: a call names the class directly, by an import of it, or as ``cls`` inside it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("rl", "engines", "checkpoint_engine", "envs", "sandbox")
MOST_POSITIONAL = 4
#: modules whose records are being reworked elsewhere (rl.sample's Sample, TurnRequest and TurnResult, rl.rollout's
#: TaskSets); their calls are left to that work
PENDING = {"rl.sample", "rl.rollout.data"}


def _module(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) == "dataclass":
            return True
    return False


def positional_records(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Every call under ``root``'s ``packages`` building one of their dataclasses from more than MOST_POSITIONAL
    positional arguments, as "path:line Class(n positional)"."""
    trees = {p: ast.parse(p.read_text(), str(p)) for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    records = {_module(p, root): {n.name for n in ast.walk(t) if isinstance(n, ast.ClassDef) and _is_dataclass(n)}
               for p, t in trees.items()}
    found = []
    for path, tree in trees.items():
        own = _module(path, root)
        named = dict.fromkeys(records[own], own)  # name in this module -> the module defining the record
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in records:
                named.update({a.asname or a.name: node.module for a in node.names if a.name in records[node.module]})
        found += _calls(tree, named, path.relative_to(root))
    return found


def _calls(tree: ast.AST, named: dict[str, str], where: Path) -> list[str]:
    out = []

    def visit(node: ast.AST, cls: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = cls if node.func.id == "cls" else node.func.id
            if name in named and named[name] not in PENDING and len(node.args) > MOST_POSITIONAL:
                out.append(f"{where}:{node.lineno} {name}({len(node.args)} positional)")
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(tree, None)
    return out


def test_no_record_is_built_from_more_than_four_positional_arguments():
    assert positional_records(ROOT, PRODUCTION) == []


def test_the_checker_finds_a_positional_record_by_name_by_import_and_as_cls(tmp_path):
    """The checker itself can fail: a record built positionally in its own module, through an import, or as
    ``cls`` in a classmethod is found; keywords, four positional arguments and a class that is no dataclass are
    not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "records.py").write_text(
        "from dataclasses import dataclass\n\n\n"
        "@dataclass(frozen=True)\nclass Rec:\n    a: int\n    b: int\n    c: int\n    d: int\n    e: int = 0\n\n"
        "    @classmethod\n    def make(cls):\n        return cls(1, 2, 3, 4, 5)\n\n\n"
        "class Plain:\n    def __init__(self, *a):\n        pass\n\n\n"
        "X = Rec(1, 2, 3, 4, 5)\nY = Rec(1, 2, 3, 4, e=5)\nZ = Plain(1, 2, 3, 4, 5)\n")
    (pkg / "user.py").write_text("from pkg.records import Rec as R\n\nW = R(1, 2, 3, 4, 5)\n"
                                 "V = R(a=1, b=2, c=3, d=4)\n")
    assert positional_records(tmp_path, ("pkg",)) == [
        "pkg/records.py:14 Rec(5 positional)", "pkg/records.py:22 Rec(5 positional)",
        "pkg/user.py:3 R(5 positional)"]
