"""Every tensor the checkpoint engine hands to torch.distributed goes through here, on the group's device.

An NCCL group has no CPU backend: a host tensor given to ``send`` or ``broadcast`` fails inside the call
("No backend type associated with device type cpu"), and a restarted replica never catches up. So each
call first checks its tensor against the engine's device and names the call, the tensor and both
devices when they differ; control words (versions, acknowledgements) are made on that device here.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class WrongDeviceError(RuntimeError):
    """A tensor given to a collective or point-to-point call is not on the engine's device."""


def matches(want: torch.device, got: torch.device) -> bool:
    """Whether ``got`` is ``want`` (a device given without an index matches any index of its type)."""
    return got.type == want.type and (want.index is None or got.index == want.index)


def check_device(want: torch.device, call: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is on ``want``; a ``WrongDeviceError`` naming ``call`` otherwise."""
    if not matches(want, t.device):
        raise WrongDeviceError(f"checkpoint engine: {call} got a {tuple(t.shape)} {t.dtype} tensor on {t.device}, "
                               f"but its process group carries tensors on {want}")
    return t


class Wire:
    """torch.distributed for one engine: each call checks its tensor is on ``device`` first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def word(self, value: int = 0) -> torch.Tensor:
        """A one-element int64 tensor on the group's device: a version, bucket index or acknowledgement."""
        return torch.tensor([value], dtype=torch.int64, device=self.device)

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Blocking point-to-point send."""
        dist.send(check_device(self.device, "send", t), dst=dst)

    def isend(self, t: torch.Tensor, dst: int):
        """Asynchronous point-to-point send; returns its work handle."""
        return dist.isend(check_device(self.device, "isend", t), dst=dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        """Blocking point-to-point receive into ``t``."""
        dist.recv(check_device(self.device, "recv", t), src=src)

    def broadcast(self, t: torch.Tensor, src: int, group=None) -> None:
        """``t`` from rank ``src`` to every rank of ``group`` (None: the default group)."""
        dist.broadcast(check_device(self.device, "broadcast", t), src=src, group=group)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
        """``t`` reduced with ``op`` over ``group``, in place."""
        dist.all_reduce(check_device(self.device, "all_reduce", t), op=op, group=group)


def rendezvous_store(host: str, port: int, master: bool, timeout_s: float) -> dist.TCPStore:
    """A TCP store for pair links to meet in: the master's (``port`` 0: a free one, then ``.port``) or a client's."""
    timeout = timedelta(seconds=timeout_s)
    if master:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


class PairLink:
    """A two-rank gloo group of its own, outside the default group (a trainer rank and one replica): tagged,
    asynchronous point-to-point calls, each checking its tensor is on ``device`` first. ``key`` names the group in
    ``store``; both ends call this at the same time, with ranks 0 and 1."""

    def __init__(self, store: dist.Store, key: str, rank: int, timeout_s: float,
                 device: torch.device | None = None) -> None:
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"link-{key}", store), rank, 2,
                                           timedelta(seconds=timeout_s))
        self.peer, self.device = 1 - rank, device or torch.device("cpu")

    def isend(self, t: torch.Tensor, tag: int):
        """Send ``t`` to the other end; returns its work handle."""
        return self.group.send([check_device(self.device, "isend", t)], self.peer, tag)

    def irecv(self, t: torch.Tensor, tag: int):
        """Receive into ``t`` from the other end; returns its work handle."""
        return self.group.recv([check_device(self.device, "irecv", t)], self.peer, tag)
