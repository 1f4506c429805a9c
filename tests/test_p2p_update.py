"""Point-to-point weight updates (``checkpoint_engine.p2p``) between real processes over real gloo links.

Two trainer-rank processes each own half of the buckets and send them to a replica in this process, over shared
memory (same node) or over the wire (as between nodes). The replica loads into a spare copy while it keeps serving
the previous weights, and serves the update only once it is swapped in; what it serves is compared byte for byte
with tensors made independently from the same seed.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from checkpoint_engine.buckets import TensorSpec, plan_buckets
from checkpoint_engine.engine import UpdateError
from checkpoint_engine.p2p import P2PReceiver, P2PSender
from checkpoint_engine.sinks import TensorSink
from checkpoint_engine.transfer import WeightReceiver

SPECS = [TensorSpec("embed", (96, 64), "float32", 96 * 64 * 4),   # larger than a bucket: split over three
         TensorSpec("attn", (40, 33), "bfloat16", 40 * 33 * 2),
         TensorSpec("norm", (33,), "float32", 33 * 4)]
BUCKET = 8192
OWNERS = {"embed": [(0, 0, 96 * 32 * 4), (1, 96 * 32 * 4, 96 * 64 * 4)], "attn": 1, "norm": 0}


def weights(version: int) -> dict[str, torch.Tensor]:
    """The full weights of update ``version`` (the trainer's float32 masters: the plan casts attn to bf16)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {s.name: torch.randn(s.shape, generator=g) for s in SPECS}


def served(version: int) -> dict[str, torch.Tensor]:
    """What a replica must serve after update ``version``: the plan's dtypes, cast as the trainer casts."""
    return {s.name: t.to(getattr(torch, s.dtype)) for s, t in zip(SPECS, weights(version).values(), strict=True)}


def _sender(rank: int, shm: bool, out, cmds) -> None:
    plan = plan_buckets(SPECS, BUCKET, OWNERS)
    sender = P2PSender(rank, BUCKET, f"p2ptest-{mp.current_process().pid}", timeout_s=60, shm=shm)
    out.put((rank, sender.endpoint))
    sender.connect(0, shared=shm)
    for version, broken in iter(cmds.get, None):
        full = weights(version)
        mine, offsets = {}, {}
        for name, held in OWNERS.items():  # this rank's rows only, as a sharded trainer holds them
            if held == rank:
                mine[name] = full[name]
            elif not isinstance(held, int):
                for r, lo, hi in held:
                    if r == rank:
                        row = full[name].shape[1] * 4
                        mine[name], offsets[name] = full[name][lo // row : hi // row], lo // 4
        if broken:
            mine.pop(broken, None)
        try:
            sender.update(plan, mine, version, offsets=offsets)
            out.put((rank, "ok"))
        except UpdateError as e:
            out.put((rank, str(e)))
    sender.close()


@pytest.fixture(params=[True, False], ids=["shared-memory", "wire"])
def link(request):
    """Two trainer-rank processes linked to a replica here: (receiver, WeightReceiver, command queues, replies)."""
    ctx = mp.get_context("spawn")
    out, cmds = ctx.Queue(), [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_sender, args=(r, request.param, out, cmds[r]), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    endpoints = dict(out.get(timeout=60) for _ in range(2))
    plan = plan_buckets(SPECS, BUCKET, OWNERS)
    p2p = P2PReceiver(plan, timeout_s=60)
    for rank in range(2):
        p2p.connect(rank, endpoints[rank], replica=0)
    sink = TensorSink({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS})
    receiver = WeightReceiver(plan, [], sink)
    receiver.defer_commit = True
    yield plan, p2p, receiver, cmds, out
    for q in cmds:
        q.put(None)
    for p in procs:
        p.join(30)


def _update(link, version: int, broken: str | None = None) -> tuple[Exception | None, dict]:
    plan, p2p, receiver, cmds, out = link
    for q in cmds:
        q.put((version, broken))
    try:
        p2p.receive(plan, version, receiver)
        error = None
    except UpdateError as e:
        error = e
    return error, dict(out.get(timeout=60) for _ in range(2))


def test_update_lands_bit_exact_and_is_served_only_after_the_swap(link):
    plan, _, receiver, _, _ = link
    assert len(plan.buckets) >= 4 and set(plan.owners) == {0, 1}
    for version in (1, 2):
        before = {n: t.clone() for n, t in receiver.tensors.items()}
        error, replies = _update(link, version)
        assert error is None and replies == {0: "ok", 1: "ok"}
        assert receiver.staged == version and receiver.consistent  # staged: the engine may keep serving
        assert all(torch.equal(receiver.tensors[n], before[n]) for n in before)
        receiver.commit_staged(version)
        assert receiver.version == version
        assert all(torch.equal(receiver.tensors[n], t) for n, t in served(version).items())


def test_a_bucket_its_owner_cannot_stage_rolls_the_replica_back_and_the_link_stays_usable(link):
    _, _, receiver, _, _ = link
    error, _ = _update(link, 1)
    receiver.commit_staged(1)
    error, replies = _update(link, 2, broken="attn")  # rank 1 holds no attn: its bucket goes out marked aborted
    assert "aborted by its owner" in str(error)
    assert replies[0] == "ok" and "holds no tensor attn" in replies[1]
    assert receiver.staged is None and receiver.version == 1
    assert all(torch.equal(receiver.tensors[n], t) for n, t in served(1).items())
    error, _ = _update(link, 3)
    assert error is None
    receiver.commit_staged(3)
    assert all(torch.equal(receiver.tensors[n], t) for n, t in served(3).items())


def test_benchmark_measures_both_channels_against_the_floor_and_checks_the_bytes():
    from benchmarks.p2p_update import measure

    rec = measure(8, 1, False, 1)
    assert rec["bitwise_equal"] and rec["buckets"] == 8 and rec["link_gbps"] > 0
    assert rec["floor_s"] == pytest.approx(3 * 8 * 2**20 / (rec["copy_gbps"] * 1e9), rel=0.01)
    assert rec["ratio"] == pytest.approx(rec["update_s"] / rec["floor_s"], rel=0.01)
