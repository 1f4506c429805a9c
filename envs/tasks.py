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
- ``images`` (list, optional): the prompt's images, one per ``{"type": "image"}`` content part of ``messages``, in
  order; each a path (relative to the task file's folder), a ``data:image/...;base64,`` URL, a
  ``{"bytes": ..., "path": ...}`` object (``datasets``' ``Image`` column, verl's and Parquet's struct), or
  ``{"bytes_b64": ...}`` (what ``save_tasks`` writes to JSONL). A single image need not be in a list; a column
  ``image`` (TRL's name) is read as ``images`` when there is none. Message content may be a list of parts:
  ``{"type": "text", "text": ...}`` and ``{"type": "image"}``, the latter optionally with its image inline
  (``"image"``, ``"path"``, ``"url"``, ``"image_url"`` or ``"base64"``, as transformers' processors and OpenAI's
  ``{"type": "image_url", ...}`` take it: it becomes the image of that part, and the part ``{"type": "image"}``);
  ``images`` fills the parts without one, in order. With no image parts at all, ``<image>`` placeholders in the
  messages' text (verl's layout) or in a text ``prompt`` (slime's; the prompt becomes one user message) become
  image parts; with no placeholders either, the image parts go before the text of the first user message
  (TRL's convention). Every image is checked when it loads (its header read, in-memory bytes verified; pixels are
  never kept), and a ``prompt`` made from parts is the text of the last user message's text parts.
- ``meta`` (object, optional): environment-specific details. In Parquet it is a JSON string (what ``save_tasks``
  writes), a struct or a map column.
- any other field or column is added to ``meta`` (an explicit ``meta`` key wins), so HumanEval-style
  (``task_id``, ``entry_point``, ``test``, ...) and SWE-bench-style records load as they are.

Other frameworks' layouts load as they are:

- verl's Parquet: ``prompt`` (chat messages), ``reward_model: {ground_truth, style}`` (the ground truth is the
  answer), ``data_source``, ``extra_info``, ``ability`` (kept in ``meta``, ``reward_model`` too);
- verl's multimodal Parquet: the same with ``images`` (a list of ``{bytes, path}`` structs) and ``<image>`` in the
  prompt's text;
- slime's JSONL: ``prompt`` (text or chat messages), ``label`` (the answer), ``metadata`` (kept in ``meta``),
  images as ``images`` or ``multimodal_inputs: {"images": [...]}``.

A ground truth or label that is not a string or a number (a list of accepted answers, a dict) becomes its JSON text
as the answer; the value itself stays in ``meta``. ``columns`` maps task fields to other column names
(``{"prompt": "question", "answer": "solution"}``; a dotted name reads inside a struct column:
``"reward_model.ground_truth"``). A malformed record stops loading with one line naming its file, its line (JSONL)
or row, and the column.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engines.model.images import ImageError, ImageRef
from envs.base import Task
from envs.task_sources import TaskFileError, hub_source, read_jsonl, read_parquet, read_records

__all__ = ["PLACEHOLDER", "TaskFileError", "apply_columns", "check_columns", "check_image", "load_tasks", "read_jsonl",
           "read_parquet", "read_records", "record_to_task", "save_tasks"]
_FIELDS = ("id", "prompt", "answer", "meta", "messages", "images")
_MISSING = object()
_INLINE = ("image", "path", "url", "image_url", "base64")  # where an image content part may carry its image
PLACEHOLDER = "<image>"


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


def _layout(where: str, rec: dict[str, Any],
            columns: Mapping[str, str] | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``rec`` with verl's, slime's and TRL's fields moved to task fields, and the column each task field came
    from."""
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
    if rec.get("images") is None and "images" not in origin:
        inputs = rec.get("multimodal_inputs")
        if isinstance(inputs, Mapping) and "images" in inputs:  # slime
            rest = sorted(k for k, v in inputs.items() if k != "images" and v not in (None, [], {}))
            if rest:
                raise TaskFileError(f"{where}: column 'multimodal_inputs' holds {', '.join(map(repr, rest))}: "
                                    "only 'images' are read")
            rec["images"], origin["images"] = rec.pop("multimodal_inputs")["images"], "multimodal_inputs.images"
        elif "image" in rec:  # TRL: one image per prompt
            rec["images"], origin["images"] = rec.pop("image"), "image"
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
                   columns: Mapping[str, str] | None = None, base: str | Path | None = None) -> Task:
    """Validate one record (see the module docstring) and make it a Task; errors name ``where`` and the column
    (``columns``, already applied to ``rec`` by ``apply_columns``, only names them). Relative image paths are
    taken from ``base`` (the task file's folder) when given."""
    rec, origin = _layout(where, rec, columns)
    messages, inline = _messages_of(where, rec.get("messages"), _column("messages", origin), base)
    prompt = rec.get("prompt")
    images: tuple[ImageRef, ...] = ()
    if inline or rec.get("images") is not None:
        column = _images_of(where, rec.get("images"), origin.get("images", "images"), base)
        source = origin.get("messages", "messages")
        if messages is None and isinstance(prompt, str) and column:  # slime: a text prompt with its images
            messages, prompt, source = [{"role": "user", "content": prompt}], None, origin.get("prompt", "prompt")
        if messages is not None:
            messages, images = _fill_images(where, messages, inline, column, origin.get("images", "images"), source)
    if prompt is None and messages:
        prompt = _text_of(next((m for m in reversed(messages) if m["role"] == "user"), messages[-1]))
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
    for image in images:
        check_image(image)
    return Task(str(task_id), prompt, answer, meta=_meta_of(where, rec), messages=messages, images=images)


def _messages_of(where: str, messages: Any, name: str = "'messages'", base: str | Path | None = None,
                 ) -> tuple[list[dict[str, Any]] | None, list[ImageRef | None]]:
    """The validated messages, and per image part in order its inline image (None: the images column gives it);
    image parts become ``{"type": "image"}``."""
    if messages is None:
        return None, []
    if isinstance(messages, str):  # Parquet files written by save_tasks hold messages as JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: {name} is a string but not valid JSON ({e.msg})") from None
    if not isinstance(messages, list) or not messages:
        raise TaskFileError(f"{where}: {name} must be a non-empty list of chat messages")
    inside = "" if name == "'messages'" else f"{name}: "
    out: list[dict[str, Any]] = []
    inline: list[ImageRef | None] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, (str, list)):
            raise TaskFileError(f"{where}: {inside}messages[{i}] must be an object with string 'role' and 'content' "
                                "(a string or a list of content parts)")
        # a struct column gives every message every key (None where absent); a template may read a None key
        m = {k: v for k, v in m.items() if v is not None}
        if isinstance(content, list):
            m["content"] = _parts_of(where, content, f"{inside}messages[{i}].content", base, inline)
        out.append(m)
    return out, inline


def _parts_of(where: str, parts: list, at: str, base: str | Path | None,
              inline: list[ImageRef | None]) -> list[dict[str, Any]]:
    """One message's validated content parts; each image part's inline image (or None) is appended to
    ``inline``."""
    if not parts:
        raise TaskFileError(f"{where}: {at} is an empty list of content parts")
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise TaskFileError(f"{where}: {at}[{j}] must be an object with a string 'type' ('text' or 'image')")
        part = {k: v for k, v in part.items() if v is not None}  # a struct column's absent keys
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise TaskFileError(f"{where}: {at}[{j}]: a text part needs a string 'text'")
            out.append(part)
        elif kind in ("image", "image_url"):
            key = next((k for k in _INLINE if k in part), None)
            if kind == "image_url" and key != "image_url":
                raise TaskFileError(f"{where}: {at}[{j}]: an 'image_url' part needs its 'image_url'")
            inline.append(None if key is None else _inline_image(f"{where}: {at}[{j}]", key, part[key], base))
            out.append({"type": "image"})
        else:
            raise TaskFileError(f"{where}: {at}[{j}]: content part type {kind!r} is not read (only 'text' and "
                                "'image')")
    return out


def _inline_image(where: str, key: str, value: Any, base: str | Path | None) -> ImageRef:
    if key == "image_url" and isinstance(value, dict):
        value = value.get("url")
    try:
        if key == "base64":
            if not isinstance(value, str):
                raise ImageError(f"{where}: 'base64' must be a string")
            try:
                return ImageRef(data=base64.b64decode(value, validate=True), where=where)
            except (binascii.Error, ValueError):
                raise ImageError(f"{where}: 'base64' does not decode") from None
        return ImageRef.of(value, where, base)
    except ImageError as e:
        raise TaskFileError(str(e)) from None


def _images_of(where: str, value: Any, column: str, base: str | Path | None) -> list[ImageRef]:
    """The images of the images column (a single image or a list of them; None: none)."""
    if value is None:
        return []
    out = []
    for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
        here = f"{where}: {column}[{i}]"
        if item is None:
            raise TaskFileError(f"{here} is null")
        try:
            out.append(ImageRef.from_json(item, here, base))
        except ImageError as e:
            raise TaskFileError(str(e)) from None
    return out


def _fill_images(where: str, messages: list[dict[str, Any]], inline: list[ImageRef | None], column: list[ImageRef],
                 name: str, source: str) -> tuple[list[dict[str, Any]], tuple[ImageRef, ...]]:
    """``messages`` (from the column ``source``) with image parts for the images of the column ``name`` (see the
    module docstring), and the images of its image parts in order; the counts must agree."""
    if not inline and column:
        placeholders = sum(m["content"].count(PLACEHOLDER) for m in messages if isinstance(m["content"], str))
        if placeholders == 0:  # TRL: the images before the first user message's text
            first = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
            content = messages[first]["content"]
            text = [{"type": "text", "text": content}] if isinstance(content, str) else content
            messages = [*messages[:first], {**messages[first], "content": [{"type": "image"}] * len(column) + text},
                        *messages[first + 1:]]
        elif placeholders != len(column):
            raise TaskFileError(f"{where}: column {name!r} has {len(column)} images but {source!r} has "
                                f"{placeholders} {PLACEHOLDER} placeholders")
        else:  # verl, slime: the placeholders become image parts
            messages = [{**m, "content": _split(m["content"])} if PLACEHOLDER in m.get("content", "") else m
                        for m in messages]
        inline = [None] * len(column)
    wanted = inline.count(None)
    if wanted != len(column):
        without = " without an inline image" if wanted != len(inline) else ""
        raise TaskFileError(f"{where}: column {name!r} has {len(column)} images but the messages have {wanted} "
                            f"image parts{without}")
    fill = iter(column)
    return messages, tuple(image if image is not None else next(fill) for image in inline)


def _split(text: str) -> list[dict[str, Any]]:
    """``text`` as content parts, an image part for each ``<image>`` (empty text between them dropped, as verl
    does)."""
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _text_of(message: dict[str, Any]) -> str:
    """A message's text: its content, or its text parts joined (``<image>`` for each image part when it has no
    text)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    text = "".join(p["text"] for p in content if p["type"] == "text")
    return text or "".join(PLACEHOLDER for p in content if p["type"] == "image")


def check_image(image: ImageRef) -> None:
    """Raise TaskFileError naming ``image.where`` unless ``image`` is a readable image: its header is read (the
    file's first bytes for a path) and in-memory bytes are verified (Pillow's ``verify``, which checks the
    structure without decoding pixels); a body truncated past a path's header surfaces when a worker decodes it."""
    from PIL import Image

    what = image.path if image.path is not None else f"{len(image.data)} bytes"
    try:
        with Image.open(image.path if image.path is not None else io.BytesIO(image.data)) as im:
            if image.data is not None:
                im.verify()
    except OSError as e:
        if image.path is not None and e.strerror:  # missing, unreadable
            raise TaskFileError(f"{image.where}: cannot read image file {image.path} ({e.strerror})") from None
        reason = "not an image Pillow reads" if isinstance(e, Image.UnidentifiedImageError) else str(e)
        raise TaskFileError(f"{image.where}: the image does not decode ({what}: {reason})") from None
    except Exception as e:  # a broken structure (SyntaxError, ValueError), a decompression bomb
        raise TaskFileError(f"{image.where}: the image does not decode ({what}: {type(e).__name__}: {e})") from None


def load_tasks(path: str | Path, *, require_answer: bool = True,
               columns: Mapping[str, str] | None = None) -> list[Task]:
    """Read and validate the tasks of a JSONL or Parquet file, a ``datasets`` directory or an ``hf://`` hub dataset
    (see the module docstring); ``columns`` maps task fields to the source's column names. Relative image paths
    are taken from the folder the file or directory is in."""
    columns = check_columns(columns)
    rows, stem = read_records(path)
    base = None if hub_source(path) is not None else Path(path).absolute().parent
    tasks = [record_to_task(where, n, apply_columns(rec, columns), stem, require_answer, columns, base)
             for where, n, rec in rows]
    if not tasks:
        raise TaskFileError(f"task file {path} has no records")
    return tasks


def _image_json(image: ImageRef) -> dict[str, str]:
    """``image.to_json()`` with a path made absolute (the file may be written elsewhere than it was read from)."""
    return {"path": str(Path(image.path).absolute())} if image.path is not None else image.to_json()


def save_tasks(tasks: list[Task], path: str | Path) -> None:
    """Write tasks as JSONL, or as Parquet when ``path`` ends in ``.parquet`` (the formats ``load_tasks`` reads);
    images go in an ``images`` column: ``{"path"}`` or ``{"bytes_b64"}`` objects in JSONL, ``{bytes, path}``
    structs in Parquet (as ``datasets``' ``Image`` and verl store them)."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # meta as JSON text: a struct column would force one schema on every task's meta
        columns = {"id": [t.id for t in tasks], "prompt": [t.prompt for t in tasks],
                   "answer": [t.answer for t in tasks], "meta": [json.dumps(t.meta) for t in tasks]}
        if any(t.messages for t in tasks):
            columns["messages"] = [t.messages and json.dumps(t.messages) for t in tasks]
        if any(t.images for t in tasks):
            image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
            columns["images"] = pa.array([[{"bytes": i.data, "path": i.path and _image_json(i)["path"]}
                                           for i in t.images] for t in tasks], pa.list_(image))
        pq.write_table(pa.table(columns), p)
        return
    with p.open("w") as f:
        for t in tasks:
            rec = {"id": t.id, "prompt": t.prompt, "answer": t.answer, "meta": t.meta}
            rec |= {"messages": t.messages} if t.messages else {}
            rec |= {"images": [_image_json(i) for i in t.images]} if t.images else {}
            f.write(json.dumps(rec) + "\n")
