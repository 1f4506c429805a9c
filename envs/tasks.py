"""Task files: JSONL (one JSON object per line) or Parquet (``.parquet``, one row per task).

Schema of a record:

- ``prompt`` (str, non-empty): what the model sees, as raw text; or
- ``messages`` (list of ``{"role": ..., "content": ...}``, OpenAI chat format): the prompt as a conversation,
  rendered with the model's chat template and its generation prompt. One of the two is required; with
  ``messages`` only, ``prompt`` becomes the content of the last user message (what graders and critics read).
- ``answer`` (str or int, stored as str): the reference answer. Required by default; ``load_tasks(path,
  require_answer=False)`` makes it default to "" (code tasks carry tests instead).
- ``id`` (str, optional): defaults to ``<file stem>-<line or row number>`` (numbers start at 1).
- ``meta`` (object, optional): environment-specific details. In Parquet it is a JSON string (what ``save_tasks``
  writes), a struct or a map column.
- any other field or column is added to ``meta`` (an explicit ``meta`` key wins), so HumanEval-style
  (``task_id``, ``entry_point``, ``test``, ...) and SWE-bench-style records load as they are.

A malformed record stops loading with its file and line (JSONL) or row (Parquet) number.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envs.base import Task

_FIELDS = ("id", "prompt", "answer", "meta", "messages")


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


def read_parquet(path: str | Path, what: str = "task file") -> Iterator[tuple[str, int, dict]]:
    """The rows of a Parquet file as dicts with their ``file row N`` and row number (from 1)."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise TaskFileError(f"{what} {p} does not exist")
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise TaskFileError(f"{p}: not a readable Parquet file ({e})") from None
    n = 0
    for batch in table.to_batches():  # batch by batch: a large file is not turned into Python objects at once
        for rec in batch.to_pylist():
            n += 1
            yield f"{p} row {n}", n, rec


def _meta_of(where: str, rec: dict[str, Any]) -> dict[str, Any]:
    meta = rec.get("meta")
    if meta is None:
        meta = {}
    elif isinstance(meta, str):  # Parquet files written by save_tasks hold meta as JSON text
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: 'meta' is a string but not valid JSON ({e.msg})") from None
    elif isinstance(meta, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in meta):
        meta = dict(meta)  # a Parquet map column
    if not isinstance(meta, dict):
        raise TaskFileError(f"{where}: 'meta' must be an object")
    extra = {k: v for k, v in rec.items() if k not in _FIELDS}
    return {**extra, **meta}


def record_to_task(where: str, n: int, rec: dict[str, Any], stem: str, require_answer: bool = True) -> Task:
    """Validate one record (see the module docstring) and make it a Task; errors name ``where``."""
    messages = _messages_of(where, rec.get("messages"))
    prompt = rec.get("prompt")
    if prompt is None and messages:
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    if prompt is None:
        raise TaskFileError(f"{where}: missing field 'prompt' (or 'messages')")
    if require_answer and rec.get("answer") is None:
        raise TaskFileError(f"{where}: missing field 'answer'")
    if not isinstance(prompt, str) or not prompt:
        raise TaskFileError(f"{where}: 'prompt' must be a non-empty string")
    answer = rec.get("answer")
    if answer is None:
        answer = ""
    if not isinstance(answer, (str, int)) or isinstance(answer, bool):
        raise TaskFileError(f"{where}: 'answer' must be a string or an integer")
    task_id = rec.get("id")
    if task_id is None:
        task_id = f"{stem}-{n}"
    elif not isinstance(task_id, (str, int)):
        raise TaskFileError(f"{where}: 'id' must be a string or an integer")
    return Task(str(task_id), prompt, str(answer), _meta_of(where, rec), messages)


def _messages_of(where: str, messages: Any) -> list[dict[str, Any]] | None:
    if messages is None:
        return None
    if isinstance(messages, str):  # Parquet files written by save_tasks hold messages as JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: 'messages' is a string but not valid JSON ({e.msg})") from None
    if not isinstance(messages, list) or not messages:
        raise TaskFileError(f"{where}: 'messages' must be a non-empty list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TaskFileError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return messages


def load_tasks(path: str | Path, *, require_answer: bool = True) -> list[Task]:
    """Read and validate a JSONL or Parquet (``.parquet``) task file."""
    p = Path(path)
    rows = read_parquet(p) if p.suffix == ".parquet" else read_jsonl(p)
    tasks = [record_to_task(where, n, rec, p.stem, require_answer) for where, n, rec in rows]
    if not tasks:
        raise TaskFileError(f"task file {p} has no records")
    return tasks


def save_tasks(tasks: list[Task], path: str | Path) -> None:
    """Write tasks as JSONL, or as Parquet when ``path`` ends in ``.parquet`` (the formats ``load_tasks`` reads)."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # meta as JSON text: a struct column would force one schema on every task's meta
        table = pa.table({"id": [t.id for t in tasks], "prompt": [t.prompt for t in tasks],
                          "answer": [t.answer for t in tasks], "meta": [json.dumps(t.meta) for t in tasks]}
                         | ({"messages": [t.messages and json.dumps(t.messages) for t in tasks]}
                            if any(t.messages for t in tasks) else {}))
        pq.write_table(table, p)
        return
    with p.open("w") as f:
        for t in tasks:
            rec = {"id": t.id, "prompt": t.prompt, "answer": t.answer, "meta": t.meta}
            f.write(json.dumps(rec | ({"messages": t.messages} if t.messages else {})) + "\n")
