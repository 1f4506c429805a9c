"""Arenas: memory given back and taken again at the same addresses (what lets sleep keep CUDA graphs)."""

import ctypes
import mmap
import struct

import pytest
import torch
from torch import nn

from engines.inference import arena as ar
from engines.model.layout import model_tensors


def resident(a: ar.Arena) -> int:
    """Bytes of a host arena held in memory now (pages marked present in /proc/self/pagemap)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(a.base // mmap.PAGESIZE * 8)
        entries = f.read(a.nbytes // mmap.PAGESIZE * 8)
    return sum(mmap.PAGESIZE for (e,) in struct.iter_unpack("<Q", entries) if e >> 63)


def test_host_arena_gives_pages_back_and_keeps_views():
    a = ar.new_arena(8 << 20, "cpu")
    assert isinstance(a, ar.HostArena) and a.nbytes == 8 << 20 and resident(a) == 0
    x = a.view(4096, (1024, 256), torch.float32)
    x.fill_(3.0)
    assert resident(a) >= x.nbytes and a.holds(x) and not a.holds(torch.zeros(3))
    a.unmap()
    assert resident(a) == 0 and not a.mapped
    a.map()
    assert x.data_ptr() == a.base + 4096 and not x.any()  # the same view, zeros after the round trip
    x.fill_(1.0)
    assert float(x.sum()) == x.numel()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0], dtype=torch.float64))


def test_adopt_moves_each_storage_once_and_the_module_computes_the_same():
    torch.manual_seed(0)
    m = Tied()
    x = torch.tensor([[1, 2, 3]])
    want = m.head(m.norm(m.embed(x)))
    tensors = model_tensors(m)
    a = ar.adopt(tensors, "cpu")
    offsets, total = ar.layout(tensors.values())
    assert a is not None and a.nbytes >= total and all(o % ar.ALIGN == 0 for o in offsets)
    assert all(a.holds(t) for t in m.state_dict().values())
    assert m.head.weight.data_ptr() == m.embed.weight.data_ptr()  # still tied
    torch.testing.assert_close(m.head(m.norm(m.embed(x))), want, rtol=0, atol=0)
    assert m.scale.dtype == torch.float64 and float(m.scale) == 2.0


def test_driver_structs_have_the_c_layout():
    # CUmemAllocationProp: two enums, a CUmemLocation, a pointer, 8 bytes of flags; CUmemAccessDesc: location, flags
    assert ctypes.sizeof(ar._AllocationProp) == 32 and ar._AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(ar._AccessDesc) == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_returns_memory_to_the_device_and_maps_back_at_the_same_address():
    n = 256 << 20
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    a = ar.new_arena(n, "cuda")
    assert isinstance(a, ar.CudaArena) and a.mapped
    assert free0 - torch.cuda.mem_get_info()[0] >= n
    x = a.view(0, (n // 4,), torch.float32)
    assert not x.any()
    x.fill_(7.0)
    graph = torch.cuda.CUDAGraph()  # a graph captured on the arena keeps working after unmap/map
    with torch.cuda.graph(graph):
        y = x[:1024] * 2
    # measured across the call alone: the graph's pool and lazily loaded kernels took device memory since free0
    # (174 MiB on an H200 with torch 2.11)
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    a.unmap()
    assert torch.cuda.mem_get_info()[0] - before >= n  # back to the device
    a.map()
    assert x.data_ptr() == a.base and not x.any()
    x[:1024] = 5.0
    graph.replay()
    assert torch.equal(y, torch.full_like(y, 10.0))
    del x, y, graph
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    a.close()
    assert torch.cuda.mem_get_info()[0] - before >= n
