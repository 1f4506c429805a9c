"""The central controller, the RL algorithm, configs and the command line.

The Python API: ``from rl import train, Config`` (``rl.api.train`` runs what ``rl train`` runs; docs/python-api.md).
"""

from __future__ import annotations

import importlib
from typing import Any

#: the API's names -> their modules, imported on first use: ``import rl.cli`` stays quick
_EXPORTS = {"train": "rl.api", "Config": "rl.config", "load_config": "rl.config", "parse_config": "rl.config"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # PEP 562: a module attribute resolved on first access
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rl' has no attribute {name!r}")
    return vars(importlib.import_module(_EXPORTS[name]))[name]
