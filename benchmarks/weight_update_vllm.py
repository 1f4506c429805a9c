"""Weight update into vLLM through the checkpoint engine (``python -m benchmarks.weight_update --engine vllm``).

The replica is a ``VllmEngine`` (in this process) on a random-weight model saved as a Hugging Face
directory; a checkpoint-engine worker in a child process (``benchmarks.harness.child_sender``) sends each
update from another saved checkpoint through shared memory, bucket by bucket, and the engine streams the
buckets into vLLM as they arrive. ``update_s`` is the median over ``--repeats`` updates after a cold one,
from the sender's first bucket to the last acknowledgement (vLLM serves the new weights by then), in the
way the engine picks for the model (``weight_load``: ``direct``, each bucket through the model's own
``load_weights`` into the live parameters, then vLLM's CPU kernels re-packed). ``floor_s`` is the copy
floor of the same bytes, as the native benchmark counts it for one worker: staged once into the IPC
buffer, loaded once into the replica, at this machine's single-stream memcpy bandwidth measured in the
same run (half the copies before the updates, half after). For scale the record also gives
``reload_update_s``, the same update through vLLM's layer-wise reload (every layer rebuilt and re-packed),
and ``vllm_reload_s``, that reload of weights already in host memory (no transfer). ``same_tokens``: after
the last update of each way vLLM's greedy tokens equal the native engine's on that checkpoint loaded from
disk (exact in float32; other dtypes may differ by their kernels' rounding).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.child_sender import ChildSender
from benchmarks.weight_update import copy_seconds
from checkpoint_engine.buckets import spec_of
from checkpoint_engine.sinks import StreamSink
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import load_pretrained, save_pretrained
from engines.model.native.arch import ModelConfig
from engines.model.native.causal_lm import CausalLM

#: replica architectures (head_dim 64: vLLM's CPU attention serves 32 and up)
MODELS = {
    "small": ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "100m": ModelConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024),
}


def _save(cfg: ModelConfig, seed: int, directory: Path, dtype: torch.dtype) -> Path:
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():  # larger than the init, so that greedy tokens depend on every weight
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    save_pretrained(model.to(dtype), None, directory)
    return directory


def measure_vllm(model: str = "100m", bucket_mb: int = 16, *, dtype: str = "float32", repeats: int = 3,
                 floor_repeats: int = 20, probe_bytes: int = 256 << 20) -> dict:
    """One benchmark point of the vLLM replica; returns the JSON record."""
    from engines.inference.vllm_engine import VllmEngine

    cfg, tdtype = MODELS[model], getattr(torch, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = [_save(cfg, seed, Path(tmp) / f"seed{seed}", tdtype) for seed in range(2)]
        engine = VllmEngine(ckpts[0], [], max_seq_len=256, max_num_seqs=8, dtype=dtype, kv_cache_bytes=64 << 20,
                            tokenizer=False, prefix_caching=False)
        one = copy_seconds(1, probe_bytes, floor_repeats // 2)
        specs = [spec_of(n, t) for n, t in engine.named_tensors().items()]
        wire = sum(s.nbytes for s in specs)
        prompts = [[(7 * i + j) % cfg.vocab_size for j in range(5 + i)] for i in range(4)]
        greedy = SamplingParams(0.0, 24, ignore_eos=True)

        def native_tokens(ckpt: Path) -> list[list[int]]:
            native = InferenceEngine(load_pretrained(ckpt, tdtype).eval(), None, 0)
            return [c.token_ids for c in native.generate(prompts, greedy)]

        chosen, times, same = engine.weight_load, {}, {}
        with ChildSender(specs, bucket_mb << 20) as sender:
            recv = sender.receiver(StreamSink(engine, engine.named_tensors()))
            version = 0
            for mode in dict.fromkeys((chosen, "direct", "reload")):
                engine.weight_load = mode
                reloads, seconds = engine.reloads, []
                for _ in range(repeats + 1):  # the checkpoints alternate, so every update changes every weight
                    version += 1
                    took, error = sender.update(recv, ckpts[version % 2], version)
                    if error is not None:
                        raise RuntimeError(f"update {version} ({mode}) failed: {error}")
                    seconds.append(took)
                if engine.reloads - reloads != repeats + 1:
                    raise RuntimeError(f"{mode}: {engine.reloads - reloads} loads for {repeats + 1} updates")
                got = [c.token_ids for c in engine.generate(prompts, greedy)]
                times[mode], same[mode] = seconds, got == native_tokens(ckpts[version % 2])
            engine.weight_load = "reload"
            reload_times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.swap_weights(engine.served_weights())
                reload_times.append(time.perf_counter() - t0)
            reload_s = statistics.median(reload_times)
            buckets = len(sender.plan.buckets)
        one += copy_seconds(1, probe_bytes, floor_repeats // 2)
    passes = 2  # staged into the IPC buffer once, loaded into the replica once
    floors = sorted(passes * wire * t / probe_bytes for t in one)
    floor_s = statistics.median(floors)
    update_s, reload_update_s = (statistics.median(times[m][1:]) for m in (chosen, "reload"))
    steady = times[chosen][1:]
    return {"engine": "vllm", "model": model, "weight_load": chosen, "update_s": round(update_s, 6),
            "floor_s": round(floor_s, 6), "ratio": round(update_s / floor_s, 3),
            "floor_spread": round((floors[-1] - floors[0]) / floor_s, 3), "floor_passes": passes, "bytes": wire,
            "gb_per_s": round(wire / update_s / 1e9, 3),
            "copy_gb_per_s": round(probe_bytes / statistics.median(one) / 1e9, 3),
            "first_update_s": round(times[chosen][0], 4),
            "update_spread": round((max(steady) - min(steady)) / update_s, 3),
            "reload_update_s": round(reload_update_s, 6), "reload_ratio": round(reload_update_s / floor_s, 3),
            "vllm_reload_s": round(reload_s, 6), "vllm_reload_ratio": round(reload_s / floor_s, 3),
            "same_tokens": all(same.values()), "same_tokens_by_load": same,
            "buckets": buckets, "bucket_mb": bucket_mb, "dtype": dtype, "repeats": repeats,
            "torch_threads": torch.get_num_threads()}
