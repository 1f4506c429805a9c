"""Hugging Face-format model directories: ``config.json`` + ``model.safetensors`` + tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engines.model import CausalLM, ModelConfig
from engines.tokenizer import TextTokenizer


class ModelDirError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


def save_pretrained(model: CausalLM, tokenizer: TextTokenizer | None, directory: str | Path,
                    state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``) to ``directory`` in Hugging Face format; ``state`` replaces
    the model's own state dict (a sharded trainer passes its gathered full tensors)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    state = {k: v.detach().contiguous() for k, v in (state or model.state_dict()).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}, indent=2)
    )
    if tokenizer is not None:
        tokenizer.save(d)
    return d


def read_config(directory: str | Path) -> ModelConfig:
    """The model config of a Hugging Face directory, with a clear error when it is missing or bad."""
    d = Path(directory)
    if not d.is_dir():
        raise ModelDirError(f"model directory {d} does not exist")
    path = d / "config.json"
    if not path.is_file():
        raise ModelDirError(f"model directory {d} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{path} is not valid JSON: {e}") from None
    arch = raw.get("model_type")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ModelDirError(f"{path}: model_type {arch!r} is not supported (llama, qwen2, mistral)")
    if raw.get("attention_bias") or arch == "qwen2":
        raise ModelDirError(f"{path}: attention biases (Qwen2) are not supported yet")
    try:
        return ModelConfig.from_hf_dict(raw)
    except (TypeError, ValueError, KeyError) as e:
        raise ModelDirError(f"{path}: {e}") from None


def load_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's safetensors files (one file or a sharded index)."""
    d = Path(directory)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelDirError(f"model directory {d} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build a ``CausalLM`` from a Hugging Face directory; names and shapes must match exactly."""
    cfg = read_config(directory)
    model = CausalLM(cfg)
    state = load_state(directory)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelDirError(f"{directory}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ModelDirError(f"{directory}: {name} has shape {tuple(t.shape)}, config implies "
                                f"{tuple(expected[name].shape)}")
    model.load_state_dict(state)
    return model.to(dtype)
