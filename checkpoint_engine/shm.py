"""Named POSIX shared-memory buffers that another process maps without copying.

A buffer is a file in ``/dev/shm`` (the POSIX shm namespace) mapped ``MAP_SHARED`` as a uint8
torch tensor: writes by one process are visible to every process that mapped the same name.
"""

from __future__ import annotations

import torch

from engines.device import SHM_DIR


class SharedBuffer:
    """A uint8 tensor backed by shared memory; the creator owns (and unlinks) it."""

    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        if "/" in name:
            raise ValueError(f"shared buffer name {name!r} must not contain '/'")
        self.name, self.nbytes, self.owner = name, nbytes, create
        self.path = SHM_DIR / name
        if create:
            with open(self.path, "wb") as f:
                f.truncate(nbytes)
        elif not self.path.exists():
            raise FileNotFoundError(f"shared buffer {name} does not exist (was its owner started?)")
        elif self.path.stat().st_size != nbytes:
            raise ValueError(f"shared buffer {name} has {self.path.stat().st_size} bytes, expected {nbytes}")
        self.tensor = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)

    @classmethod
    def create(cls, name: str, nbytes: int) -> SharedBuffer:
        return cls(name, nbytes, create=True)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> SharedBuffer:
        return cls(name, nbytes, create=False)

    def close(self) -> None:
        """Drop the mapping; the owner also removes the name."""
        self.tensor = None  # type: ignore[assignment]
        if self.owner:
            self.path.unlink(missing_ok=True)

    def __del__(self) -> None:
        if getattr(self, "owner", False) and getattr(self, "tensor", None) is not None:
            self.close()
