"""Train–infer log-probability difference per dtype combination: which settings agree by construction.

    python -m benchmarks.logprob_consistency [--model-dir DIR] [--json]

The inference engine samples responses (recording each token's log-probability, as it does for π_old);
the trainer scores the same tokens. Reported per token over all sampled tokens: mean and max
|log π_trainer − log π_sampler|, for the trainer computing in float32 or bfloat16 (float32 master weights,
FSDP mixed precision as in a run) against an engine replica in float32 or bfloat16. The model is a
Hugging Face directory (``--model-dir``, e.g. the quick start's warm start) or a random demo-size model.
The last line printed with --json is one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.rollout import MODELS
from checkpoint_engine.topology import free_port
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import load_pretrained
from engines.model.native.causal_lm import CausalLM
from engines.training.distributed import init_distributed, shard_model
from engines.training.engine import TrainingEngine


def _model(model_dir: str | None, dtype: torch.dtype) -> CausalLM:
    if model_dir:
        return load_pretrained(model_dir, dtype)
    torch.manual_seed(0)
    model = CausalLM(MODELS["demo"])
    with torch.no_grad():  # weights well above the init scale, so that logits are far from uniform
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    return model.to(dtype)


def measure(model_dir: str | None = None, prompts: int = 32, samples: int = 4, max_tokens: int = 40,
            seed: int = 0) -> dict:
    init_distributed(0, 1, f"tcp://127.0.0.1:{free_port()}")
    g = torch.Generator().manual_seed(seed)
    vocab = _model(model_dir, torch.float32).config.vocab_size
    batch = torch.randint(2, vocab, (prompts, 24), generator=g).tolist()
    out = {}
    for rollout in ("float32", "bfloat16"):
        engine = InferenceEngine(_model(model_dir, getattr(torch, rollout)), eos_id=None, pad_id=0,
                                 max_seq_len=24 + max_tokens, kv_cache_bytes=1 << 28, seed=seed)
        done = engine.generate([p for p in batch for _ in range(samples)],
                               SamplingParams(1.0, max_tokens, ignore_eos=True))
        for compute in ("float32", "bfloat16"):
            model = _model(model_dir, torch.float32)
            if compute != "float32":
                model = shard_model(model, param_dtype=compute)
            trainer = TrainingEngine(model, [], pad_id=0)
            with torch.no_grad():
                lp, mask = trainer.response_logprobs([c.prompt_ids for c in done], [c.token_ids for c in done], 1.0)
            ours = lp[mask].double()
            theirs = torch.tensor([x for c in done for x in c.logprobs], dtype=torch.float64)
            diff = (ours - theirs).abs()
            out[f"trainer_{compute}_engine_{rollout}"] = {"mean": float(diff.mean()), "max": float(diff.max()),
                                                          "per_sequence_mean": float(diff.view(len(done), -1)
                                                                                     .sum(-1).mean())}
    torch.distributed.destroy_process_group()
    return {"model": model_dir or "random demo", "tokens": int(mask.sum()), **out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="a Hugging Face model directory (default: a random demo-size model)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rec = measure(args.model_dir)
    for k, v in rec.items():
        if isinstance(v, dict):
            print(f"{k:<36} mean {v['mean']:.2e}  max {v['max']:.2e}  per sequence {v['per_sequence_mean']:.2e}")
    if args.json:
        print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
