"""Warm starts of families the native code lacks, for the transfer suite: a transformers model of that family,
trained here by the transformers backend (``engines.model.hf.backend``) with supervised learning on a task's
reference solutions, saved as transformers' ``save_pretrained`` writes it, with a tokenizer in the family's
conventions (its end-of-turn EOS, pad and chat template).

The embedded warm start (``rl.setup.warmstart``) builds the native families only (``warmstart.architecture.family``);
a run of one of these models names the saved directory in ``model.path``, as a user's own model would be named.
Cached under ``rl.setup.warmstart.cache_root()`` by a hash of the settings.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import torch

from engines.model.hf.backend import build_hf_model
from engines.model.io.hf_io import save_pretrained
from engines.model.text.family_tokens import TokenStyle
from engines.model.text.tokenizer import train_tokenizer
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from rl.algo.update import sft_update
from rl.config import Config
from rl.rollout.data import SFT_SEED, task_maker
from rl.seeds import warmstart_seed
from rl.setup.warmstart import cache_root

FORMAT_VERSION = 1  # bump when the recipe changes, to invalidate caches

# Gemma 3's turns: <start_of_turn>user ... <end_of_turn>, the assistant's role named "model", a BOS first; its
# generation stops at <end_of_turn> (the EOS here, as the project takes each family's end of turn)
GEMMA_TEMPLATE = (
    "<bos>{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

#: tokenizer conventions of the families here (the native families' are engines.model.text.family_tokens.STYLES)
STYLES: dict[str, TokenStyle] = {
    "gemma": TokenStyle("<end_of_turn>", "<pad>", ("<bos>", "<eos>", "<start_of_turn>"), GEMMA_TEMPLATE),
}

#: model_type -> transformers config arguments of the small model (vocabulary and special ids apart); head_dim 32,
#: the least vLLM's CPU attention has kernels for
ARCHITECTURES: dict[str, dict] = {
    # Gemma 3's local/global layers (a local window shorter than a prompt with its answer), q/k norms, norms around
    # each sub-layer, scaled embeddings
    "gemma3_text": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256,
                        sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2,
                        tie_word_embeddings=False),
}


def hf_warmstart(cfg: Config, model_type: str, style: str, steps: int, log=print, threads: int | None = None) -> Path:
    """The directory of a ``model_type`` model SFT-trained ``steps`` steps on the tasks of ``cfg``'s first
    environment (with ``cfg.warmstart``'s batch size, learning rate, examples, vocabulary and seed), prompts rendered
    through ``style``'s chat template; built once, then read from the cache. ``threads``: torch's threads while
    training (None: as set; on a shared machine one thread avoids OpenMP threads spinning against other processes')."""
    ws = cfg.warmstart
    _, kwargs, name = task_maker(cfg.env_entries[0])
    blob = json.dumps([FORMAT_VERSION, model_type, style, steps, name, kwargs, ws.model_dump(mode="json"),
                       ARCHITECTURES[model_type]], sort_keys=True)
    target = cache_root() / f"hf-warmstart-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        _build(cfg, model_type, style, steps, target, log)
    finally:
        torch.set_num_threads(before)
    return target


def _build(cfg: Config, model_type: str, style: str, steps: int, target: Path, log) -> None:
    """Train and save the warm start (``hf_warmstart``) into ``target``, atomically."""
    from transformers import CONFIG_MAPPING

    ws = cfg.warmstart
    maker, kwargs, _ = task_maker(cfg.env_entries[0])
    tasks = maker.generate_tasks(ws.num_examples, SFT_SEED, **kwargs)
    torch.manual_seed(warmstart_seed(ws.seed))
    rng = random.Random(warmstart_seed(ws.seed))
    tok = train_tokenizer((t.prompt + t.meta["solution"] for t in tasks), ws.vocab_size, STYLES[style])
    tok.chat_prompts = True  # SFT on the prompts exactly as the run renders them (model.chat_template: true)
    bos = tok.hf.convert_tokens_to_ids("<bos>")
    hf_cfg = CONFIG_MAPPING[model_type](vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                                        bos_token_id=bos, **ARCHITECTURES[model_type])
    model = build_hf_model(hf_cfg)
    # no QK-Clip: Gemma 3 normalises queries and keys after the projections, so clipping them does not bound logits
    engine = TrainingEngine(model, build_optimizers(model, "muon", ws.lr, 0.0), tok.pad_id)
    prompts = [tok.prompt_ids(t) for t in tasks]
    responses = [[*tok.encode(t.meta["solution"]), tok.eos_id] for t in tasks]
    for step in range(steps):
        idx = rng.sample(range(len(tasks)), min(ws.batch_size, len(tasks)))
        m = sft_update(engine, [prompts[i] for i in idx], [responses[i] for i in idx], ws.batch_size)
        if step % 50 == 0 or step == steps - 1:
            log(f"{model_type} warm start step {step}: loss {m['loss']:.3f}")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tok, tmp)
    (tmp / "warmstart.json").write_text(json.dumps({"model_type": model_type, "style": style, "steps": steps,
                                                    **ws.model_dump(mode="json")}, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
