"""Large pinned host buffers cost what they hold: torch's pinned allocator rounds every block up to a power
of two (a 16.4 GB replica pinned 32 GiB), ``engines.device.host_buffer`` pins the exact size."""

from __future__ import annotations

import ast
import gc
import os
from pathlib import Path

import pytest
import torch

import engines.device as device
from engines.device import host_buffer
from engines.training.offload import HostOffloader

ROOT = Path(__file__).resolve().parents[1]
#: the modules whose host buffers go through ``host_buffer``
PINNING = [*sorted((ROOT / "checkpoint_engine").glob("*.py")), ROOT / "engines/training/offload.py",
           ROOT / "engines/inference/native.py"]


def test_without_cuda_a_host_buffer_is_a_plain_tensor_of_the_bytes_asked(monkeypatch):
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: False)
    for n in (0, 1, (3 << 20) + 1):
        for pinned in (True, False):
            t = host_buffer(n, pinned)
            assert t.dtype == torch.uint8 and t.shape == (n,) and t.device.type == "cpu" and not t.is_pinned()


def test_a_pinned_buffer_registers_exactly_its_bytes_until_its_last_view_is_gone(monkeypatch):
    """With CUDA (stood in for here) the buffer is a mapping of the exact size registered as it is, not a
    power-of-two block; it is unregistered once, when nothing views it any more."""
    calls: list[tuple] = []
    monkeypatch.setattr(device.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "_register", lambda ptr, n: calls.append(("register", ptr, n)))
    monkeypatch.setattr(device, "_unregister", lambda ptr: calls.append(("unregister", ptr)))
    n = (3 << 20) + 1
    t = host_buffer(n)
    assert t.shape == (n,) and t.dtype == torch.uint8 and calls == [("register", t.data_ptr(), n)]
    assert t.data_ptr() % 4096 == 0 and int(t.sum()) == 0
    ptr, view = t.data_ptr(), t[n - 10 :]
    t[-1] = 7
    del t
    gc.collect()
    assert len(calls) == 1 and int(view[-1]) == 7  # a view keeps the registration (and the bytes)
    del view
    gc.collect()
    assert calls == [("register", ptr, n), ("unregister", ptr)]


def _pin_memory_uses(path: Path) -> list[str]:
    """``file:line`` of every ``pin_memory=`` argument and ``.pin_memory()`` call (torch's rounding allocator)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            if any(k.arg == "pin_memory" for k in node.keywords) or \
                    (isinstance(node.func, ast.Attribute) and node.func.attr == "pin_memory"):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_large_host_buffer_goes_through_torchs_rounding_pinned_allocator(tmp_path):
    """The offload buffer and the rollback journal (each the size of a model) are pinned by ``host_buffer``."""
    assert [u for p in PINNING for u in _pin_memory_uses(p)] == []
    bad = tmp_path / "m.py"
    bad.write_text("import torch\na = torch.empty(3, pin_memory=True)\nb = a.pin_memory()\nc = torch.empty(3)\n")
    assert _pin_memory_uses(bad) == ["m.py:2", "m.py:3"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _host_reserved() -> int:
    """Bytes torch's caching pinned allocator holds (0 where this torch has no such statistics)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return int(stats().get("reserved_bytes.current", 0)) if stats else 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pinning_one_and_a_half_gib_does_not_reserve_two():
    torch.zeros(1, device="cuda")  # the CUDA context's own host memory is not the buffer's
    n = (3 << 29) + 1
    rss, reserved = _rss(), _host_reserved()
    t = host_buffer(n)
    grown = _rss() - rss
    assert t.shape == (n,) and t.is_pinned()
    assert 3 << 29 <= grown < 7 << 28, f"pinning 1.5 GiB + 1 byte took {grown / 2**30:.2f} GiB"
    assert _host_reserved() == reserved  # not a block of torch's caching pinned allocator
    src = torch.arange(1 << 18, dtype=torch.int32, device="cuda").view(torch.uint8)
    t[-src.numel():].copy_(src, non_blocking=True)  # DMA straight from and to the registered pages
    back = torch.empty_like(src)
    back.copy_(t[-src.numel():], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    del t
    gc.collect()
    assert _rss() - rss < 1 << 28  # unregistered and unmapped: handed back to the system


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_trainer_offload_pins_its_exact_size():
    x = torch.randint(0, 256, ((3 << 29) + 1,), dtype=torch.uint8, device="cuda")
    total = int(x.sum(dtype=torch.int64))
    off, rss = HostOffloader(), _rss()
    off.offload([x])
    assert off.buffer is not None and off.buffer.is_pinned() and off.buffer.numel() == -(-x.numel() // 64) * 64
    assert _rss() - rss < 7 << 28
    off.onload()
    assert int(x.sum(dtype=torch.int64)) == total
