"""Images that prompts refer to, left where they are until a worker needs their pixels.

A task with images (``Task.images``) holds one ``ImageRef`` per ``{"type": "image"}`` part of its messages, in
order. An ``ImageRef`` is a file path or the encoded bytes (PNG, JPEG, ... as a dataset's ``Image`` column stores
them); it is decoded with Pillow only by ``load``, on the worker that renders the prompt. Paths travel as strings,
so a task set on shared storage is never copied through the driver; bytes travel with the task (generated images,
Parquet cells).

``ImageRef.of`` accepts every form the ecosystem hands over: a path, bytes, a ``{"bytes": ..., "path": ...}``
dict (``datasets``' ``Image(decode=False)`` and Parquet), a ``data:image/...;base64,`` URL (OpenAI's image content
parts), or a ``PIL.Image`` (encoded to PNG once).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ImageError", "ImageRef", "decoded", "image_parts", "to_data_url"]


class ImageError(ValueError):
    """An image that cannot be read or decoded (the message names where it came from)."""


@dataclass(frozen=True)
class ImageRef:
    """One image: ``path`` (a file) or ``data`` (its encoded bytes); ``where`` names its origin for errors
    (a task id and column)."""

    path: str | None = None
    data: bytes | None = None
    where: str = field(default="image", compare=False)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.data is None):
            raise ImageError(f"{self.where}: an image is a path or bytes, exactly one of them")

    @classmethod
    def of(cls, value: Any, where: str = "image", base: str | Path | None = None) -> ImageRef:
        """The image ``value`` in any accepted form (see the module docstring); a relative path is taken from
        ``base`` (the task file's folder) when given."""
        if isinstance(value, ImageRef):
            return value
        if isinstance(value, (bytes, bytearray, memoryview)):
            return cls(data=bytes(value), where=where)
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                return cls(data=bytes(value["bytes"]), where=where)
            if value.get("path"):
                return cls.of(value["path"], where, base)
            if value.get("url") or value.get("image_url"):  # an OpenAI-style part's payload
                url = value.get("url") or value["image_url"]
                return cls.of(url["url"] if isinstance(url, dict) else url, where, base)
            raise ImageError(f"{where}: an image object needs 'bytes', 'path' or 'url' (got keys {sorted(value)})")
        if isinstance(value, str):
            if value.startswith("data:"):
                head, _, payload = value.partition(",")
                if not head.startswith("data:image/") or not head.endswith(";base64"):
                    raise ImageError(f"{where}: a data URL must be data:image/<type>;base64,... (got {head[:40]!r})")
                try:
                    return cls(data=base64.b64decode(payload, validate=True), where=where)
                except (binascii.Error, ValueError):
                    raise ImageError(f"{where}: the data URL's base64 does not decode") from None
            if "://" in value:
                raise ImageError(f"{where}: images are read from files or bytes, not URLs ({value[:60]!r})")
            p = Path(value)
            if base is not None and not p.is_absolute():
                p = Path(base) / p
            return cls(path=str(p), where=where)
        if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
            buf = io.BytesIO()
            value.save(buf, format="PNG")
            return cls(data=buf.getvalue(), where=where)
        raise ImageError(f"{where}: an image is a path, bytes, a data URL or a PIL image, not {type(value).__name__}")

    def raw(self) -> bytes:
        """The encoded bytes (read from the file for a path)."""
        if self.data is not None:
            return self.data
        try:
            return Path(self.path).read_bytes()
        except OSError as e:
            raise ImageError(f"{self.where}: cannot read image file {self.path} ({e.strerror})") from None

    def load(self):
        """The decoded image, RGB (what the processors take); ImageError naming ``where`` when it does not
        decode."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(self.raw())) as im:
                im.load()
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            what = self.path or f"{len(self.data)} bytes"
            raise ImageError(f"{self.where}: the image does not decode ({what}: {e})") from None

    def size(self) -> tuple[int, int]:
        """(width, height), read from the image's header (no pixels decoded)."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(self.path if self.path is not None else io.BytesIO(self.data)) as im:
                return im.size
        except (UnidentifiedImageError, OSError) as e:
            raise ImageError(f"{self.where}: the image does not decode ({e})") from None

    def identity(self) -> str:
        """What tells two images apart cheaply: the path of a file, a hash of bytes."""
        import hashlib

        return self.path if self.path is not None else hashlib.sha256(self.data).hexdigest()

    def to_json(self) -> dict[str, str]:
        """``{"path": ...}`` or ``{"bytes": base64}``, what task files store (``of`` reads it back)."""
        if self.path is not None:
            return {"path": self.path}
        return {"bytes_b64": base64.b64encode(self.data).decode()}

    @classmethod
    def from_json(cls, value: Any, where: str = "image", base: str | Path | None = None) -> ImageRef:
        """The inverse of ``to_json`` (also any form ``of`` takes)."""
        if isinstance(value, dict) and "bytes_b64" in value:
            try:
                return cls(data=base64.b64decode(value["bytes_b64"], validate=True), where=where)
            except (binascii.Error, ValueError):
                raise ImageError(f"{where}: 'bytes_b64' is not base64") from None
        return cls.of(value, where, base)


def decoded(image: Any):
    """The PIL image of an ``ImageRef`` (decoded here) or of a PIL image (as it is)."""
    return image.load() if isinstance(image, ImageRef) else image


def image_parts(messages: list[dict[str, Any]] | None) -> int:
    """How many ``{"type": "image"}`` content parts ``messages`` hold."""
    n = 0
    for m in messages or ():
        content = m.get("content")
        if isinstance(content, list):
            n += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return n


def to_data_url(image: ImageRef) -> str:
    """``data:image/png;base64,...`` of ``image`` re-encoded as PNG (for OpenAI-style requests)."""
    buf = io.BytesIO()
    image.load().save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
