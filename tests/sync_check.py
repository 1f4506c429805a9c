"""Find the ops that make the host wait for the device, or that a CUDA graph cannot capture.

A decode step replayed as a CUDA graph must not read anything back on the host, and the eager code
around it should wait for the device once per step at most. ``HostSyncChecker`` watches a block of code
at the dispatcher (``TorchDispatchMode``) and, for the few host-side calls the dispatcher never sees on
a CPU (``Tensor.tolist``, ``torch.tensor(..., device=...)``), at the Python API (``TorchFunctionMode``).
It reports:

- ops whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``, indexing
  with a boolean mask, ``repeat_interleave`` without ``output_size``): a device must tell the host
  the size, and a CPU run shows them just the same;
- values read on the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``torch.equal``);
- copies from a device to the host, and blocking copies from the host to a device (on a CPU run:
  ``torch.tensor(data, device=compute_device)``, which would be one on a GPU).

The engines' sync-free way to bring host values to a device is ``engines.inference.uploads``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

__all__ = ["HostSync", "HostSyncChecker", "HostSyncError", "no_host_sync", "unwatched"]

_aten = torch.ops.aten

#: Ops whose output size depends on the values of their input.
_DATA_DEPENDENT = {
    _aten.nonzero.default, _aten.nonzero_numpy.default, _aten.argwhere.default, _aten.masked_select.default,
    _aten._unique.default, _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default, _aten.bincount.default,
}
#: Ops that return a host value computed on the device.
_HOST_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
_COPIES = {_aten.copy_.default, _aten.copy.default, _aten._to_copy.default}


@dataclass(frozen=True)
class HostSync:
    """One offending op: its name and why it syncs."""

    op: str
    why: str


class HostSyncError(RuntimeError):
    """Raised by a strict checker at the first op that syncs the host with the device."""


def _device(x: Any) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


def _copy_sync(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why a copy op waits for the device (a device→host copy, a blocking host→device one), or None."""
    if func is _aten._to_copy.default:
        src, dst = _device(args[0]), kwargs.get("device") or _device(args[0])
    else:
        src, dst = _device(args[1]), _device(args[0])
    if src is None or dst is None or src.type == torch.device(dst).type:
        return None
    if torch.device(dst).type == "cpu":
        return "device→host copy"
    positional = args[2] if func is not _aten._to_copy.default and len(args) > 2 else False
    return None if kwargs.get("non_blocking", positional) else "blocking host→device copy"


def _why(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` on these arguments would sync the host with the device they are on, or None."""
    if func in _DATA_DEPENDENT:
        return "output size depends on the data"
    if func in _HOST_READS:
        return "reads a device value on the host"
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "output size depends on the data"
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "boolean-mask indexing (a hidden nonzero)"
    if func in _COPIES:
        return _copy_sync(func, args, kwargs)
    return None


class _DispatchProbe(TorchDispatchMode):
    """Every aten op below autograd goes through here."""

    def __init__(self, checker: HostSyncChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        # a copy names its devices itself; any other op syncs only when it runs on the device
        if why is not None and (func in _COPIES or self.checker.on_compute(args)):
            self.checker.report(str(func), why)
        return func(*args, **kwargs)


class _FunctionProbe(TorchFunctionMode):
    """The host-side calls a CPU run never dispatches: ``tolist`` and uploads of Python data."""

    def __init__(self, checker: HostSyncChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and self.checker.is_compute(args[0].device):
            self.checker.report("Tensor.tolist", "reads device values on the host")
        elif func in (torch.tensor, torch.as_tensor) and not isinstance(args[0] if args else None, torch.Tensor):
            dev = kwargs.get("device")
            if dev is not None and self.checker.is_compute(torch.device(dev)):
                self.checker.report(f"torch.{func.__name__}", "blocking host→device copy of Python data")
        return func(*args, **kwargs)


@dataclass
class HostSyncChecker:
    """Context manager recording (``found``) or, when ``strict``, raising at ops that sync the host.

    ``compute_device``: the device the checked code computes on; a CPU run passes "cpu" so that its ops and
    uploads count as they would on a GPU (by default only non-CPU devices count: host-only work is free)."""

    strict: bool = False
    compute_device: torch.device | str | None = None
    found: list[HostSync] = field(default_factory=list)

    def is_compute(self, device: torch.device) -> bool:
        """Whether ``device`` plays the accelerator here."""
        if self.compute_device is None:
            return device.type != "cpu"
        return device.type == torch.device(self.compute_device).type

    def on_compute(self, args: tuple) -> bool:
        """Whether any tensor among ``args`` (at any depth) is on a device that plays the accelerator."""
        return any(isinstance(t, torch.Tensor) and self.is_compute(t.device) for t in tree_leaves(args))

    def report(self, op: str, why: str) -> None:
        """Record one offending op (raise if strict)."""
        self.found.append(HostSync(op, why))
        if self.strict:
            raise HostSyncError(f"{op}: {why}")

    def __enter__(self) -> HostSyncChecker:
        # function mode outermost: its own calls dispatch through the inner mode only once
        self._modes = [_FunctionProbe(self), _DispatchProbe(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


def no_host_sync(compute_device: torch.device | str | None = None) -> HostSyncChecker:
    """A strict checker: the first op that syncs the host raises ``HostSyncError``."""
    return HostSyncChecker(strict=True, compute_device=compute_device)


@contextmanager
def unwatched() -> Iterator[None]:
    """Suspend the checkers inside: for a compiled region (flex_attention), which torch.compile will not
    trace under a dispatch mode, whose calling convention makes host scalars, and which on a GPU is one kernel."""
    with ExitStack() as stack:
        stack.enter_context(_disable_current_modes())
        for _ in _get_current_function_mode_stack():
            stack.enter_context(_pop_mode_temporarily())
        yield
