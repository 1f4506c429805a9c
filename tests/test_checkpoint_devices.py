"""Every tensor the checkpoint engine gives torch.distributed is on the engine's device, and a cast on the
way to the replica happens where the bytes land.

An NCCL group takes device tensors only: a control word made on the host ("No backend type associated
with device type cpu") stops a restarted replica from ever catching up. On CPU the same mistake is
invisible (the engine's device is the host), so the behavioural test runs the engine's calls with
``meta`` as the default device: a tensor the engine does not place on its own device explicitly lands on
``meta`` here, as it would land on the host next to a GPU, and the spied torch.distributed calls name it.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from benchmarks.harness.ranks import ShardedWeights, Sharding, SyntheticModel, digest, expected_digests, run_ranks
from checkpoint_engine.buckets import TensorSpec
from checkpoint_engine.topology import free_port

ROOT = Path(__file__).resolve().parents[1]
SPIED = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce")
# four buckets of 1 KiB over two owners: every branch of the pipelines runs (bucket k >= 2 reuses a buffer)
SPECS = [TensorSpec(f"layers.{i}.weight", (8, 64), "bfloat16", 8 * 64 * 2) for i in range(3)] + \
        [TensorSpec("norm", (256,), "float32", 1024)]
BUCKET = 1024


def _master(spec: TensorSpec) -> torch.Tensor:
    """A float32 master copy of ``spec`` (finite values: NaN payloads are not kept by a cast)."""
    return torch.randn(spec.shape, generator=torch.Generator().manual_seed(7)) * 0.05


class _Replica:
    """The inference side in the worker's own process (a reloader and a packer), run outside ``meta``:
    the real one is another process, whose default device is its own."""

    def __init__(self, plan, handles) -> None:
        from checkpoint_engine.sinks import TensorSink
        from checkpoint_engine.transfer import WeightReceiver

        self.weights = ShardedWeights(list(plan.tensors.values()), Sharding())
        self.recv = WeightReceiver(plan, handles, TensorSink(self.weights.tensors, on_commit=self.weights.rebind))

    def start(self, bucket: int, buffer: int, version: int) -> None:
        with torch.device("cpu"):
            self.recv.load(bucket, buffer, version)

    def wait(self, bucket: int) -> None:
        pass

    def abort(self, version: int) -> None:
        with torch.device("cpu"):
            self.recv.rollback()

    def pack(self, bucket: int, buffer: int) -> int:
        with torch.device("cpu"):
            return self.recv.pack(bucket, buffer)


def _spy(calls: list) -> None:
    """Record the device of the tensor of every tensor-carrying torch.distributed call, and refuse ``meta``."""
    import torch.distributed as dist

    def spying(name: str):
        real = getattr(dist, name)

        def spy(tensor, *args, **kwargs):
            calls.append((name, str(tensor.device)))
            if tensor.device.type == "meta":
                raise RuntimeError(f"torch.distributed.{name} got a tensor the engine did not place on its device")
            return real(tensor, *args, **kwargs)
        return spy

    for name in SPIED:
        setattr(dist, name, spying(name))


def _worker(rank: int, init: str, nodes: list[str], name: str, result) -> None:
    """Two updates (the second casts a float32 master to the replica's bf16), then replica 1 restarts empty and
    catches up from replica 0: every engine call runs with ``meta`` as the default device."""
    from checkpoint_engine.engine import CheckpointEngine

    torch.set_num_threads(1)
    out: dict = {"calls": [], "errors": []}
    _spy(out["calls"])
    try:
        model = SyntheticModel(tuple(SPECS), 2)
        plan = model.plan(BUCKET)
        engine = CheckpointEngine(rank, 2, init, BUCKET, name, node=nodes[rank])
        replica = _Replica(plan, engine.ipc_handles())
        for version in (1, 2):
            own, offsets = model.sources(rank, version)
            if version == 2 and SPECS[0].name in own:
                own[SPECS[0].name] = _master(SPECS[0])
            with torch.device("meta"):
                engine.update(plan, own, version, replica, offsets)
        if rank == 1:
            replica = _Replica(plan, engine.ipc_handles())  # restarted: zeros
        with torch.device("meta"):
            if rank == 1:
                engine.catch_up(plan, 0, replica)
            else:
                engine.serve_catch_up(plan, 1, replica)
        out["digests"] = {n: digest(t) for n, t in replica.weights.tensors.items()}
        out["version"] = replica.recv.version
        engine.close()
    except Exception as e:
        out["errors"].append(f"{type(e).__name__}: {e}")
    result.put((rank, out))


def _run(nodes: list[str]) -> dict[int, dict]:
    init, name = f"tcp://127.0.0.1:{free_port()}", f"test-ce-dev-{os.getpid()}-{free_port()}"
    return run_ranks(_worker, [(r, init, nodes, name) for r in range(2)], name, 180)


@pytest.mark.parametrize("nodes", [["a", "b"], ["a", "a"]], ids=["point-to-point", "shared-buffers"])
def test_update_and_catch_up_give_the_group_only_tensors_on_the_engines_device(nodes):
    """Between nodes the catch-up sends its version word and buckets point to point and the update
    broadcasts; inside a node the catch-up exchanges words over the shared buffers. Every tensor of every
    call is on the engine's device, and the restarted replica holds update 2 bitwise."""
    out = _run(nodes)
    assert sorted(out) == [0, 1], "a worker did not report"
    assert [out[r]["errors"] for r in (0, 1)] == [[], []]
    calls = [c for r in (0, 1) for c in out[r]["calls"]]
    assert {device for _, device in calls} == {"cpu"}, calls
    kinds = {kind for kind, _ in calls}
    assert kinds >= ({"broadcast", "send", "isend", "recv"} if nodes[0] != nodes[1] else {"send", "recv"})
    want = expected_digests(SPECS, Sharding(), 2)
    want[SPECS[0].name] = digest(_master(SPECS[0]).to(torch.bfloat16))
    assert out[1]["digests"] == want and out[1]["version"] == 2


def test_a_tensor_on_the_wrong_device_is_named_before_the_call(monkeypatch):
    """The check runs before torch.distributed sees the tensor, and says which call, which tensor, which devices."""
    import torch.distributed as dist

    from checkpoint_engine.wire import Wire, WrongDeviceError

    monkeypatch.setattr(dist, "send", lambda *a, **k: pytest.fail("reached torch.distributed"))
    wire = Wire(torch.device("cuda", 0))
    with pytest.raises(WrongDeviceError, match=r"send got a \(1,\) torch.int64 tensor on cpu.*on cuda:0"):
        wire.send(torch.zeros(1, dtype=torch.int64), 1)
    assert Wire(torch.device("meta")).word(5).device.type == "meta"  # control words are made on the device


#: torch.distributed functions that carry no tensor of the caller's (objects, groups, set-up)
NO_TENSOR = {"is_available", "is_initialized", "init_process_group", "destroy_process_group", "get_rank",
             "get_world_size", "all_gather_object", "broadcast_object_list", "barrier", "new_group", "ReduceOp"}


def _dist_uses(path: Path) -> list[str]:
    """``file:line name`` of every use of a torch.distributed attribute that may carry a tensor."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name not in NO_TENSOR]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr not in NO_TENSOR:
            found.append(f"{path.name}:{node.lineno} {node.attr}")
    return found


def test_every_tensor_call_to_torch_distributed_goes_through_the_device_check(tmp_path):
    """A guard beside the behavioural test: outside ``checkpoint_engine/wire.py`` no module of the checkpoint
    engine calls a tensor-carrying torch.distributed function itself (the checker itself can fail)."""
    uses = {p.name: _dist_uses(p) for p in sorted((ROOT / "checkpoint_engine").glob("*.py"))}
    assert uses.pop("wire.py")
    assert [u for us in uses.values() for u in us] == []
    bad = tmp_path / "m.py"
    bad.write_text("import torch.distributed as d\nfrom torch.distributed import recv\nd.send(x, 1)\nd.barrier()\n")
    assert _dist_uses(bad) == ["m.py:2 recv", "m.py:3 send"]


def test_a_cast_through_device_scratch_equals_the_hosts_own_cast():
    """fp32 -> bf16 in chunks through a scratch (on a GPU: the device; here another host buffer, so every chunk
    boundary is exercised) is bitwise ``to(torch.bfloat16)``: round to nearest even, ties, subnormals, inf, NaN."""
    from checkpoint_engine.engine import copy_cast

    t = torch.randn(10_007, generator=torch.Generator().manual_seed(3)) * 3
    t[:8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, -2**-140, float("inf"), -float("inf"),
                          3.4e38])
    t[8] = float("nan")
    want = t.to(torch.bfloat16).view(torch.int16)
    for scratch_bytes in (1000, 4096, 1 << 20):  # 250 floats a chunk (not a divisor), 1024, all at once
        got = torch.empty(t.numel(), dtype=torch.bfloat16)
        copy_cast(got, t, torch.empty(scratch_bytes, dtype=torch.uint8))
        assert torch.equal(got.view(torch.int16), want), scratch_bytes
    got = torch.empty(t.numel(), dtype=torch.bfloat16)
    copy_cast(got, t)
    assert torch.equal(got.view(torch.int16), want)
