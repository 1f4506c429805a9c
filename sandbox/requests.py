"""Checks of the service's request messages: every caller error is refused as INVALID_ARGUMENT with the field named
(``files[2].path``, ``command[0]``, ``env['A=B']``, ``max_bytes``), before a backend sees it.

A request that gets past these may still fail in the backend for reasons of the session (a missing file:
NOT_FOUND; a full disk: RESOURCE_EXHAUSTED), never because a field was malformed.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence

from sandbox.backend import Limits, SandboxError, check_relative_path

MAX_IMAGE_CHARS = 4096  # far above any registry reference; a longer "image" is garbage, not a name


def _bad(message: str) -> SandboxError:
    return SandboxError(message, "INVALID_ARGUMENT")


def check_files(files: Iterable, field: str = "files") -> tuple[dict[str, bytes], frozenset[str]]:
    """File messages → ({path: content}, executable paths); a bad or repeated path names its index."""
    out: dict[str, bytes] = {}
    executable = set()
    for i, f in enumerate(files):
        check_relative_path(f.path, f"{field}[{i}].path")
        if f.path in out:
            raise _bad(f"{field}[{i}].path {f.path!r} is given twice")
        out[f.path] = f.content
        if f.executable:
            executable.add(f.path)
    return out, frozenset(executable)


def check_paths(paths: Sequence[str], field: str = "paths") -> list[str]:
    """Paths of files to read, each checked (the index named)."""
    for i, p in enumerate(paths):
        check_relative_path(p, f"{field}[{i}]")
    return list(paths)


def check_command(argv: Sequence[str], field: str = "command") -> list[str]:
    """A command line: at least a program name, no NUL byte in any argument."""
    if not argv:
        raise _bad(f"{field} is empty")
    if not argv[0]:
        raise _bad(f"{field}[0] (the program) is empty")
    for i, arg in enumerate(argv):
        if "\0" in arg:
            raise _bad(f"{field}[{i}] contains a NUL byte")
    return list(argv)


def check_env(env: Mapping[str, str], field: str = "env") -> dict[str, str]:
    """Environment variables: names without '=' or NUL, values without NUL."""
    for k, v in env.items():
        if not k or "=" in k or "\0" in k:
            raise _bad(f"{field} has an invalid variable name {k!r} (empty, or with '=' or a NUL byte)")
        if "\0" in v:
            raise _bad(f"{field}[{k!r}] contains a NUL byte")
    return dict(env)


def check_image(image: str, field: str = "image") -> str:
    """A container image reference: printable, without spaces, of a sane length (empty: the default image)."""
    if len(image) > MAX_IMAGE_CHARS or any(not c.isprintable() or c.isspace() for c in image):
        raise _bad(f"{field} {image[:80]!r} is not an image reference (spaces, control characters, or over "
                   f"{MAX_IMAGE_CHARS} characters)")
    return image


def check_image_allowed(image: str, patterns: Sequence[str], option: str = "sandbox.kubernetes.allowed_images") -> str:
    """``image`` matches one of ``patterns`` (fnmatch, case-sensitive, ``*`` crosses ``/``); otherwise
    PERMISSION_DENIED naming the image and ``option``, the setting that would allow it."""
    if any(fnmatch.fnmatchcase(image, p) for p in patterns):
        return image
    raise SandboxError(f"image {image[:200]!r} is not allowed on this sandbox service: add it to {option} "
                       f"(now {', '.join(patterns) or 'empty'})", "PERMISSION_DENIED")


def check_session_id(sid: str, field: str = "session_id") -> str:
    """A session id is given (an unknown one is NOT_FOUND later, not a malformed request)."""
    if not sid:
        raise _bad(f"{field} is empty")
    return sid


def check_max_bytes(value: int, top: int, field: str = "max_bytes") -> int:
    """A per-file read limit: 0 (the server's default ``top``) up to ``top``."""
    if value < 0:
        raise _bad(f"{field}={value} must be 0 (the server's default) or more")
    if value > top:
        raise _bad(f"{field}={value} is above the server's maximum {top}")
    return value or top


def check_limits(asked: Mapping[str, float | int], top: Limits, field: str = "limits") -> None:
    """Asked limits (the non-zero fields) within 0..``top``, each finite."""
    for name, value in asked.items():
        high = getattr(top, name)
        if not math.isfinite(value) or value < 0 or value > high:  # NaN compares false to everything
            raise _bad(f"{field}.{name}={value} is outside what this server allows (0..{high})")
