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
    # the engines' contracts and the model's layout, never the trainer (a trainer hands it its shards)
    "checkpoint_engine": {"engines.model", "engines.inference", "engines.device"},
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


#: the rooms of rl/ -> the parts of rl they may import besides themselves: the shared vocabulary at the root
#: (config, errors, seeds, sample, settings), then each room only those below it; the loop (and the front door:
#: cli, launch, the package) sits on top. The vocabulary itself may import only the algorithm's pure formulas.
VOCABULARY = {"rl.config", "rl.errors", "rl.seeds", "rl.sample", "rl.settings"}
RL_ROOMS = {
    "rl/algo": VOCABULARY,
    "rl/rollout": VOCABULARY | {"rl.algo"},
    "rl/setup": VOCABULARY | {"rl.algo", "rl.rollout"},
}


def _rl_violations(room: str, allowed: set[str]) -> list[str]:
    own = room.replace("/", ".")
    bad = []
    paths = sorted((ROOT / room).rglob("*.py")) if (ROOT / room).is_dir() else [ROOT / f"{room}.py"]
    for path in paths:
        for line, name in _imports(path):
            if name.split(".")[0] != "rl" or name == own or name.startswith(own + "."):
                continue
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("room", sorted(RL_ROOMS))
def test_rooms_of_rl_import_only_what_is_below_them(room):
    assert _rl_violations(room, RL_ROOMS[room]) == []


@pytest.mark.parametrize("module", sorted(VOCABULARY))
def test_the_vocabulary_of_rl_imports_only_the_algorithms_formulas(module):
    allowed = (VOCABULARY - {module}) | {"rl.algo.objectives", "rl.algo.mismatch", "rl.algo.schedules"}
    assert _rl_violations(module.replace(".", "/"), allowed) == []


def test_rl_has_few_modules_at_its_top_and_no_long_signatures():
    """The front door and shared vocabulary at the root, the rest in rooms (at most 12 modules); no function in
    rl/ takes more than 8 parameters (a bundle of settings says what it takes)."""
    assert len(list((ROOT / "rl").glob("*.py"))) <= 12
    long = []
    for path in sorted((ROOT / "rl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) + bool(a.vararg) + bool(a.kwarg) > 8:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []


def test_rl_finds_no_capability_by_probing():
    """Environments and engines declare what they can do (``envs.base.Env``; ``RolloutEngine``, and what each engine
    kind supports in ``engines.inference.capabilities``); rl/ reads the declarations instead of asking
    ``getattr``/``hasattr`` of an environment, an engine or its class."""
    import re

    probe = re.compile(r"(getattr|hasattr)\((type\()?(env|self\.env|engine|self\.engine|cls)\b")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "rl").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []


#: the production packages whose modules may form no import circle of more than two files
PRODUCTION = ("rl", "engines", "checkpoint_engine", "envs", "sandbox")


def _module_graph() -> dict[str, set[str]]:
    """Production module -> the production modules it imports (at any depth: local and type-only imports count)."""
    mods: dict[str, Path] = {}
    for pkg in PRODUCTION:
        for path in (ROOT / pkg).rglob("*.py"):
            if "_pb2" not in path.name:
                name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                mods[name] = path

    def owner(name: str) -> str | None:  # `from engines.model.lora.adapters import X`: the module, or X when it is one
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[m] |= {o for n in names if n.split(".")[0] in PRODUCTION and (o := owner(n)) not in (None, m)}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_spans_more_than_two_modules():
    """A circle of imports ties its modules into one: none in the production packages joins more than two files
    (a module and its helper), whatever depth the imports are written at."""
    assert [c for c in _circles(_module_graph()) if len(c) > 2] == []


def test_the_circle_finder_sees_a_circle_of_three():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


#: the rooms of engines/model -> the rooms they may import besides themselves; the shared modules at its root (the
#: checkpoint layout, log-probs, shard helpers) are open to all, and import no room
MODEL_ROOMS = {
    "text": set(),
    "native": set(),
    "io": {"native"},
    "hf": {"native"},
    "lora": {"native", "hf"},
}


def _model_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["engines", "model"] and len(parts) > 3 else None


def test_rooms_of_engines_model_import_only_the_rooms_below_them():
    graph = _module_graph()
    rooms = {p.name for p in (ROOT / "engines/model").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(MODEL_ROOMS), "a new room of engines/model needs its place in MODEL_ROOMS"
    bad = []
    for module, imports in graph.items():
        if not module.startswith("engines.model."):
            continue
        room = _model_room(module)
        allowed = MODEL_ROOMS[room] | {room} if room else set()  # a root module imports no room
        bad += [f"{module} imports {m}" for m in sorted(imports) if (r := _model_room(m)) and r not in allowed]
    assert bad == []


def test_the_architecture_map_lists_every_module():
    """docs/architecture.md's map of the packages names every module of the production packages and the benchmarks
    in its package's row (by its path from the row's folder), so a new module cannot hide from the map."""
    import re

    doc = (ROOT / "docs/architecture.md").read_text()
    section = doc[doc.index("## Map of the packages"):]
    section = section[:section.index("\n## ", 5)]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            first, rest = line[2:].split(" | ", 1)
            for folder in re.findall(r"`([\w/.]+/)`", first):
                rows[folder] = rows.get(folder, "") + rest
            for module in re.findall(r"`([\w/]+\.py)`", first):  # a module with a row of its own
                rows[module] = f"`{module}"
    missing = []
    for pkg in (*PRODUCTION, "benchmarks"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if path.name == "__init__.py" or "_pb2" in path.name:
                continue
            folder = max((f for f in rows if rel.startswith(f)), key=len, default=None)
            if folder is None or f"`{rel.removeprefix(folder) if folder.endswith('/') else rel}" not in rows[folder]:
                missing.append(rel)
    assert missing == []
