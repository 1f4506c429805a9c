"""SWE-smith-style task generation, offline: inject bugs into a real package and keep those its tests catch.

``generate_swe_tasks`` copies the installed sources of a pure-Python package (``toolz`` by default, tests in
``toolz/tests``) to ``out_dir/repo/``, enumerates AST-level mutations inside function bodies (flipped
comparisons, ``and``/``or`` swaps, ``+``/``-`` swaps, integer constants and slice bounds off by one, negated
``if``/``while`` conditions, ``return None``, swapped call arguments), and tries them in a random order (fixed by
the seed): each mutant's file is written into one sandbox session and the tests of that module are run there.
A mutant is kept when some tests that pass on the clean package fail (FAIL_TO_PASS) and some still pass
(PASS_TO_PASS, sampled); at most one mutant per function. Each edit replaces only the mutated tokens' source
span and is checked by re-parsing, so the gold ``patch`` (mutant → original, a unified diff) is a line or two.

``out_dir/tasks.jsonl`` holds one ``envs.tasks`` record per task (``load_tasks`` reads it), with the SWE-bench
fields and ``repo_dir`` / ``files`` / ``test_command`` in ``meta`` (see ``envs.swe``). Problem statements are
written from the failing tests' names and messages only.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import importlib.metadata
import importlib.util
import itertools
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.base import Task
from envs.swe import load_repo_files, make_patch, run_tests
from envs.tasks import save_tasks

_CMP_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_CMP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
             ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
_BOOL = {ast.And: (ast.Or, "and", "or"), ast.Or: (ast.And, "or", "and")}
_ARITH = {ast.Add: (ast.Sub, "+", "-"), ast.Sub: (ast.Add, "-", "+")}
# The tasks' test command: pytest without third-party plugins, whose loading (hypothesis...) takes most of a run.
TEST_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -rA -q -p no:cacheprovider --tb=short {tests}"
_ADDRESS = re.compile(r"0?x[0-9a-f]{8,}")  # pytest may cut a repr to "...x7f3a..."
_GITHUB = re.compile(r"github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?/?$")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One possible mutation: a node (by ``ast.walk`` index) of a file, and what to do to it."""

    path: str  # relative to the repository root, e.g. "toolz/itertoolz.py"
    node: int
    kind: str
    arg: int
    function: str
    line: int


class Mutator:
    """The source of one file and the mutations its function bodies allow."""

    def __init__(self, path: str, source: str):
        self.path, self.source = path, source
        self.tree = ast.parse(source)
        self._starts = [0]
        for line in source.splitlines(True):
            self._starts.append(self._starts[-1] + len(line))
        self._lines = source.splitlines(True)

    def offset(self, line: int, col: int) -> int:
        """A character offset from an AST (line, UTF-8 byte column) position."""
        return self._starts[line - 1] + len(self._lines[line - 1].encode()[:col].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        """The character span of ``node`` in the source."""
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def candidates(self) -> list[Candidate]:
        """Every mutation inside a function body, in a fixed order."""
        index = {id(n): i for i, n in enumerate(ast.walk(self.tree))}
        out: list[Candidate] = []
        seen: set[int] = set()
        for fn in ast.walk(self.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for stmt in fn.body:
                for node in ast.walk(stmt):
                    if id(node) in seen:  # nested functions: count a node once, under its innermost function
                        continue
                    seen.add(id(node))
                    out.extend(Candidate(path=self.path, node=index[id(node)], kind=kind, arg=arg, function=fn.name,
                                         line=node.lineno) for kind, arg in _kinds(node))
        return out

    def apply(self, cand: Candidate) -> str | None:
        """The mutated source, or None when no text edit reproduces the AST change exactly."""
        tree = copy.deepcopy(self.tree)
        node = list(ast.walk(tree))[cand.node]
        alternatives = _MUTATE[cand.kind](self, node, cand.arg)
        want = ast.dump(tree)
        for edits in alternatives:
            text = self.source
            for start, end, new in sorted(edits, reverse=True):
                text = text[:start] + new + text[end:]
            try:
                if text != self.source and ast.dump(ast.parse(text)) == want:
                    return text
            except SyntaxError:
                continue
        return None


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _kinds(node: ast.AST) -> list[tuple[str, int]]:
    """The mutations that apply to ``node``: (kind, argument)."""
    if isinstance(node, ast.Compare):
        return [("flip_comparison", i) for i, op in enumerate(node.ops) if type(op) in _CMP_FLIP]
    if isinstance(node, ast.BoolOp):
        return [("swap_bool_op", 0)]
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        strings = any(isinstance(x, (ast.JoinedStr, ast.Constant)) and isinstance(getattr(x, "value", ""), str)
                      for x in (node.left, node.right))
        return [] if strings else [("swap_arith_op", 0)]
    if _is_int(node):
        return [("off_by_one", d) for d in (1, -1) if node.value + d >= 0]
    if isinstance(node, ast.Slice):
        return [("slice_bound", d) for d in (1, -1) if node.upper is not None and not _is_int(node.upper)]
    if isinstance(node, (ast.If, ast.While, ast.IfExp)):  # comparisons are flipped instead: `not a is None` reads odd
        return [] if isinstance(node.test, ast.Compare) else [("negate_condition", 0)]
    if isinstance(node, ast.Return) and node.value is not None:
        return [] if isinstance(node.value, ast.Constant) and node.value.value is None else [("return_none", 0)]
    if isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args):
        return [("swap_arguments", 0)]
    return []


def _op_in_gap(m: Mutator, left: ast.AST, right: ast.AST, old: str, new: str) -> tuple[int, int, str]:
    """An edit replacing the operator ``old`` between two operands by ``new``."""
    start, end = m.span(left)[1], m.span(right)[0]
    gap = m.source[start:end]
    found = re.search(rf"(?<![\w<>=!]){re.escape(old)}(?![\w<>=])", gap)
    at = found.start() if found else 0
    return start + at, start + at + len(old), new


def _flip_comparison(m: Mutator, node: ast.Compare, i: int) -> list[list[tuple[int, int, str]]]:
    old = type(node.ops[i])
    left = node.left if i == 0 else node.comparators[i - 1]
    edit = _op_in_gap(m, left, node.comparators[i], _CMP_TEXT[old], _CMP_TEXT[_CMP_FLIP[old]])
    node.ops[i] = _CMP_FLIP[old]()
    return [[edit]]


def _swap_op(m: Mutator, node: ast.BoolOp | ast.BinOp, _: int) -> list[list[tuple[int, int, str]]]:
    table = _BOOL if isinstance(node, ast.BoolOp) else _ARITH
    new_op, old_text, new_text = table[type(node.op)]
    operands = node.values if isinstance(node, ast.BoolOp) else [node.left, node.right]
    edits = [_op_in_gap(m, a, b, old_text, new_text) for a, b in itertools.pairwise(operands)]
    node.op = new_op()
    return [edits]


def _off_by_one(m: Mutator, node: ast.Constant, d: int) -> list[list[tuple[int, int, str]]]:
    start, end = m.span(node)
    node.value += d
    return [[(start, end, str(node.value))]]


def _slice_bound(m: Mutator, node: ast.Slice, d: int) -> list[list[tuple[int, int, str]]]:
    start, end = m.span(node.upper)
    seg, op = m.source[start:end], ("+" if d > 0 else "-")
    node.upper = ast.BinOp(node.upper, ast.Add() if d > 0 else ast.Sub(), ast.Constant(1))
    return [[(start, end, f"{seg} {op} 1")], [(start, end, f"({seg}) {op} 1")]]


def _negate_condition(m: Mutator, node: ast.If | ast.While | ast.IfExp, _: int) -> list[list[tuple[int, int, str]]]:
    start, end = m.span(node.test)
    seg = m.source[start:end]
    if isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not):
        a, b = m.span(node.test.operand)
        inner = m.source[a:b]
        node.test = node.test.operand
        return [[(start, end, inner)], [(start, end, f"({inner})")]]
    node.test = ast.UnaryOp(ast.Not(), node.test)
    return [[(start, end, f"not {seg}")], [(start, end, f"not ({seg})")]]


def _return_none(m: Mutator, node: ast.Return, _: int) -> list[list[tuple[int, int, str]]]:
    start, end = m.span(node.value)
    node.value = ast.Constant(None)
    return [[(start, end, "None")]]


def _swap_arguments(m: Mutator, node: ast.Call, _: int) -> list[list[tuple[int, int, str]]]:
    (a0, a1), (b0, b1) = m.span(node.args[0]), m.span(node.args[1])
    first, second = m.source[a0:a1], m.source[b0:b1]
    node.args[0], node.args[1] = node.args[1], node.args[0]
    return [[(a0, a1, second), (b0, b1, first)]]


_MUTATE = {"flip_comparison": _flip_comparison, "swap_bool_op": _swap_op, "swap_arith_op": _swap_op,
           "off_by_one": _off_by_one, "slice_bound": _slice_bound, "negate_condition": _negate_condition,
           "return_none": _return_none, "swap_arguments": _swap_arguments}


def package_files(package: str) -> tuple[Path, dict[str, bytes]]:
    """The installed package's directory and its files by repository path (``toolz/...``), caches left out."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package!r} is not an installed package (a directory with __init__.py)")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = load_repo_files({"repo_dir": str(root)})
    return root, {f"{package}/{p}": data for p, data in files.items()}


def _repo_name(package: str) -> str:
    """``owner/name`` from the package's GitHub URL when its metadata has one, else the package name."""
    try:
        meta = importlib.metadata.metadata(package)
        urls = [meta.get("Home-page") or "", *(u.split(",")[-1].strip() for u in meta.get_all("Project-URL") or [])]
    except importlib.metadata.PackageNotFoundError:
        urls = []
    for url in urls:
        m = _GITHUB.search(url)
        if m:
            return m.group(1)
    return package


def _test_target(path: str, tests_dir: str, files: dict[str, bytes]) -> str:
    """The test module for a source file (``pkg/mod.py`` → ``pkg/tests/test_mod.py``), else all the tests."""
    name = Path(path).stem.lstrip("_")
    module = f"{tests_dir}/test_{name}.py"
    return module if module in files else tests_dir


def problem_statement(package: str, failing: list[str], messages: dict[str, str], rng: random.Random) -> str:
    """An issue written from the failing tests' names and messages, without the fix."""
    names = sorted({t.split("::")[-1].split("[")[0].removeprefix("test_") for t in failing})
    subject = ", ".join(f"`{n}`" for n in names[:3]) + (" and more" if len(names) > 3 else "")
    opener = rng.choice([f"Something is wrong with {subject} in {package}.",
                         f"{subject} no longer behaves as documented.",
                         f"Unexpected results from {subject}."])
    lines = [opener, "", "These tests fail:", ""]
    for t in failing[:6]:
        msg = _ADDRESS.sub("0x?", messages.get(t, "").strip())  # object addresses would differ between runs
        lines.append(f"- `{t}`" + (f": {msg[:300]}" if msg else ""))
    if len(failing) > 6:
        lines.append(f"- ... and {len(failing) - 6} more")
    lines += ["", "They should pass, and the rest of the test suite should keep passing."]
    return "\n".join(lines)


def generate_swe_tasks(package: str = "toolz", n: int = 20, seed: int = 0, out_dir: str | Path | None = None,
                       sandbox_address: str | None = None, *, tests_dir: str | None = None,
                       source_files: list[str] | None = None, max_pass_to_pass: int = 50,
                       max_candidates: int | None = None, test_timeout_s: float = 60) -> list[Task]:
    """Up to ``n`` bug-fixing tasks in ``package`` (deterministic for ``seed``), written to ``out_dir``."""
    from sandbox.client import connect

    out = Path(out_dir or Path("swe_tasks") / f"{package}-seed{seed}").absolute()
    _, files = package_files(package)
    tests_dir = tests_dir or f"{package}/tests"
    sources = sorted(p for p in files if p.endswith(".py") and not p.startswith(tests_dir + "/")
                     and (source_files is None or p.removeprefix(package + "/") in source_files))
    if not sources:
        raise ValueError(f"no source files to mutate in {package} (source_files={source_files})")
    rng = random.Random(seed)
    mutators = {p: Mutator(p, files[p].decode()) for p in sources}
    candidates = [c for p in sources for c in mutators[p].candidates()]
    rng.shuffle(candidates)
    by_kind: dict[str, list[Candidate]] = {}
    for c in candidates:  # round-robin over kinds, or `return None` (which nearly always breaks a test) dominates
        by_kind.setdefault(c.kind, []).append(c)
    candidates = [c for group in itertools.zip_longest(*by_kind.values()) for c in group if c is not None]
    base_commit = hashlib.sha1(b"".join(p.encode() + b"\0" + files[p] for p in sorted(files))).hexdigest()
    repo = _repo_name(package)
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = ""

    client = connect(sandbox_address)
    baseline: dict[str, tuple[dict[str, str], float]] = {}  # test target -> (outcomes on the clean package, seconds)
    tasks: list[Task] = []
    used: set[tuple[str, str]] = set()
    try:
        with client.create_session(files=files) as session:
            for cand in candidates[: max_candidates or 10 * n + 20]:
                if len(tasks) >= n:
                    break
                if (cand.path, cand.function) in used:
                    continue
                mutant = mutators[cand.path].apply(cand)
                if mutant is None:
                    continue
                target = _test_target(cand.path, tests_dir, files)
                if target not in baseline:
                    status, _, res = run_tests(session, [target], TEST_COMMAND, test_timeout_s * 5)
                    baseline[target] = ({t: s for t, s in status.items() if s == "PASSED"}, res.wall_s)
                clean, clean_s = baseline[target]
                session.write_files({cand.path: mutant})
                try:
                    limit_s = min(test_timeout_s, 10 + 5 * clean_s)  # a mutant may loop forever
                    status, messages, _ = run_tests(session, [target], TEST_COMMAND, limit_s)
                finally:
                    session.write_files({cand.path: files[cand.path]})
                f2p = [t for t in clean if status.get(t) != "PASSED"]
                p2p = [t for t in clean if status.get(t) == "PASSED"]
                if not f2p or not p2p:
                    continue
                used.add((cand.path, cand.function))
                if len(p2p) > max_pass_to_pass:
                    p2p = sorted(rng.sample(p2p, max_pass_to_pass), key=list(clean).index)
                patch = make_patch(cand.path, mutant, files[cand.path].decode())
                short = hashlib.sha1(patch.encode()).hexdigest()[:8]
                statement = problem_statement(package, f2p, messages, rng)
                meta: dict[str, Any] = {
                    "instance_id": f"{repo.replace('/', '__')}.smith.{short}", "repo": repo,
                    "base_commit": base_commit, "version": version, "problem_statement": statement,
                    "hints_text": "", "patch": patch, "test_patch": "", "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
                    "image_name": "", "repo_dir": str(out / "repo"), "files": {cand.path: mutant},
                    "test_command": TEST_COMMAND,
                    "mutation": {"kind": cand.kind, "file": cand.path, "function": cand.function, "line": cand.line},
                }
                tasks.append(Task(meta["instance_id"], statement, patch, meta))
    finally:
        client.close()
    _write(out, files, tasks)
    return tasks


def _write(out: Path, files: dict[str, bytes], tasks: list[Task]) -> None:
    """``out/repo/`` (the clean snapshot) and ``out/tasks.jsonl``, replacing what was there."""
    repo = out / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    for path, data in files.items():
        dest = repo / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    save_tasks(tasks, out / "tasks.jsonl")


def main(argv: list[str] | None = None) -> int:
    """Command line: generate a task set and print where it went."""
    p = argparse.ArgumentParser(prog="rl swe-generate", description="Generate SWE-smith-style bug-fixing tasks "
                                "by mutating an installed pure-Python package and keeping mutants its tests catch.")
    p.add_argument("--package", default="toolz", help="installed package to mutate (default: toolz)")
    p.add_argument("-n", "--num-tasks", type=int, default=20, help="tasks to make (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--out", default=None, help="output directory (default: swe_tasks/PACKAGE-seedSEED)")
    p.add_argument("--sandbox", default=None, help="sandbox service address (default: a local service)")
    p.add_argument("--tests-dir", default=None, help="the package's tests, repository-relative (default: PKG/tests)")
    p.add_argument("--source-file", action="append", dest="source_files",
                   help="only mutate this file (relative to the package; repeatable)")
    p.add_argument("--max-pass-to-pass", type=int, default=50, help="PASS_TO_PASS tests kept per task")
    args = p.parse_args(argv)
    tasks = generate_swe_tasks(args.package, args.num_tasks, args.seed, args.out, args.sandbox,
                               tests_dir=args.tests_dir, source_files=args.source_files,
                               max_pass_to_pass=args.max_pass_to_pass)
    out = Path(args.out or Path("swe_tasks") / f"{args.package}-seed{args.seed}")
    print(f"wrote {len(tasks)} tasks to {out / 'tasks.jsonl'} (repository snapshot in {out / 'repo'})")
    return 0 if tasks else 1


if __name__ == "__main__":
    sys.exit(main())
