"""What a benchmark does with its records once its table is printed: one JSON line each, and an append to its results
file (``benchmarks/results/*.jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path


def emit(records: list[dict], show_json: bool, results: Path | None) -> None:
    """Print each record as a JSON line with ``show_json``; append them to ``results`` when given (``--record``)."""
    if show_json:
        for r in records:
            print(json.dumps(r))
    if results is not None:
        with results.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
