"""A vLLM replica over two tensor-parallel ranks (rollout.tensor_parallel_size 2), in a module of its own: closing
a vLLM engine whose core runs in this process resets vLLM's process-wide distributed state, which would pull it
from under the engine test_vllm_engine's tests share (a rollout worker holds one engine per process)."""

from __future__ import annotations

import pytest

from benchmarks.harness.child_sender import ChildSender
from checkpoint_engine.buckets import spec_of
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import save_pretrained

vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
if not vllm_engine.vllm_available():
    pytest.skip("vLLM is not installed here (make setup installs it)", allow_module_level=True)

from checkpoint_engine.sinks import StreamSink, ViewSink  # noqa: E402
from tests.test_vllm_engine import _checkpoint, _greedy, _model, _prompts  # noqa: E402


def test_vllm_tensor_parallel_replica_serves_and_takes_streamed_updates_on_every_rank(tokenizer, tmp_path):
    """rollout.tensor_parallel_size 2: vLLM's two ranks (processes of their own) give the native engine's greedy
    tokens; an update streamed through the checkpoint engine reaches both ranks (each takes its shard of the full
    tensors), so the replica then serves the new checkpoint exactly; an update aborted midway leaves the old; and an
    update each rank loads from views of the IPC buffers itself (B3) serves exactly too."""
    model = _model(tokenizer, 0, kv_heads=2)  # a head of each kind per rank
    save_pretrained(model, tokenizer, tmp_path / "start")
    engine = vllm_engine.VllmEngine(tmp_path / "start", tokenizer.eos_ids, max_seq_len=256, max_num_seqs=16,
                                    dtype="float32", kv_cache_bytes=32 << 20, tensor_parallel_size=2)
    try:
        assert engine.weight_load == "direct"  # each rank's layers keep their weights: loaded in place, sharded
        native = InferenceEngine(model.eval(), tokenizer.eos_ids, tokenizer.pad_id)
        assert _greedy(engine, tokenizer) == [c.token_ids for c in native.generate(
            _prompts(tokenizer), SamplingParams(0.0, 24))]
        with ChildSender([spec_of(n, t) for n, t in engine.named_tensors().items()], 8 << 10) as sender:
            first, want = _checkpoint(tokenizer, tmp_path / "v1", 1, kv_heads=2)
            recv = sender.receiver(StreamSink(engine, engine.named_tensors()))
            assert sender.update(recv, first, 1)[1] is None
            assert _greedy(engine, tokenizer) == want and engine.weights_version == 1
            assert engine.stream_log == [(e, k) for k in range(len(sender.plan.buckets))
                                         for e in ("delivered", "taken")]
            second, other = _checkpoint(tokenizer, tmp_path / "v2", 2, kv_heads=2)
            _, error = sender.update(recv, second, 2, corrupt=len(sender.plan.buckets) // 2)
            assert error is not None and "checksum" in error
            assert _greedy(engine, tokenizer) == want != other and engine.weights_version == 1
            # as on GPUs (ipc_views): each rank maps the buffers and loads the bucket from views of them itself (on
            # GPUs each its own GPU's trainer rank's, and rank 1 verifies its copy's checksum); nothing else crosses
            engine.ipc_views = True
            assert engine.attach_ipc([sender.handles]) == [f"shm:{sender.handles[0][1]}"] * 2
            recv = sender.receiver(ViewSink(engine, engine.named_tensors()))
            assert sender.update(recv, second, 2)[1] is None
            assert _greedy(engine, tokenizer) == other and engine.weights_version == 2
    finally:
        engine.close()
