"""Does vLLM serve a transformers family, and do its sampled log-probs agree with the transformers backend's recompute?

``save_tiny_model`` writes a tiny random model of a family (``tests.hf_families``) with ``save_pretrained`` and a
tokenizer. ``check_vllm_against_trainer`` starts the rollout engine on it (``engines.inference.vllm_engine
.VllmEngine``) in a child process, samples from it (seeded, EOS ignored), and scores the sampled tokens with
``engines.model.hf.backend``'s packed forward at the sampling temperature in this process: π_old against the
trainer's π. vLLM runs apart because for families it serves through its own Transformers backend (OLMo-2,
SmolLM3) it patches transformers' model classes in the process that loads them, which breaks transformers' own
loading afterwards (as it would a trainer in the same process; the rollout workers are other processes).

A test asserts on the ``VllmCheck`` it returns; ``python -m tests.vllm_check [family ...]`` runs the survey of
docs/models.md (one vLLM at a time), retrying a family with the settings its error asks for (prefix caching off
for hybrid models on CPU, bfloat16 where vLLM's CPU kernel takes nothing else).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tests.hf_families import FAMILIES, hf_config, sharpen

#: Arithmetic-task prompts, as the rollout tests use.
PROMPTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens and 2 more"]
#: An error of vLLM's start-up -> the engine setting that avoids it (the survey retries with it).
RETRIES = {
    "Chunked prefill is required for mamba cache mode": {"prefix_caching": False},
    "requires BF16": {"dtype": "bfloat16"},
}


@dataclass
class VllmCheck:
    """One family's result: whether vLLM loaded and generated, and |π_vLLM − π_trainer| over the sampled tokens."""

    family: str
    loads: bool = False
    generates: bool = False
    tokens: int = 0
    mean_diff: float | None = None
    max_diff: float | None = None
    error: str | None = None
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)  # VllmEngine arguments beyond the defaults


def project_tokenizer():
    """The tests' tokenizer (byte-level BPE trained on arithmetic tasks, as ``tests.conftest``)."""
    from engines.model.text.tokenizer import train_tokenizer
    from envs.arithmetic import ArithmeticEnv

    tasks = ArithmeticEnv.generate_tasks(500, seed=11)
    return train_tokenizer([t.prompt + t.meta["solution"] for t in tasks], vocab_size=400)


def save_tiny_model(family: str, directory: str | Path, tokenizer, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> Path:
    """A sharpened tiny random ``family`` model (vocabulary and special ids the tokenizer's) saved with
    ``save_pretrained`` in ``dtype``, with ``tokenizer`` beside it."""
    from transformers import AutoModelForCausalLM

    d = Path(directory)
    cfg = hf_config(family, vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id,
                    pad_token_id=tokenizer.pad_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = sharpen(AutoModelForCausalLM.from_config(cfg), seed=seed)
    model.to(dtype).save_pretrained(d)
    tokenizer.save(d)
    return d


def trainer_logprobs(model_dir: str | Path, prompts, responses, temperature: float) -> list[torch.Tensor]:
    """The transformers backend's float32 log-probs of ``responses`` at ``temperature`` (packed rows)."""
    from engines.model.hf.backend import load_hf_model
    from engines.training.packing import pack

    model = load_hf_model(model_dir)
    batch = pack(prompts, responses, 0, "sdpa")
    with torch.no_grad():
        lp, _ = model(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets,
                      inv_temp=1.0 / temperature)
    per = batch.per_sequence(lp)
    return [per[i, :len(r)] for i, r in enumerate(responses)]


def _serve(request: dict) -> dict:
    """In the child: start VllmEngine, sample, return tokens and log-probs (or the error)."""
    from engines.inference.sampling import SamplingParams
    from engines.inference.vllm_engine import VllmEngine

    try:
        engine = VllmEngine(request["model_dir"], request["eos_ids"], max_seq_len=128, max_num_seqs=8,
                            kv_cache_bytes=64 << 20, **{"dtype": "float32", **request["settings"]})
    except Exception as e:  # any start-up failure is the finding
        return {"loads": False, "error": one_line(e)}
    try:
        params = [SamplingParams(request["temperature"], request["max_tokens"], seed=100 + i, ignore_eos=True)
                  for i in range(len(request["prompts"]))]
        got = engine.generate(request["prompts"], params)
    except Exception as e:
        return {"loads": True, "error": one_line(e)}
    return {"loads": True, "tokens": [list(c.token_ids) for c in got], "logprobs": [list(c.logprobs) for c in got]}


def check_vllm_against_trainer(family: str, model_dir: str | Path, prompts: list[list[int]], eos_ids: list[int],
                               temperature: float = 0.7, max_tokens: int = 16, settings: dict | None = None,
                               timeout_s: float = 600) -> VllmCheck:
    """vLLM (``VllmEngine`` with ``settings``, in a child process) samples ``max_tokens`` per prompt; the result
    holds whether it loaded and generated and the log-prob differences to the trainer's recompute. Failures are
    recorded in the result, not raised."""
    out, start = VllmCheck(family, settings=dict(settings or {})), time.monotonic()
    request = dict(model_dir=str(model_dir), eos_ids=list(eos_ids), prompts=prompts, temperature=temperature,
                   max_tokens=max_tokens, settings=out.settings)
    try:
        served = serve_in_child("tests.vllm_check", request, timeout_s)
        if "died" in served:
            out.error = served["died"]
            return out
        out.loads, out.error = served["loads"], served.get("error")
        if "tokens" not in served:
            return out
        out.generates = all(len(t) == max_tokens for t in served["tokens"])
        ref = trainer_logprobs(model_dir, prompts, served["tokens"], temperature)
        diff = torch.cat([(torch.tensor(lp) - r).abs() for lp, r in zip(served["logprobs"], ref, strict=True)])
        out.tokens, out.mean_diff, out.max_diff = diff.numel(), float(diff.mean()), float(diff.max())
        return out
    except subprocess.TimeoutExpired:
        out.error = f"timed out after {timeout_s:.0f} s"
        return out
    finally:
        out.seconds = round(time.monotonic() - start, 1)


def serve_in_child(module: str, request: dict, timeout_s: float) -> dict:
    """``python -m MODULE --serve`` in a child process (vLLM apart from this one, niced), ``request`` as JSON on its
    stdin; returns the last JSON object it printed, or ``{"died": reason}`` when it printed none. Raises
    ``subprocess.TimeoutExpired`` after ``timeout_s``."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    p = subprocess.run(["nice", "-n", "10", sys.executable, "-m", module, "--serve"], input=json.dumps(request),
                       capture_output=True, text=True, timeout=timeout_s, env=env)
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if line is None:
        tail = [ln for ln in p.stderr.strip().splitlines() if "Error" in ln][-1:] or [f"exit {p.returncode}"]
        return {"died": f"vLLM's process died: {tail[0].strip()[:300]}"}
    return json.loads(line)


def one_line(e: BaseException) -> str:
    """The error in one line: its type and first lines (pydantic puts the reason on the second)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return f"{type(e).__name__}: {' / '.join(lines[:2])}"[:300]


def run_family(family: str, tokenizer=None, settings: dict | None = None) -> VllmCheck:
    """Save ``family``'s tiny model and check it (``settings``: VllmEngine arguments to start with), retrying with
    the settings ``RETRIES`` names for its error."""
    tok = tokenizer or project_tokenizer()
    settings = dict(settings or {})
    while True:
        dtype = torch.bfloat16 if settings.get("dtype") == "bfloat16" else torch.float32
        with tempfile.TemporaryDirectory(prefix=f"vllm_check_{family}_") as d:
            save_tiny_model(family, d, tok, dtype=dtype)
            result = check_vllm_against_trainer(family, d, [tok.encode(p) for p in PROMPTS], tok.eos_ids,
                                                settings=settings)
        extra = next((fix for msg, fix in RETRIES.items() if msg in (result.error or "")), None)
        if extra is None or all(settings.get(k) == v for k, v in extra.items()):
            return result
        settings = {**settings, **extra}


def table(results: list[VllmCheck]) -> str:
    """The survey as a Markdown table."""
    rows = ["| family | loads | generates | settings | tokens | mean abs diff | max abs diff | error |",
            "|---|---|---|---|---|---|---|---|"]
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    num = lambda x: "—" if x is None else f"{x:.2e}"  # noqa: E731
    for r in results:
        settings = ", ".join(f"{k}={v}" for k, v in r.settings.items()) or "defaults"
        rows.append(f"| {r.family} | {yes(r.loads)} | {yes(r.generates)} | {settings} | {r.tokens} | "
                    f"{num(r.mean_diff)} | {num(r.max_diff)} | {(r.error or '').replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        print(json.dumps(_serve(json.loads(sys.stdin.read()))), flush=True)
    else:
        tok = project_tokenizer()
        results = []
        for fam in sys.argv[1:] or list(FAMILIES):
            results.append(run_family(fam, tok))
            print(json.dumps(asdict(results[-1])), file=sys.stderr, flush=True)
        print(table(results))
