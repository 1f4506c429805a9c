"""Where task records come from: JSONL and Parquet files, Hugging Face ``datasets`` directories (``save_to_disk``)
and hub datasets (``hf://org/name?split=train&config=x&revision=main``).

Each reader yields ``(where, n, record)``: a place to name in errors (``file:line`` for JSONL, ``<source> row N``
otherwise), the record's number from 1, and the record as a dict of its columns. ``envs.tasks`` turns records
into tasks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

HUB_SCHEME = "hf://"
_HUB_OPTIONS = ("split", "config", "revision")


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


def _rows(dataset: Any, source: str) -> Iterator[tuple[str, int, dict]]:
    n = 0
    for batch in dataset.with_format("arrow").iter(batch_size=1000):
        for rec in batch.to_pylist():
            n += 1
            yield f"{source} row {n}", n, rec


def is_dataset_dir(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json"))


def read_dataset_dir(path: str | Path) -> Iterator[tuple[str, int, dict]]:
    """The rows of a ``save_to_disk`` directory; a ``DatasetDict`` of several splits needs the split's
    sub-directory (``DIR/train``)."""
    from datasets import DatasetDict, load_from_disk

    p = Path(path)
    try:
        ds = load_from_disk(str(p))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, pyarrow errors for broken directories
        raise TaskFileError(f"{p}: not a readable datasets directory ({type(e).__name__}: {e})") from None
    if isinstance(ds, DatasetDict):
        splits = list(ds)
        if len(splits) != 1:
            raise TaskFileError(f"{p} holds the splits {', '.join(splits)}: give one as {p}/{splits[0]}")
        ds = ds[splits[0]]
    yield from _rows(ds, str(p))


def parse_hub_source(source: str) -> tuple[str, dict[str, str]]:
    """``hf://org/name?split=train&config=x&revision=main`` as (``org/name``, options); split defaults to train."""
    parts = urlsplit(source)
    repo = (parts.netloc + parts.path).strip("/")
    if repo.count("/") > 1 or not repo:
        raise TaskFileError(f"{source}: a hub dataset is hf://ORG/NAME or hf://NAME (options after '?')")
    query = parse_qs(parts.query, keep_blank_values=True)
    if unknown := sorted(set(query) - set(_HUB_OPTIONS)):
        raise TaskFileError(f"{source}: unknown option {unknown[0]!r}; options: {', '.join(_HUB_OPTIONS)}")
    options = {k: v[-1] for k, v in query.items()}
    options.setdefault("split", "train")
    return repo, options


def read_hub(source: str) -> Iterator[tuple[str, int, dict]]:
    """The rows of a hub dataset's split, loaded by ``datasets.load_dataset`` (cached as it caches; the hub is
    ``HF_ENDPOINT`` when set, and ``HF_TOKEN`` reads private or gated datasets)."""
    from datasets import load_dataset

    repo, options = parse_hub_source(source)
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        ds = load_dataset(repo, name=options.get("config") or None, split=options["split"],
                          revision=options.get("revision") or None)
    except Exception as e:  # not found, no such split or config, no network: one line, whatever the type
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TaskFileError(f"{source}: cannot load {repo} from {endpoint}: {type(e).__name__}: {first}") from None
    yield from _rows(ds, source)


def hub_source(path: str | Path) -> str | None:
    """``path`` as an ``hf://`` source, or None; ``Path("hf://org/name")`` (which reads ``hf:/org/name``) too."""
    text = str(path)
    if text.startswith("hf:/"):
        return HUB_SCHEME + text[len("hf:/"):].lstrip("/")
    return None


def read_records(path: str | Path) -> tuple[Iterator[tuple[str, int, dict]], str]:
    """The records of any task source and the stem that default task ids start with."""
    text = hub_source(path)
    if text is not None:
        repo, _ = parse_hub_source(text)
        return read_hub(text), repo.rsplit("/", 1)[-1]
    p = Path(path)
    if p.is_dir():
        if not is_dataset_dir(p):
            raise TaskFileError(f"{p} is a directory but not a datasets directory (no state.json or "
                                "dataset_dict.json): give a JSONL or Parquet file, or a save_to_disk directory")
        return read_dataset_dir(p), p.name
    if p.suffix == ".parquet":
        return read_parquet(p), p.stem
    return read_jsonl(p), p.stem
