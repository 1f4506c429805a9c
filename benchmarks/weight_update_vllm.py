"""Weight update into vLLM through the checkpoint engine (``python -m benchmarks.weight_update --engine vllm``).

The replica is a ``VllmEngine`` (in this process) on a random-weight model saved as a Hugging Face
directory; a checkpoint-engine worker in a child process (``checkpoint_engine.child_sender``) sends each
update from another saved checkpoint through shared memory, bucket by bucket, and the engine streams the
buckets into one in-place ``reload_weights`` of vLLM as they arrive. ``update_s`` is the median over
``--repeats`` updates after a cold one, from the sender's first bucket to the last acknowledgement (vLLM
serves the new weights by then). ``floor_s`` is the copy floor of the same bytes, as the native
benchmark counts it for one worker: staged once into the IPC buffer, loaded once into the replica, at this
machine's single-stream memcpy bandwidth measured in the same run (half the copies before the updates,
half after). For scale the record also gives ``vllm_reload_s``, vLLM's own reload of weights already in
host memory (its fusing, oneDNN re-packing and copies, no transfer; median of ``--repeats``), and
``full_reload_update_s``, the update as it was done before streaming: every bucket into the host copy,
then one full reload at the end. ``same_tokens``: after the last update vLLM's greedy tokens equal the
native engine's on that checkpoint loaded from disk (exact in float32; other dtypes may differ by their
kernels' rounding).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.weight_update import copy_seconds
from checkpoint_engine.buckets import spec_of
from checkpoint_engine.child_sender import ChildSender
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.arch import ModelConfig
from engines.model.causal_lm import CausalLM
from engines.model.hf_io import load_pretrained, save_pretrained

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
        with ChildSender(specs, bucket_mb << 20) as sender:
            recv = sender.receiver(engine.named_tensors(), stream=engine)
            times, reloads = [], engine.reloads
            for v in range(1, repeats + 2):  # the checkpoints alternate, so every update changes every weight
                seconds, error = sender.update(recv, ckpts[v % 2], v)
                if error is not None:
                    raise RuntimeError(f"update {v} failed: {error}")
                times.append(seconds)
            streamed_reloads = engine.reloads - reloads
            final = ckpts[(repeats + 1) % 2]
            prompts = [[(7 * i + j) % cfg.vocab_size for j in range(5 + i)] for i in range(4)]
            greedy = SamplingParams(0.0, 24, ignore_eos=True)
            got = [c.token_ids for c in engine.generate(prompts, greedy)]
            native = InferenceEngine(load_pretrained(final, tdtype).eval(), None, 0)
            want = [c.token_ids for c in native.generate(prompts, greedy)]
            del native
            # before streaming: every bucket into the host copy, one full reload when the last one is in
            old = sender.receiver(engine.named_tensors(), on_commit=engine.swap_weights)
            full = [sender.update(old, ckpts[v % 2], v)[0] for v in range(repeats + 2, 2 * repeats + 2)]
            reload_times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.swap_weights(engine.served_weights())
                reload_times.append(time.perf_counter() - t0)
            reload_s = statistics.median(reload_times)
        one += copy_seconds(1, probe_bytes, floor_repeats // 2)
    passes = 2  # staged into the IPC buffer once, loaded into the replica once
    floors = sorted(passes * wire * t / probe_bytes for t in one)
    floor_s, update_s = statistics.median(floors), statistics.median(times[1:])
    return {"engine": "vllm", "model": model, "update_s": round(update_s, 6), "floor_s": round(floor_s, 6),
            "ratio": round(update_s / floor_s, 3), "floor_spread": round((floors[-1] - floors[0]) / floor_s, 3),
            "floor_passes": passes, "bytes": wire, "gb_per_s": round(wire / update_s / 1e9, 3),
            "copy_gb_per_s": round(probe_bytes / statistics.median(one) / 1e9, 3),
            "first_update_s": round(times[0], 4),
            "update_spread": round((max(times[1:]) - min(times[1:])) / update_s, 3),
            "vllm_reload_s": round(reload_s, 6), "vllm_reload_ratio": round(reload_s / floor_s, 3),
            "full_reload_update_s": round(statistics.median(full), 6),
            "reload_calls_per_update": streamed_reloads / (repeats + 1), "same_tokens": got == want,
            "buckets": len(sender.plan.buckets), "bucket_mb": bucket_mb, "dtype": dtype, "repeats": repeats,
            "torch_threads": torch.get_num_threads()}
