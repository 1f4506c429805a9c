"""A LoRA weight update against a full one on the same model, at the native replica (``--lora RANK`` of
``benchmarks.weight_update``).

    python -m benchmarks.weight_update --lora 8 --lora-model 100m --json

One process builds a trainer model of ``benchmarks.rollout.MODELS`` (float32, random weights) with LoRA adapters of
``RANK`` on the default targets (B drawn nonzero, as after training), and a native inference engine holding the base
in ``--dtype``. A full update hands the replica every checkpoint tensor in its dtype
(``InferenceEngine.load_weights``); a LoRA update hands it the adapters alone, cast to the replica's dtype as a run
sends them, which it merges from its copy of the base (``InferenceEngine.merge_adapters``); a second replica takes
them unmerged (``load_adapter_deltas``: low-rank deltas beside the base, ``engines.model.lora.delta``).
``full_bytes`` and ``lora_bytes`` are what each update moves into the replica, ``full_s`` and ``lora_s`` the median
seconds of ``--repeats`` updates each (interleaved, after one cold update of each), ``unmerged_s`` the unmerged
replica's update and ``unmerged_speedup`` the full update's seconds over it, ``unmerged_same_tokens`` whether it
samples the merged replica's greedy tokens and ``unmerged_logprob_max_diff`` how far their log-probs are (rounding:
the two add the adapters at different points), ``base_copy_bytes`` the memory merge-on-receipt holds.
``bitwise_equal``: the replica's weights after the last LoRA update equal the merged weights computed independently
(``engines.model.lora.adapters.merged_state``). The transport between processes (the checkpoint engine's buckets)
is not part of this measure: it carries ``full_bytes`` or ``lora_bytes``, as counted here.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.rollout import MODELS
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.layout import hub_state
from engines.model.lora.adapters import LoraSpec, adapter_state, apply_lora, default_targets, merged_state
from engines.model.native.causal_lm import build_model


def measure_lora(model: str, rank: int, dtype: str = "bfloat16", repeats: int = 5) -> dict:
    """One full-against-LoRA record (see the module)."""
    cfg = MODELS[model]
    torch.manual_seed(0)
    trainer = build_model(cfg, init=True)
    spec = LoraSpec(rank, 2.0 * rank, target_modules=default_targets(cfg))
    apply_lora(trainer, spec, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.01)
    serving = getattr(torch, dtype)
    full = {n: t.to(serving) for n, t in hub_state(trainer).items() if ".lora_" not in n}
    adapters = {n: t.to(serving) for n, t in adapter_state(trainer).items()}  # as a run's updates carry them
    engine = InferenceEngine(build_model(cfg, dtype=serving, fused=True), eos_id=None, max_seq_len=64,
                             kv_cache_bytes=1 << 20)
    unmerged = InferenceEngine(build_model(cfg, dtype=serving, fused=True), eos_id=None, max_seq_len=64,
                               kv_cache_bytes=1 << 20)
    unmerged.load_weights(full.items())
    full_s, lora_s, delta_s = [], [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        engine.load_weights(full.items())  # also resets the merge's base copy: the next merge takes it again
        t1 = time.perf_counter()
        engine.merge_adapters(adapters, spec.scaling)  # the first merge after a load copies the base
        t2 = time.perf_counter()
        engine.merge_adapters(adapters, spec.scaling)  # a steady-state update
        t3 = time.perf_counter()
        unmerged.load_adapter_deltas(adapters, spec.scaling)  # the first one adds the deltas to the layers
        t4 = time.perf_counter()
        if i:  # the first round is cold
            full_s.append(t1 - t0)
            lora_s.append(t3 - t2)
            delta_s.append(t4 - t3)
    # the unmerged replica samples what the merged one does (its own rounding: B·(A·x) apart from W·x): the same
    # greedy tokens from the same prompts, their log-probs to that rounding
    prompts = torch.randint(2, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = [SamplingParams(0.0, 16, seed=i, ignore_eos=True) for i in range(len(prompts))]
    merged_out, delta_out = (e.generate(prompts, greedy) for e in (engine, unmerged))
    same_tokens = all(a.token_ids == b.token_ids for a, b in zip(merged_out, delta_out, strict=True))
    lp_diff = max(abs(x - y) for a, b in zip(merged_out, delta_out, strict=True)
                  for x, y in zip(a.logprobs, b.logprobs, strict=False))
    reference = merged_state({**{n: t.to(serving) for n, t in hub_state(trainer).items() if ".lora_" not in n},
                              **adapters}, spec.scaling)
    served = engine.served_weights()
    equal = all(torch.equal(served[n], t) for n, t in reference.items())
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    lora_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    f, lo, de = statistics.median(full_s), statistics.median(lora_s), statistics.median(delta_s)
    return {"model": model, "params": sum(t.numel() for t in full.values()), "rank": rank, "dtype": dtype,
            "targets": list(spec.target_modules), "full_bytes": full_bytes, "lora_bytes": lora_bytes,
            "bytes_ratio": round(lora_bytes / full_bytes, 6), "full_s": round(f, 6), "lora_s": round(lo, 6),
            "speedup": round(f / lo, 3), "base_copy_bytes": engine.adapter_base_bytes, "bitwise_equal": equal,
            "unmerged_s": round(de, 6), "unmerged_speedup": round(f / de, 3),
            "unmerged_delta_bytes": unmerged._delta.nbytes,
            "unmerged_same_tokens": same_tokens, "unmerged_logprob_max_diff": round(float(lp_diff), 6),
            "repeats": repeats, "threads": torch.get_num_threads()}
