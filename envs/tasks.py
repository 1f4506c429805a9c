"""Task files and datasets: JSONL, Parquet, a Hugging Face ``datasets`` directory (``save_to_disk``), or a hub dataset
(``hf://org/name?split=train&config=x``); ``envs.task_sources`` reads them.

Schema of a record:

- ``prompt`` (str, non-empty): what the model sees, as raw text; or
- ``messages`` (list of ``{"role": ..., "content": ...}``, OpenAI chat format): the prompt as a conversation,
  rendered with the model's chat template and its generation prompt. One of the two is required; with
  ``messages`` only, ``prompt`` becomes the content of the last user message (what graders and critics read).
  A ``prompt`` that is a list of chat messages is read as ``messages``.
- ``answer`` (str or number, stored as str): the reference answer. Required by default; ``load_tasks(path,
  require_answer=False)`` makes it default to "" (code tasks carry tests instead).
- ``id`` (str, optional): defaults to ``<file stem>-<line or row number>`` (numbers start at 1).
- ``meta`` (object, optional): environment-specific details. In Parquet it is a JSON string (what ``save_tasks``
  writes), a struct or a map column.
- any other field or column is added to ``meta`` (an explicit ``meta`` key wins), so HumanEval-style
  (``task_id``, ``entry_point``, ``test``, ...) and SWE-bench-style records load as they are.

Other frameworks' layouts load as they are:

- verl's Parquet: ``prompt`` (chat messages), ``reward_model: {ground_truth, style}`` (the ground truth is the
  answer), ``data_source``, ``extra_info``, ``ability`` (kept in ``meta``, ``reward_model`` too);
- slime's JSONL: ``prompt`` (text or chat messages), ``label`` (the answer), ``metadata`` (kept in ``meta``).

A ground truth or label that is not a string or a number (a list of accepted answers, a dict) becomes its JSON text
as the answer; the value itself stays in ``meta``. ``columns`` maps task fields to other column names
(``{"prompt": "question", "answer": "solution"}``; a dotted name reads inside a struct column:
``"reward_model.ground_truth"``). A malformed record stops loading with one line naming its file, its line (JSONL)
or row, and the column.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envs.base import Task
from envs.task_sources import TaskFileError, read_jsonl, read_parquet, read_records

__all__ = ["TaskFileError", "apply_columns", "check_columns", "load_tasks", "read_jsonl", "read_parquet",
           "read_records", "record_to_task", "save_tasks"]
_FIELDS = ("id", "prompt", "answer", "meta", "messages")
_MISSING = object()


def _lookup(rec: Mapping[str, Any], column: str) -> Any:
    """``rec[column]``, or the value at a dotted path into nested struct columns; _MISSING when absent."""
    if column in rec:
        return rec[column]
    value: Any = rec
    for part in column.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def check_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    """``columns`` validated: task field -> column name."""
    columns = dict(columns or {})
    for field_name, column in columns.items():
        if field_name not in _FIELDS:
            raise TaskFileError(f"columns: {field_name!r} is not a task field; fields: {', '.join(_FIELDS)}")
        if not isinstance(column, str) or not column:
            raise TaskFileError(f"columns.{field_name}: a column name must be a non-empty string")
    return columns


def apply_columns(rec: dict[str, Any], columns: Mapping[str, str]) -> dict[str, Any]:
    """``rec`` with each mapped column moved to its task field (a column that is absent leaves the field absent)."""
    if not columns:
        return rec
    out = dict(rec)
    for field_name in columns:
        out.pop(field_name, None)  # the mapped column replaces a column of the field's own name
    for field_name, column in columns.items():
        value = _lookup(rec, column)
        if column in out and column not in columns:
            del out[column]
        if value is not _MISSING:
            out[field_name] = value
    return out


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


def _layout(rec: dict[str, Any], columns: Mapping[str, str] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``rec`` with verl's and slime's fields moved to task fields, and the column each task field came from."""
    origin = dict(columns or {})
    rec = dict(rec)
    if isinstance(rec.get("prompt"), list) and rec.get("messages") is None:  # verl, slime: the prompt as messages
        rec["messages"] = rec.pop("prompt")
        origin["messages"] = origin.pop("prompt", "prompt")
    if rec.get("answer") is None and "answer" not in origin:
        truth = rec.get("reward_model")
        if isinstance(truth, Mapping) and "ground_truth" in truth:  # verl
            rec["answer"], origin["answer"] = truth["ground_truth"], "reward_model.ground_truth"
        elif "label" in rec:  # slime
            rec["answer"], origin["answer"] = rec.pop("label"), "label"
    return rec, origin


def _column(field_name: str, origin: Mapping[str, str]) -> str:
    """How errors name a field: its column, and the field it feeds when that differs."""
    column = origin.get(field_name, field_name)
    return repr(field_name) if column == field_name else f"column {column!r} ({field_name})"


def _answer_of(where: str, answer: Any, origin: Mapping[str, str]) -> str:
    if answer is None:
        return ""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    if origin.get("answer", "answer") != "answer":  # a ground truth or label: its JSON text, the value in meta
        try:
            return json.dumps(answer)
        except TypeError:
            pass
    raise TaskFileError(f"{where}: {_column('answer', origin)} must be a string or a number, "
                        f"got {type(answer).__name__}")


def record_to_task(where: str, n: int, rec: dict[str, Any], stem: str, require_answer: bool = True,
                   columns: Mapping[str, str] | None = None) -> Task:
    """Validate one record (see the module docstring) and make it a Task; errors name ``where`` and the column
    (``columns``, already applied to ``rec`` by ``apply_columns``, only names them)."""
    rec, origin = _layout(rec, columns)
    messages = _messages_of(where, rec.get("messages"), _column("messages", origin))
    prompt = rec.get("prompt")
    if prompt is None and messages:
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    if prompt is None:
        missing = "field 'prompt' (or 'messages')" if "prompt" not in origin else _column("prompt", origin)
        raise TaskFileError(f"{where}: missing {missing}")
    if require_answer and rec.get("answer") is None:
        missing = "field 'answer'" if "answer" not in origin else _column("answer", origin)
        raise TaskFileError(f"{where}: missing {missing}")
    if not isinstance(prompt, str) or not prompt:
        raise TaskFileError(f"{where}: {_column('prompt', origin)} must be a non-empty string")
    answer = _answer_of(where, rec.get("answer"), origin)
    task_id = rec.get("id")
    if task_id is None:
        task_id = f"{stem}-{n}"
    elif not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
        raise TaskFileError(f"{where}: {_column('id', origin)} must be a string or an integer")
    return Task(str(task_id), prompt, answer, meta=_meta_of(where, rec), messages=messages)


def _messages_of(where: str, messages: Any, name: str = "'messages'") -> list[dict[str, Any]] | None:
    if messages is None:
        return None
    if isinstance(messages, str):  # Parquet files written by save_tasks hold messages as JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: {name} is a string but not valid JSON ({e.msg})") from None
    if not isinstance(messages, list) or not messages:
        raise TaskFileError(f"{where}: {name} must be a non-empty list of chat messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            inside = "" if name == "'messages'" else f"{name}: "
            raise TaskFileError(f"{where}: {inside}messages[{i}] must be an object with string 'role' and 'content'")
        # a struct column gives every message every key (None where absent); a template may read a None key
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def load_tasks(path: str | Path, *, require_answer: bool = True,
               columns: Mapping[str, str] | None = None) -> list[Task]:
    """Read and validate the tasks of a JSONL or Parquet file, a ``datasets`` directory or an ``hf://`` hub dataset
    (see the module docstring); ``columns`` maps task fields to the source's column names."""
    columns = check_columns(columns)
    rows, stem = read_records(path)
    tasks = [record_to_task(where, n, apply_columns(rec, columns), stem, require_answer, columns)
             for where, n, rec in rows]
    if not tasks:
        raise TaskFileError(f"task file {path} has no records")
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
