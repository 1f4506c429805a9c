"""Does vLLM serve a vision-language family, and do its sampled log-probs agree with transformers' own forward?

Results (vLLM 0.32 CPU, transformers 5.19, float32; 8 tokens per prompt at temperature 1; about 7 min in all).
"prompt tokens": per prompt (text only / one image / two images), the processor's count, equal to vLLM's; "ids": the
ids are equal too; "diff": |log-prob vLLM − transformers| over the 24 sampled tokens; "causal max": against
transformers made causal; "logp": the sampled tokens' mean log-prob; "img effect": see below.

| family | HF, vLLM | gen | prompt tokens | ids | mean diff | max diff | causal max | logp | img effect | s | error |
|---|---|---|---|---|---|---|---|---|---|---|---|
| qwen2_vl | yes, yes | yes | 28/36/44 | yes | 8.64e-07 | 2.86e-06 | — | -5.54 | 1.76e+00 | 27 |  |
| qwen2_5_vl | yes, yes | yes | 28/36/44 | yes | 8.05e-07 | 5.25e-06 | — | -4.97 | 2.54e+00 | 29 |  |
| qwen3_vl | yes, yes | yes | 28/36/44 | yes | 7.15e-07 | 1.91e-06 | — | -5.42 | 2.43e+00 | 27 |  |
| qwen3_vl_moe | yes, yes | yes | 28/36/44 | yes | 6.46e-07 | 1.91e-06 | — | -5.33 | 1.89e+00 | 29 |  |
| smolvlm | yes, yes | yes | 31/64/98 | yes | 8.05e-07 | 2.86e-06 | — | -4.68 | 2.47e+00 | 27 |  |
| idefics3 | yes, yes | yes | 31/64/98 | yes | 8.05e-07 | 2.86e-06 | — | -4.68 | 2.47e+00 | 27 |  |
| gemma3 | yes, yes | yes | 26/33/40 | yes | 2.84e-02 | 1.22e-01 | 1.19e-06 | -3.95 | 7.60e-01 | 30 |  |
| llava | yes, yes | yes | 29/46/63 | yes | 6.66e-07 | 2.38e-06 | — | -5.31 | 1.32e+00 | 24 |  |
| llava_next | yes, yes | yes | 29/100/173 | yes | 5.17e-07 | 1.43e-06 | — | -5.17 | 4.03e-01 | 25 |  |
| paligemma | yes, yes | yes | 29 (1 img) | yes | 2.61e-01 | 5.54e-01 | 1.91e-06 | -6.21 | 1.81e+00 | 27 |  |
| internvl | yes, yes | yes | 28/51/66 | yes | 6.95e-07 | 1.43e-06 | — | -5.45 | 1.92e+00 | 24 |  |
| glm4v | yes, yes | yes | 17/25/33 | yes | 6.46e-07 | 1.67e-06 | — | -5.43 | 1.73e+00 | 29 |  |
| lfm2_vl | yes, yes | yes | 30/38/46 | yes | 1.24e-01 | 5.73e-01 | — | -5.01 | 4.49e-01 | 28 |  |
| mistral3 | yes, yes | yes | 14/22/31 | yes | 1.03e-06 | 4.77e-06 | — | -5.24 | 2.70e+00 | 28 |  |

* **11 families agree to float32 rounding** (max 5.3e-6) on text-only, one- and two-image prompts, with the same
  prompt ids in both: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, SmolVLM, Idefics3, LLaVA, LLaVA-NeXT, InternVL,
  GLM-4.1V, Mistral 3 (SmolVLM and Idefics3 are one architecture, built with the same seed and ids: same figures).
* **Gemma 3 and PaliGemma**: vLLM's CPU attention is causal everywhere. vLLM marks both "mm prefix LM" models
  (bidirectional attention over an image's tokens, Gemma 3; over images + prompt, PaliGemma), which only GPU
  backends implement (Triton, FlexAttention, FlashAttention 4: ``supports_mm_prefix``); the CPU platform picks its
  own backend without that check. transformers attends bidirectionally whenever ``token_type_ids`` come with the
  input. Against transformers made causal
  (``token_type_ids`` all 0 for Gemma 3, all 1 for PaliGemma) they agree to 1.9e-6.
* **LFM2-VL** loads and generates but disagrees by 0.12 on average, text-only prompts too: its LFM2 language model
  (short convolutions) disagrees on vLLM's CPU path as text-only LFM2 does (docs/models.md).
* vLLM's PaliGemma takes one image per prompt; transformers' PaliGemma processor takes no prompt without images.

Per family (``tests.vlm_families``): (a) transformers loads the saved directory with ``AutoModelForImageTextToText``
(every weight loaded as saved) and ``AutoProcessor`` and runs a forward on chat prompts: text only, one image, and
two images where the family takes two; (b) vLLM loads it in a child process (as ``tests.vllm_check``: vLLM patches
transformers' classes in the process that loads them) and samples 8 tokens per prompt at temperature 1 with
``logprobs=0``, a fixed seed and EOS ignored; (c) transformers' float32 forward over
``processor(text=prompt, images=...)`` with the sampled tokens appended gives the log-softmax of the sampled tokens,
compared with vLLM's. The processor's prompt token ids must equal vLLM's ``prompt_token_ids``. "image effect" is the
largest change of transformers' log-probs when it is given other images: the images matter, so agreement is not
the language model's alone. For families that attend bidirectionally over images or the prefix in transformers,
"max abs diff, causal" compares with transformers made causal (``VlmFamily.causal_token_type``).

``python -m tests.vlm_survey [family ...]`` prints one JSON line per family (stderr) and the table (stdout).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tests.vllm_check import one_line, serve_in_child
from tests.vlm_families import IMAGE_SIZES, VLM_FAMILIES, save_tiny_vlm

QUESTION = "Question: Mia has 3 apples. How many?"
MAX_TOKENS = 8
SEED = 1234


@dataclass
class VlmCheck:
    """One family's result over its prompts (text only, one image, two images; as the family allows)."""

    family: str
    hf_loads: bool = False
    vllm_loads: bool = False
    generates: bool = False
    images: list[int] = field(default_factory=list)  # per prompt, its number of images
    image_tokens_ok: bool | None = None  # the image tokens per image are VlmFamily.image_tokens' (first figure)
    prompt_tokens: list[int] = field(default_factory=list)  # per prompt, from the processor
    vllm_prompt_tokens: list[int] = field(default_factory=list)  # per prompt, vLLM's prompt_token_ids
    same_prompt_ids: bool | None = None
    tokens: int = 0
    mean_diff: float | None = None
    max_diff: float | None = None
    causal_mean_diff: float | None = None  # against transformers made causal (families with causal_token_type)
    causal_max_diff: float | None = None
    mean_logprob: float | None = None  # of the sampled tokens (uniform would be -log(vocab))
    image_effect: float | None = None  # max |Δ log-prob| when transformers gets other images
    error: str | None = None
    seconds: float = 0.0


def survey_images(seed: int = 0):
    """Deterministic random RGB images of ``IMAGE_SIZES`` (PIL)."""
    import numpy as np
    from PIL import Image

    return [Image.fromarray((np.random.RandomState(seed + i).rand(h, w, 3) * 255).astype("uint8"))
            for i, (w, h) in enumerate(IMAGE_SIZES)]


def chat_prompts(processor, family: str) -> list[tuple[str, int]]:
    """(prompt text, number of images): text only (where the family takes it), one image, two images (where the
    family takes them); images first, then the question."""
    fam = VLM_FAMILIES[family]
    out = []
    for n in range(0 if fam.text_only else 1, min(fam.max_images, 2) + 1):
        messages = [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": QUESTION}]}]
        out.append((processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), n))
    return out


def _serve(request: dict) -> dict:
    """In the child: start vLLM on the directory, sample ``MAX_TOKENS`` per prompt."""
    import vllm

    images = survey_images()
    try:
        llm = vllm.LLM(model=request["model_dir"], dtype="float32", max_model_len=512, max_num_seqs=4,
                       kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
                       limit_mm_per_prompt={"image": max(n for _, n in request["prompts"])},
                       **request["settings"])
    except Exception as e:  # any start-up failure is the finding
        return {"loads": False, "error": one_line(e)}
    try:
        inputs = [{"prompt": p, "multi_modal_data": {"image": images[0] if n == 1 else images[:n]}} if n else
                  {"prompt": p} for p, n in request["prompts"]]
        params = [vllm.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0, seed=SEED + i,
                                      ignore_eos=True) for i in range(len(inputs))]
        outs = llm.generate(inputs, params, use_tqdm=False)
    except Exception as e:
        return {"loads": True, "error": one_line(e)}
    result = {"loads": True, "prompt_ids": [], "tokens": [], "logprobs": []}
    for o in outs:
        c = o.outputs[0]
        result["prompt_ids"].append(list(o.prompt_token_ids))
        result["tokens"].append(list(c.token_ids))
        result["logprobs"].append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
    return result


def hf_inputs(processor, prompt: str, images, tokens: list[int], token_type: int = 0,
              all_token_type: int | None = None) -> tuple[dict, int]:
    """(the model's inputs for ``prompt`` + ``tokens``, the prompt's length): ``processor(text=, images=)`` with
    ``tokens`` appended to the per-token inputs (attention mask 1, token types ``token_type``; ``all_token_type``:
    token_type_ids of that value everywhere instead)."""
    enc = dict(processor(text=[prompt], images=images or None, return_tensors="pt"))
    enc.pop("labels", None)  # PaliGemma's processor makes them; no loss wanted
    ids, extra = enc["input_ids"], torch.tensor([tokens])
    for k, v in list(enc.items()):
        if k == "input_ids":
            enc[k] = torch.cat([v, extra], 1)
        elif torch.is_tensor(v) and v.shape == ids.shape:  # attention mask, (mm_)token_type_ids
            enc[k] = torch.cat([v, torch.full_like(extra, 1 if k == "attention_mask" else token_type)], 1)
    if all_token_type is not None:
        enc["token_type_ids"] = torch.full_like(enc["input_ids"], all_token_type)
    return enc, ids.shape[1]


def hf_logprobs(model, processor, prompt: str, images, tokens: list[int], token_type: int = 0,
                all_token_type: int | None = None) -> tuple[list[int], torch.Tensor]:
    """(the processor's prompt ids, transformers' float32 log-probs of ``tokens`` after the prompt), from one
    forward over ``hf_inputs``."""
    enc, n = hf_inputs(processor, prompt, images, tokens, token_type, all_token_type)
    with torch.no_grad():
        logits = model(**enc).logits[0, n - 1:-1].float()
    return enc["input_ids"][0, :n].tolist(), logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def check(family: str, model_dir: str | Path, timeout_s: float = 900) -> VlmCheck:
    """Survey one saved family (see the module docstring); failures are recorded, not raised."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    fam, out, start = VLM_FAMILIES[family], VlmCheck(family), time.monotonic()
    try:
        try:
            model, info = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                      output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            if bad:
                raise ValueError(f"weights not loaded as saved: {bad}")
            model.eval()
            processor = AutoProcessor.from_pretrained(model_dir)
            images = survey_images()
            prompts = chat_prompts(processor, family)
            for p, n in prompts:  # (a) transformers alone, before vLLM
                hf_logprobs(model, processor, p, images[:n], [0], fam.response_token_type)
            out.hf_loads, out.images = True, [n for _, n in prompts]
            image_id = next(i for i in (getattr(model.config, "image_token_id", None),
                                        getattr(model.config, "image_token_index", None)) if i is not None)
            one = next(p for p, n in prompts if n == 1)
            ids = processor(text=[one], images=images[:1], return_tensors="pt")["input_ids"][0].tolist()
            out.image_tokens_ok = ids.count(image_id) == fam.image_tokens[0][0]
        except Exception as e:
            out.error = f"transformers: {one_line(e)}"
            return out
        request = dict(model_dir=str(model_dir), prompts=prompts, settings=fam.vllm_settings)
        try:
            served = serve_in_child("tests.vlm_survey", request, timeout_s)
        except subprocess.TimeoutExpired:
            out.error = f"vLLM timed out after {timeout_s:.0f} s"
            return out
        if "died" in served:
            out.error = served["died"]
            return out
        out.vllm_loads, out.error = served["loads"], served.get("error")
        if "tokens" not in served:
            return out
        out.generates = all(len(t) == MAX_TOKENS for t in served["tokens"])
        others = survey_images(seed=100)
        diffs, causal, effects, sampled, same = [], [], [], [], True
        for (prompt, n), vids, toks, lps in zip(prompts, served["prompt_ids"], served["tokens"], served["logprobs"],
                                                strict=True):
            ids, ref = hf_logprobs(model, processor, prompt, images[:n], toks, fam.response_token_type)
            out.prompt_tokens.append(len(ids))
            out.vllm_prompt_tokens.append(len(vids))
            same = same and ids == vids
            diffs.append((torch.tensor(lps) - ref).abs())
            sampled += lps
            if fam.causal_token_type is not None:
                _, c = hf_logprobs(model, processor, prompt, images[:n], toks, all_token_type=fam.causal_token_type)
                causal.append((torch.tensor(lps) - c).abs())
            if n:
                _, o = hf_logprobs(model, processor, prompt, others[:n], toks, fam.response_token_type)
                effects.append(float((o - ref).abs().max()))
        diff = torch.cat(diffs)
        out.same_prompt_ids = same
        out.tokens, out.mean_diff, out.max_diff = diff.numel(), float(diff.mean()), float(diff.max())
        if causal:
            out.causal_mean_diff, out.causal_max_diff = float(torch.cat(causal).mean()), float(torch.cat(causal).max())
        out.mean_logprob, out.image_effect = sum(sampled) / len(sampled), max(effects)
        return out
    finally:
        out.seconds = round(time.monotonic() - start, 1)


def run_family(family: str) -> VlmCheck:
    """Save ``family``'s tiny model in a temporary directory and survey it."""
    with tempfile.TemporaryDirectory(prefix=f"vlm_survey_{family}_") as d:
        try:
            save_tiny_vlm(family, d)
        except Exception as e:
            return VlmCheck(family, error=f"save: {one_line(e)}")
        return check(family, d)


def table(results: list[VlmCheck]) -> str:
    """The survey as a Markdown table: prompt tokens per prompt (text only / one image / two images; "a≠b" where the
    processor's and vLLM's counts differ), log-prob differences, the sampled tokens' mean log-prob, image effect."""
    rows = ["| family | HF, vLLM | gen | prompt tokens | ids | mean diff | max diff | causal max | logp | img effect "
            "| s | error |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    yes = lambda b: "—" if b is None else ("yes" if b else "no")  # noqa: E731
    num = lambda x: "—" if x is None else f"{x:.2e}"  # noqa: E731
    for r in results:
        counts = "/".join(f"{a}" if a == b else f"{a}≠{b}"
                          for a, b in zip(r.prompt_tokens, r.vllm_prompt_tokens, strict=False)) or "—"
        if r.prompt_tokens and r.images != [0, 1, 2]:
            counts += f" ({'/'.join(map(str, r.images))} img)"
        logprob = "—" if r.mean_logprob is None else f"{r.mean_logprob:.2f}"
        error = r.error or ("image tokens per image differ from VlmFamily.image_tokens"
                            if r.image_tokens_ok is False else "")
        rows.append(f"| {r.family} | {yes(r.hf_loads)}, {yes(r.vllm_loads)} | {yes(r.generates)} | {counts} | "
                    f"{yes(r.same_prompt_ids)} | {num(r.mean_diff)} | {num(r.max_diff)} | {num(r.causal_max_diff)} | "
                    f"{logprob} | {num(r.image_effect)} | {r.seconds:.0f} | {error.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        print(json.dumps(_serve(json.loads(sys.stdin.read()))), flush=True)
    else:
        results = []
        for fam in sys.argv[1:] or list(VLM_FAMILIES):
            results.append(run_family(fam))
            print(json.dumps(asdict(results[-1])), file=sys.stderr, flush=True)
        print(table(results))
