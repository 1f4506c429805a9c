"""Task files: JSONL, one object per line with ``prompt`` and ``answer`` (and optional ``id``,
``meta``). A malformed record stops loading with its file and line number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from envs.base import Task


class TaskFileError(ValueError):
    pass


def read_jsonl(path: str | Path, what: str = "task file") -> Iterator[tuple[str, int, dict]]:
    """The JSON objects of a JSONL file with their ``file:line`` and line number; blank lines are
    skipped and anything else that is not an object raises TaskFileError naming the line."""
    p = Path(path)
    if not p.is_file():
        raise TaskFileError(f"{what} {p} does not exist")
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise TaskFileError(f"{where}: a record must be a JSON object")
            yield where, n, rec


def load_tasks(path: str | Path) -> list[Task]:
    """Read and validate a JSONL task file."""
    p = Path(path)
    tasks = []
    for where, n, rec in read_jsonl(p):
        for key in ("prompt", "answer"):
            if key not in rec:
                raise TaskFileError(f"{where}: missing field {key!r}")
        if not isinstance(rec["prompt"], str) or not rec["prompt"]:
            raise TaskFileError(f"{where}: 'prompt' must be a non-empty string")
        if not isinstance(rec["answer"], (str, int)):
            raise TaskFileError(f"{where}: 'answer' must be a string or an integer")
        if not isinstance(rec.get("meta", {}), dict):
            raise TaskFileError(f"{where}: 'meta' must be an object")
        tasks.append(Task(str(rec.get("id", f"{p.stem}-{n}")), rec["prompt"], str(rec["answer"]),
                          rec.get("meta", {})))
    if not tasks:
        raise TaskFileError(f"task file {p} has no records")
    return tasks


def save_tasks(tasks: list[Task], path: str | Path) -> None:
    """Write tasks as JSONL (the format ``load_tasks`` reads)."""
    with Path(path).open("w") as f:
        for t in tasks:
            f.write(json.dumps({"id": t.id, "prompt": t.prompt, "answer": t.answer, "meta": t.meta}) + "\n")
