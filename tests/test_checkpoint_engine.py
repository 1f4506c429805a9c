"""Weight update through shared-memory IPC buffers into another process: bitwise equal."""

import multiprocessing as mp
from itertools import pairwise

import pytest
import torch

from checkpoint_engine.buckets import ALIGN, plan_buckets, spec_of
from checkpoint_engine.transfer import PlanMismatchError, WeightReceiver, WeightSender


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big.fp32": torch.randn(40, 50, generator=g),                       # 8000 B > one bucket
        "w.bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "w.fp16": torch.randn(3, 5, generator=g).to(torch.float16),
        "norm": torch.randn(13, generator=g),
        "ids": torch.randint(0, 1000, (17,), generator=g),
    }


def test_plan_covers_every_byte_once_and_aligns():
    specs = [spec_of(n, t) for n, t in _tensors(0).items()]
    plan = plan_buckets(specs, bucket_bytes=2048)
    covered = {s.name: [] for s in specs}
    for bucket in plan.buckets:
        ends = []
        for p in bucket:
            assert p.offset % ALIGN == 0 and p.offset + p.length <= 2048
            ends.append((p.offset, p.offset + p.length))
            covered[p.name].append((p.start, p.start + p.length))
        ends.sort()
        assert all(a[1] <= b[0] for a, b in pairwise(ends))  # no overlap in a bucket
    for s in specs:
        spans = sorted(covered[s.name])
        assert spans[0][0] == 0 and spans[-1][1] == s.nbytes
        assert all(a[1] == b[0] for a, b in pairwise(spans))
    assert len(covered["big.fp32"]) > 1  # split across buckets


def _receiver_process(plan, names, requests, replies):
    targets = _tensors(seed=99)  # different values: the update must overwrite all of them
    recv = WeightReceiver(targets, plan, names)
    while True:
        msg = requests.get()
        if msg is None:
            break
        recv.load(*msg)
        replies.put("ok")
    # plain bytes: tensors would travel through torch's own shared memory, not what is tested
    replies.put({k: (str(v.dtype), v.reshape(-1).view(torch.uint8).numpy().tobytes()) for k, v in targets.items()})


@pytest.mark.parametrize("bucket_bytes", [1024, 4096, 1 << 20])
def test_update_into_another_process_is_bitwise_equal(bucket_bytes):
    src = _tensors(seed=1)
    sender = WeightSender(lambda: src, bucket_bytes, prefix=f"test-ckpt-{bucket_bytes}")
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_process, args=(sender.plan, sender.buffer_names, requests, replies))
    proc.start()
    try:
        for k in range(len(sender.plan.buckets)):
            sender.fill(k, k % 2)
            requests.put((k, k % 2))
            assert replies.get(timeout=60) == "ok"
        requests.put(None)
        received = replies.get(timeout=60)
    finally:
        proc.join(timeout=60)
        sender.close()
    for name, t in src.items():
        dtype, raw = received[name]
        assert dtype == str(t.dtype)
        assert raw == t.reshape(-1).view(torch.uint8).numpy().tobytes(), name


def test_mismatched_receiver_is_rejected():
    src = _tensors(seed=1)
    sender = WeightSender(lambda: src, 4096, prefix="test-ckpt-mismatch")
    try:
        wrong = dict(_tensors(2))
        wrong["w.bf16"] = wrong["w.bf16"].float()
        with pytest.raises(PlanMismatchError, match="w.bf16"):
            WeightReceiver(wrong, sender.plan, sender.buffer_names)
        extra = dict(_tensors(2), extra=torch.zeros(3))
        with pytest.raises(PlanMismatchError, match="does not cover"):
            WeightReceiver(extra, sender.plan, sender.buffer_names)
    finally:
        sender.close()


def test_buffers_are_removed_on_close():
    sender = WeightSender(lambda: _tensors(0), 4096, prefix="test-ckpt-close")
    paths = [b.path for b in sender.buffers]
    assert all(p.exists() for p in paths)
    sender.close()
    assert not any(p.exists() for p in paths)
