"""Checkpoint engine: bucket planning, verified loading, and real multi-process updates.

The multi-process tests run N checkpoint-engine worker processes (one gloo group) and N
inference processes that map the workers' shared-memory IPC buffers; replicas are compared with
the trainer's tensors by digest, so "equal" means bitwise equal.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from itertools import pairwise

import pytest
import torch

from benchmarks.harness.ranks import (
    Sharding,
    Step,
    digest,
    expected_digests,
    make_tensor,
    run_scenario,
    save_checkpoint,
    shard_digests,
    synthetic_params,
)
from checkpoint_engine.buckets import ALIGN, TensorSpec, plan_buckets, spec_of
from checkpoint_engine.shm import SharedBuffer
from checkpoint_engine.sinks import TensorSink
from checkpoint_engine.trailer import write_trailer
from checkpoint_engine.transfer import CorruptUpdateError, PlanMismatchError, WeightReceiver
from engines.model.sharded import chunk_rows

# every dtype users train in, a tensor 3x larger than a bucket, and tensors that share a bucket
MIXED = [TensorSpec("embed.fp32", (96, 64), "float32", 96 * 64 * 4),
         TensorSpec("attn.bf16", (40, 33), "bfloat16", 40 * 33 * 2),
         TensorSpec("mlp.fp16", (17, 20), "float16", 17 * 20 * 2),
         TensorSpec("norm.fp32", (33,), "float32", 33 * 4)]
BUCKET = 8192


def test_plan_covers_every_byte_once_and_aligns():
    owners = {s.name: i % 2 for i, s in enumerate(MIXED)}
    plan = plan_buckets(MIXED, BUCKET, owners)
    covered = {s.name: [] for s in MIXED}
    for k, bucket in enumerate(plan.buckets):
        ends = []
        for p in bucket:
            assert p.offset % ALIGN == 0 and p.offset + p.length <= BUCKET
            assert owners[p.name] == plan.owners[k]  # a bucket holds one owner's tensors only
            ends.append((p.offset, p.offset + p.length))
            covered[p.name].append((p.start, p.start + p.length))
        assert all(a[1] <= b[0] for a, b in pairwise(sorted(ends)))
    for s in MIXED:
        spans = sorted(covered[s.name])
        assert spans[0][0] == 0 and spans[-1][1] == s.nbytes
        assert all(a[1] == b[0] for a, b in pairwise(spans))
    assert len(covered["embed.fp32"]) == 3
    assert plan.owners[:2] == [0, 1]  # owners alternate, so broadcast sources rotate


def test_plan_with_row_shards_sends_each_byte_from_its_holder():
    """A row-sharded trainer (FSDP2) holds byte ranges of every tensor; each range is sent by its rank."""
    def rows(s, world):  # FSDP2's split of dim 0 as byte ranges; the last rank may get nothing
        per_row, counts = s.nbytes // s.shape[0], chunk_rows(s.shape[0], world)
        return [(r, sum(counts[:r]) * per_row, sum(counts[: r + 1]) * per_row) for r in range(world)]

    owners = {s.name: rows(s, 3) for s in MIXED}
    plan = plan_buckets(MIXED, BUCKET, owners)
    for k, bucket in enumerate(plan.buckets):
        for p in bucket:
            holder = next((lo, hi) for r, lo, hi in owners[p.name] if r == plan.owners[k])
            assert holder[0] <= p.start and p.start + p.length <= holder[1]
    sent = sorted((p.name, p.start, p.start + p.length) for b in plan.buckets for p in b)
    for s in MIXED:
        spans = [(lo, hi) for n, lo, hi in sent if n == s.name]
        assert spans[0][0] == 0 and spans[-1][1] == s.nbytes and all(a[1] == b[0] for a, b in pairwise(spans))
    with pytest.raises(ValueError, match="do not tile"):
        plan_buckets(MIXED, BUCKET, {MIXED[0].name: [(0, 0, 8), (1, 16, MIXED[0].nbytes)]})


def test_bucket_size_must_be_aligned():
    with pytest.raises(ValueError, match="multiple of 256"):
        plan_buckets(MIXED, 1000)


def test_update_is_bitwise_equal_for_every_dtype_and_large_tensors():
    run = run_scenario(MIXED, 2, BUCKET, [Step("update", 1), Step("update", 2)])
    for res in run.results.values():
        assert res["errors"] == {}
        assert res["version"] == 2 and res["consistent"]
        assert res["digests"] == expected_digests(MIXED, Sharding(), 2)


def test_workers_with_different_shardings_each_get_their_shard():
    specs = synthetic_params(3 << 20, "bfloat16", width=384)
    run = run_scenario(specs, 3, 256 << 10, [Step("update", 1)], shard_inference=True)
    digests = [run.results[r]["digests"] for r in range(3)]
    for r in range(3):
        assert digests[r] == expected_digests(specs, Sharding(r, 3), 1)
    assert digests[0]["layers.0.weight"] != digests[1]["layers.0.weight"]  # really different shards


@pytest.mark.parametrize("rollback", ["swap", "journal"])
def test_worker_that_fails_to_stage_leaves_previous_weights(rollback):
    steps = [Step("update", 1), Step("fail", 2, rank=1), Step("update", 3), Step("fail", 4, rank=0)]
    run = run_scenario(MIXED, 2, BUCKET, steps, rollback=rollback)
    for rank, res in run.results.items():
        for step, culprit in ((1, 1), (3, 0)):
            err = res["errors"][step]
            assert f"from worker {culprit}" in err  # the bucket's owner, i.e. the failing worker
            assert ("failed to stage" if rank == culprit else "aborted") in err
        assert 2 not in res["errors"]  # the group survives an aborted update: the next one lands
        assert res["version"] == 3 and res["consistent"]
        assert res["digests"] == expected_digests(MIXED, Sharding(), 3)
    assert "holds no tensor" in run.results[1]["errors"][1]
    # buckets loaded before each failure (1 of v2, 4 of v4) were really applied, then undone
    assert run.results[0]["loads"] == 5 + 1 + 5 + 4


def test_without_rollback_a_failed_update_is_flagged_not_served():
    run = run_scenario(MIXED, 2, BUCKET, [Step("update", 1), Step("fail", 2, rank=1)], rollback="none")
    assert all(not res["consistent"] and res["version"] == 1 for res in run.results.values())


def test_crashed_worker_is_named_and_survivors_keep_previous_weights():
    steps = [Step("update", 1), Step("crash", 2, rank=1)]
    run = run_scenario(MIXED, 2, BUCKET, steps, timeout_s=180)
    assert set(run.results) == {0}  # worker 1 died without reporting
    res = run.results[0]
    assert "from worker 1" in res["errors"][1]
    assert res["version"] == 1 and res["consistent"]
    assert res["digests"] == expected_digests(MIXED, Sharding(), 1)


def test_startup_reads_each_file_once_and_fills_empty_replicas(tmp_path):
    specs = synthetic_params(1 << 20, "bfloat16", width=256)
    files = save_checkpoint(specs, 7, tmp_path, files=3)
    run = run_scenario(specs, 2, 64 << 10, [Step("startup", 7, path=str(tmp_path))], shard_inference=True)
    reads = [run.results[r]["reads"] for r in range(2)]
    assert set(reads[0]).isdisjoint(reads[1])  # each file is read by one worker only
    assert set(reads[0]) | set(reads[1]) == {f.name for f in files}
    per_file = {f.name: len(specs[i::3]) for i, f in enumerate(files)}
    assert {**reads[0], **reads[1]} == per_file  # each tensor read once, big ones included
    for r in range(2):
        assert run.results[r]["digests"] == expected_digests(specs, Sharding(r, 2), 7)


def test_missing_or_damaged_checkpoint_is_named(tmp_path):
    from checkpoint_engine.startup import CheckpointReadError, checkpoint_files, read_index

    with pytest.raises(CheckpointReadError, match="no .safetensors files"):
        checkpoint_files(tmp_path / "nowhere")
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x05")
    with pytest.raises(CheckpointReadError, match="model.safetensors: not a readable safetensors file"):
        read_index(checkpoint_files(tmp_path))


@pytest.mark.parametrize(("nodes", "peer"), [(1, 0), (2, 0)])
def test_restarted_replica_catches_up_from_one_peer_while_the_others_take_no_part(nodes, peer):
    """Replica 2 restarts empty and copies replica 0's weights point to point: through the node's
    shared buffers when they share a node, over gloo when not (2 nodes: workers 0, 1 | 2). The third
    worker makes no call at all during the catch-up; had the engine needed it, the step would hang."""
    steps = [Step("update", 1), Step("update", 2), Step("restart", rank=2), Step("catch_up", rank=2, peer=peer)]
    run = run_scenario(MIXED, 3, BUCKET, steps, nodes=nodes)
    n = run.results[0]["buckets"]
    assert all(res["errors"] == {} for res in run.results.values())
    assert run.results[2]["loads"] == n      # the restarted replica loaded the catch-up only
    for r in (0, 1):
        assert run.results[r]["loads"] == 2 * n  # the two updates: packing loads nothing
    for res in run.results.values():
        assert res["digests"] == expected_digests(MIXED, Sharding(), 2) and res["version"] == 2
    assert len(run.update_s) == 3 and run.update_s[-1] > 0  # the restarted worker timed its catch-up


def test_catch_up_from_a_replica_without_weights_is_refused():
    steps = [Step("update", 1), Step("restart", rank=0), Step("restart", rank=1), Step("catch_up", rank=1, peer=0)]
    run = run_scenario(MIXED, 2, BUCKET, steps)
    assert "holds no complete update" in run.results[0]["errors"][3]
    assert "could not send bucket 0" in run.results[1]["errors"][3]
    assert run.results[1]["version"] is None and run.results[1]["consistent"]


# FP8: matrices whose shapes are not multiples of the block, and a block of 32 rows so that FSDP-like
# row shards over 3 workers (67 rows each) cut blocks in two
FP8_SPECS = [TensorSpec("w.a", (200, 136), "bfloat16", 200 * 136 * 2),
             TensorSpec("w.norm", (136,), "float32", 136 * 4),
             TensorSpec("w.b", (64, 300), "float32", 64 * 300 * 4)]


@pytest.mark.parametrize(("split_rows", "nodes", "shard"), [(False, 1, False), (True, 2, False), (True, 1, True)])
def test_fp8_update_equals_the_reference_quantisation(split_rows, nodes, shard):
    """Owners quantise their rows bucket by bucket (an FSDP-like split cuts blocks between workers, whose
    maxima are combined): every replica holds exactly ``engines.model.native.fp8.quantize`` of the trainer's weights,
    and the wire carries about a byte per element instead of two (or four)."""
    from benchmarks.harness.synthetic import SyntheticModel

    model = SyntheticModel(tuple(FP8_SPECS), 3, split_rows, fp8=True, block=32)
    plan = model.plan(4096)
    assert plan.fp8 == {"w.a": "w.a_scale_inv", "w.b": "w.b_scale_inv"}
    wire = sum(t.nbytes for t in plan.tensors.values())
    assert wire < 0.51 * (200 * 136 * 2 + 64 * 300 * 2) + 136 * 4 + 4 * (7 * 5 + 2 * 10)
    run = run_scenario(FP8_SPECS, 3, 4096, [Step("update", 1), Step("update", 2)], split_rows=split_rows, nodes=nodes,
                       fp8=True, block=32, shard_inference=shard)
    ref = model.reference(2)
    for r, res in run.results.items():
        assert res["errors"] == {} and res["version"] == 2
        assert res["digests"] == shard_digests(ref, Sharding(r, 3) if shard else Sharding())


def test_fp8_checkpoint_starts_replicas_as_stored_and_trainers_dequantised(tmp_path):
    """A block-FP8 checkpoint (F8_E4M3 matrices, float32 ``_scale_inv``) is read once: FP8 replicas get
    its bytes, each worker's trainer rows (starting inside a block) get them dequantised."""
    from benchmarks.harness.synthetic import SyntheticModel
    from engines.model.native.fp8 import dequantize

    save_checkpoint(FP8_SPECS, 5, tmp_path, files=2, fp8=True, block=32)
    run = run_scenario(FP8_SPECS, 3, 4096, [Step("startup", 5, path=str(tmp_path), trainer=True)], split_rows=True,
                       fp8=True, block=32)
    model = SyntheticModel(tuple(FP8_SPECS), 3, split_rows=True, fp8=True, block=32)
    ref = model.reference(5)
    for r, res in run.results.items():
        assert res["errors"] == {} and res["digests"] == shard_digests(ref, Sharding())
        rows = {n: t for n, t in model.sources(r, 5)[0].items()}  # which rows worker r holds, by shape
        want = {}
        for s in FP8_SPECS:
            if s.name not in rows:
                continue
            full = dequantize(ref[s.name], ref[s.name + "_scale_inv"], 32) if s.name in model.plan(4096).fp8 \
                else ref[s.name].float()
            first = model.sources(r, 5)[1].get(s.name, 0)
            want[s.name] = digest(full.reshape(-1)[first:first + rows[s.name].numel()].float())
        assert res["trainer"] == want


def test_fp8_plan_needs_matrices_and_their_scales():
    with pytest.raises(ValueError, match="FP8 weight needs"):
        plan_buckets(MIXED, BUCKET, fp8={"attn.bf16": "attn.bf16_scale_inv"})


def _one_bucket(tmp_name: str, version: int):
    """A plan of one unsharded tensor and its bucket written by hand into a shared buffer."""
    t = make_tensor(MIXED[1], version)
    plan = plan_buckets([spec_of("attn.bf16", t)], BUCKET)
    buf = SharedBuffer.create(tmp_name, BUCKET + ALIGN)
    raw = t.reshape(-1).view(torch.uint8)
    buf.tensor[: raw.numel()].copy_(raw)
    write_trailer(buf.tensor, plan.used_bytes(0), version, 0)
    return plan, buf, t


def test_corrupted_or_stale_bucket_is_refused_and_weights_kept(tmp_path):
    plan, buf, new = _one_bucket(f"test-ce-{tmp_path.name}", 2)
    try:
        old = make_tensor(MIXED[1], 1)
        target = {"attn.bf16": old.clone()}
        recv = WeightReceiver(plan, [("shm", buf.name, buf.nbytes)] * 2, TensorSink(target))
        with pytest.raises(CorruptUpdateError, match="expected bucket 0 of update 3"):
            recv.load(0, 0, version=3)   # the buffer holds update 2: stale
        buf.tensor[5] ^= 1
        with pytest.raises(CorruptUpdateError, match="checksum"):
            recv.load(0, 0, version=2)
        assert torch.equal(recv.tensors["attn.bf16"].view(torch.int16), old.view(torch.int16))
        buf.tensor[5] ^= 1
        recv.load(0, 0, version=2)
        assert recv.ready and recv.version == 2
        assert torch.equal(recv.tensors["attn.bf16"].view(torch.int16), new.view(torch.int16))
    finally:
        buf.close()


def test_mismatched_receiver_is_rejected(tmp_path):
    plan, buf, new = _one_bucket(f"test-ce-mm-{tmp_path.name}", 1)
    handles = [("shm", buf.name, buf.nbytes)] * 2
    try:
        with pytest.raises(PlanMismatchError, match="attn.bf16"):
            WeightReceiver(plan, handles, TensorSink({"attn.bf16": new.float()}))
        with pytest.raises(PlanMismatchError, match="does not cover"):
            WeightReceiver(plan, handles, TensorSink({"attn.bf16": new, "extra": torch.zeros(3)}))
    finally:
        buf.close()
    assert not buf.path.exists()


def test_cuda_ipc_handles_are_mapped_by_device_uuid():
    """The inference process may number the GPUs otherwise (its own CUDA_VISIBLE_DEVICES): the handle's
    device index is replaced by this process's index of the same GPU, found by UUID."""
    from checkpoint_engine.transfer import local_device, remap_device

    visible = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    assert local_device("GPU-cccc", visible) == 2
    assert local_device("GPU-cccc", list(reversed(visible))) == 0
    with pytest.raises(RuntimeError, match="GPU-dddd, which this process does not see"):
        local_device("GPU-dddd", visible)
    # the argument replaced is the one torch's rebuild_cuda_tensor takes as the storage's device
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    args = tuple(range(100, 100 + len(names)))
    remapped = dict(zip(names, remap_device(args, 0), strict=True))
    assert remapped.pop("storage_device") == 0
    assert remapped == {n: a for n, a in zip(names, args, strict=True) if n != "storage_device"}


def _three_buckets(tmp_name: str):
    """A plan of one tensor in three buckets, and the buffers holding update 2 of it, bucket k in buffer k."""
    t = make_tensor(TensorSpec("w", (3, 1024), "bfloat16", 3 * 2048), 2)
    plan = plan_buckets([spec_of("w", t)], 2048)
    assert len(plan.buckets) == 3
    bufs = []
    for k in range(3):
        buf = SharedBuffer.create(f"{tmp_name}-{k}", 2048 + ALIGN)
        buf.tensor[:2048].copy_(t.reshape(-1).view(torch.uint8)[k * 2048:(k + 1) * 2048])
        write_trailer(buf.tensor, 2048, 2, k)
        bufs.append(buf)
    return plan, bufs, t


def test_journal_runs_a_bucket_ahead_and_rolls_back_exactly(tmp_path):
    """In journal mode bucket k+1's old bytes are saved while bucket k loads (on GPU: on a side stream,
    overlapping the next bucket's transfer); a failure after any number of buckets restores the previous
    weights exactly, and a plan cannot change under a half-applied update."""
    plan, bufs, new = _three_buckets(f"test-ce-j-{tmp_path.name}")
    try:
        old = make_tensor(TensorSpec("w", (3, 1024), "bfloat16", 3 * 2048), 1)
        for applied in (1, 2):
            target = {"w": old.clone()}
            recv = WeightReceiver(plan, [("shm", b.name, b.nbytes) for b in bufs],
                                  TensorSink(target, rollback="journal"))
            for k in range(applied):
                recv.load(k, k, 2)
            assert sorted(recv.sink._journal) == list(range(applied + 1))  # one bucket ahead
            assert not torch.equal(target["w"].view(torch.int16), old.view(torch.int16))
            with pytest.raises(RuntimeError, match="middle of an update"):
                recv.set_plan(plan)
            assert recv.rollback() and recv.consistent and recv.version is None
            assert torch.equal(target["w"].view(torch.int16), old.view(torch.int16))
        for k in range(3):
            recv.load(k, k, 2)
        assert recv.version == 2 and torch.equal(recv.tensors["w"].view(torch.int16), new.view(torch.int16))
        packed = SharedBuffer.create(f"test-ce-j-{tmp_path.name}-p", 2048 + ALIGN)
        try:  # a live replica packs what it serves: the bytes the update delivered, with a fresh trailer
            src = WeightReceiver(plan, [("shm", packed.name, packed.nbytes)], TensorSink(recv.tensors, rollback="none"))
            src.version = 2
            assert src.pack(1, 0) == 2 and torch.equal(packed.tensor, bufs[1].tensor)
        finally:
            packed.close()
    finally:
        for b in bufs:
            b.close()


def _cuda_receiver(specs, plan, handles, conn):
    targets = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device="cuda") for s in specs}
    recv = WeightReceiver(plan, handles, TensorSink(targets))  # journal mode: device memory is not doubled
    conn.send(str(torch.cuda.get_device_properties(recv.buffers[0].device.index).uuid))
    for k in range(len(plan.buckets)):
        recv.load(k, k % 2, conn.recv())
        conn.send("ok")
    # plain bytes: a tensor would travel as a shared-memory handle that this process, about to exit, must serve
    conn.send((recv.rollback_mode, {n: t.cpu().view(torch.uint8).reshape(-1).numpy().tobytes()
                                    for n, t in recv.tensors.items()}))


def _cuda_update(plan, sources: dict, device: int = 0, child_devices: str | None = None):
    """One update on GPU ``device`` into a receiver process that sees ``child_devices`` (its
    CUDA_VISIBLE_DEVICES); returns (rollback mode, the receiver's tensors as bytes, the receiver's GPU UUID)."""
    import os

    from checkpoint_engine.engine import CheckpointEngine
    from checkpoint_engine.topology import free_port

    torch.cuda.set_device(device)
    engine = CheckpointEngine(0, 1, f"tcp://127.0.0.1:{free_port()}", plan.bucket_bytes, "test-cuda",
                              device=f"cuda:{device}")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if child_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = child_devices
    proc = ctx.Process(target=_cuda_receiver, args=(list(plan.tensors.values()), plan, engine.ipc_handles(), child))
    proc.start()
    if child_devices is not None:
        os.environ.pop("CUDA_VISIBLE_DEVICES") if before is None else os.environ.update(CUDA_VISIBLE_DEVICES=before)

    class Reloader:
        def start(self, bucket, buffer, version):
            parent.send(version)

        def wait(self, bucket):
            assert parent.recv() == "ok"

        def abort(self, version):
            pass

    try:
        uuid = parent.recv()
        engine.update(plan, sources, 1, Reloader())
        mode, got = parent.recv()
        got = {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in got.items()}
    finally:
        proc.join(timeout=60)
        engine.close()
    return mode, got, uuid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC, NCCL)")
def test_cuda_ipc_update_is_bitwise_equal():
    t = make_tensor(MIXED[1], 1)
    plan = plan_buckets([spec_of("attn.bf16", t)], 1024)
    mode, got, _ = _cuda_update(plan, {"attn.bf16": t.pin_memory()})
    assert mode == "journal" and torch.equal(got["attn.bf16"], t.view(torch.uint8).reshape(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC, NCCL)")
def test_cuda_fp32_master_is_cast_on_the_gpu_bitwise_as_the_host_casts(monkeypatch):
    """float32 masters to a bf16 replica: sent as float32 through a small device scratch (several chunks a
    piece), cast there, and equal to the host's own cast bit for bit."""
    import checkpoint_engine.engine as ce

    monkeypatch.setattr(ce, "CAST_CHUNK", 256)
    master = torch.randn(40, 33, generator=torch.Generator().manual_seed(5)) * 3
    plan = plan_buckets([TensorSpec("attn.bf16", (40, 33), "bfloat16", 40 * 33 * 2)], 1024)
    _, got, _ = _cuda_update(plan, {"attn.bf16": master.pin_memory()})
    assert torch.equal(got["attn.bf16"], master.to(torch.bfloat16).view(torch.uint8).reshape(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_quantised_on_the_gpu_equals_the_reference():
    """The owner quantises on the device (source rows copied there, scales and FP8 bytes computed there):
    the receiver holds the CPU reference quantisation bit for bit."""
    from benchmarks.harness.synthetic import SyntheticModel

    model = SyntheticModel(tuple(FP8_SPECS), 1, fp8=True, block=32)
    plan = model.plan(4096)
    tensors, _ = model.sources(0, 3)
    _, got, _ = _cuda_update(plan, {n: t.pin_memory() for n, t in tensors.items()})
    for n, want in model.reference(3).items():
        assert torch.equal(got[n], want.view(torch.uint8).reshape(-1)), n


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_ipc_across_device_orderings():
    """The engine's buffers on GPU 1; the inference process sees the GPUs in the other order (its GPU 0
    is the engine's GPU 1): it must map the buffers on the same physical GPU, found by UUID."""
    t = make_tensor(MIXED[1], 1)
    plan = plan_buckets([spec_of("attn.bf16", t)], 1024)
    _, got, uuid = _cuda_update(plan, {"attn.bf16": t.pin_memory()}, device=1, child_devices="1,0")
    assert uuid == str(torch.cuda.get_device_properties(1).uuid)
    assert torch.equal(got["attn.bf16"], t.view(torch.uint8).reshape(-1))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL point to point)")
def test_cuda_restarted_replica_catches_up_over_nccl():
    """Workers on GPUs 0 and 1 (NCCL): replica 1 restarts empty and copies replica 0's weights point to
    point, its version word and every bucket on the device (a host tensor stops NCCL: issue 29, item 3)."""
    steps = [Step("update", 1), Step("update", 2), Step("restart", rank=1), Step("catch_up", rank=1, peer=0)]
    run = run_scenario(MIXED, 2, BUCKET, steps, device="cuda")
    assert all(res["errors"] == {} for res in run.results.values())
    assert run.results[1]["loads"] == run.results[1]["buckets"]  # the catch-up only
    for res in run.results.values():
        assert res["digests"] == expected_digests(MIXED, Sharding(), 2) and res["version"] == 2


def test_benchmark_prints_its_record_last(capsys):
    from benchmarks.weight_update import main

    main(["--gib", "0.01", "--workers", "2", "--bucket-mb", "1", "--repeats", "1", "--json"])
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"update_s", "floor_s", "ratio", "bytes", "gb_per_s", "bitwise_equal"} <= set(rec)
    # stage once, no delivery inside the node (shared buffers), load into both replicas
    assert rec["bitwise_equal"] is True and rec["bytes"] >= 0.01 * (1 << 30) and rec["floor_passes"] == 3
    assert rec["floor_repeats"] == 20 and rec["floor_min_s"] <= rec["floor_s"] <= rec["floor_max_s"]
    assert rec["floor_spread"] == pytest.approx((rec["floor_max_s"] - rec["floor_min_s"]) / rec["floor_s"], abs=0.01)
    assert rec["catch_up_s"] > 0
    # update_s and floor_s are printed to 4 decimals: allow that rounding on a floor of a few ms
    slack = 0.00005 / rec["floor_s"] + 0.00005 / rec["update_s"]
    assert rec["ratio"] == pytest.approx(rec["update_s"] / rec["floor_s"], rel=0.01 + slack)
