"""Hugging Face-format model directories: ``config.json`` + safetensors (one file or sharded with an
index) + tokenizer files.

Loading builds the model on the meta device and then reads, tensor by tensor, only the bytes the
model's storage holds: a rank of an FSDP2-sharded trainer reads its own rows, never the whole
checkpoint. Saving writes a checkpoint's own tensor names (one tensor per expert), so
``transformers.AutoModelForCausalLM.from_pretrained`` loads the result unchanged.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engines.model.layout import Placement, hub_state, model_tensors, placements
from engines.model.native.arch import ModelConfig, UnsupportedModelError
from engines.model.native.causal_lm import CausalLM, build_model
from engines.model.native.fp8 import BLOCK, SCALE_SUFFIX, checkpoint_block, dequantize, to_fp8
from engines.model.sharded import local_rows

INDEX_FILE = "model.safetensors.index.json"
#: safetensors dtype names the loader reads; F8_E4M3 with ``*_scale_inv`` block scales is dequantised
#: for a model that holds the matrix in another dtype (``engines.model.native.fp8``)
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn}
DEFAULT_SHARD_BYTES = 5 * 2**30


class ModelDirError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


def read_tensors(directory: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory`` (or only ``names``), by name, as stored."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    want = None if names is None else set(names)
    for f in sorted(Path(directory).glob("*.safetensors")):
        if want is None:
            out.update(load_file(f))
            continue
        with safe_open(str(f), framework="pt") as sf:
            out.update({n: sf.get_tensor(n) for n in sf.keys() if n in want})
    return out


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
    try:
        return ModelConfig.from_hf_dict(raw)
    except UnsupportedModelError as e:
        raise ModelDirError(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ModelDirError(f"{path}: {type(e).__name__}: {e}") from None


def checkpoint_index(directory: str | Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Tensor name -> (file, shape, safetensors dtype), from the headers only (no tensor data is read)."""
    d = Path(directory)
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelDirError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
        files = sorted({d / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelDirError(f"{index} names {f.name}, which is not in {d}")
    else:
        files = sorted(d.glob("*.safetensors"))
        weight_map = {}
        if not files:
            raise ModelDirError(f"model directory {d} has no *.safetensors weights")
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if weight_map and weight_map.get(name) != f.name:
                        continue
                    s = fh.get_slice(name)
                    out[name] = (f, tuple(s.get_shape()), s.get_dtype())
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelDirError(f"{f}: not a readable safetensors file ({e})") from None
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise ModelDirError(f"{index} maps {missing[:3]} to files that do not hold them")
    return out


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Checkpoint tensors the model does not use: precomputed RoPE tables, a tied output head,
    DeepSeek's multi-token-prediction layers (beyond num_hidden_layers), FP8 block scales (read with
    their matrix)."""
    if name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight") or \
            name.endswith(SCALE_SUFFIX):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m and cfg.is_mla and int(m.group(1)) >= cfg.num_hidden_layers)


def load_weights(model: CausalLM, directory: str | Path) -> None:
    """Fill ``model``'s tensors (plain or FSDP2 shards) from the checkpoint in ``directory``, reading
    only the rows this process holds; every tensor's name and shape is checked against the config."""
    index = checkpoint_index(directory)
    place = placements(model)
    missing = [n for n in place if n not in index]
    if missing:
        raise ModelDirError(f"{directory}: missing tensors {missing[:5]} ({len(missing)} in all) that the "
                            f"config.json implies")
    unexpected = [n for n in index if n not in place and not _ignorable(n, model.config)]
    if unexpected:
        raise ModelDirError(f"{directory}: unexpected tensors {unexpected[:5]} ({len(unexpected)} in all) that "
                            f"the config.json does not imply")
    targets = model_tensors(model)
    block = checkpoint_block(model.config) or BLOCK
    for name, p in place.items():
        f, shape, dtype = index[name]
        if shape != p.shape:
            raise ModelDirError(f"{f}: tensor {name} has shape {shape}, the config implies {p.shape}")
        if dtype not in DTYPES:
            raise ModelDirError(f"{f}: tensor {name} has dtype {dtype}; readable: {', '.join(DTYPES)}")
        if dtype == "F8_E4M3" and targets[p.target].dtype != torch.float8_e4m3fn and name + SCALE_SUFFIX not in index:
            raise ModelDirError(f"{f}: FP8 tensor {name} has no {name + SCALE_SUFFIX} to dequantise it with")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in place:
        by_file[index[name][0]].append(name)
    with torch.no_grad():
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as fh:
                for name in names:
                    fp8 = index[name][2] == "F8_E4M3" and targets[place[name].target].dtype != torch.float8_e4m3fn
                    scales = _scales(index, name, block) if fp8 else None
                    _read_into(fh, name, place[name], targets[place[name].target], scales)


def _scales(index: dict, name: str, block: int):
    """(scale grid, block) of FP8 checkpoint tensor ``name``, read from whichever file holds it."""
    f = index[name + SCALE_SUFFIX][0]
    with safe_open(str(f), framework="pt") as fh:
        return fh.get_tensor(name + SCALE_SUFFIX).float(), block


def _read_into(fh, name: str, p: Placement, target: torch.Tensor, scales=None) -> None:
    """Copy the part of checkpoint tensor ``name`` that this rank's piece of ``target`` holds
    (``scales``: the FP8 tensor's block scales and block size, to dequantise it by)."""
    local, first_row = local_rows(target)
    row = target.numel() // target.shape[0] if target.ndim else 1
    lo, hi = first_row * row, first_row * row + local.numel()
    a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
    if a >= b:
        return
    hub_row = p.numel // p.shape[0] if p.shape else p.numel
    s, e = a - p.offset, b - p.offset
    if scales is not None:  # whole rows of blocks are dequantised, then the rows this rank holds are kept
        grid, block = scales
        last_row = -(-e // hub_row)
        r0, r1 = s // hub_row // block * block, min(p.shape[0], -(-last_row // block) * block)
        rows = dequantize(fh.get_slice(name)[r0:r1], grid[r0 // block:-(-r1 // block)], block)
        data = rows.reshape(-1)[s - r0 * hub_row:e - r0 * hub_row]
    elif s % hub_row == 0 and e % hub_row == 0 and p.shape:
        data = fh.get_slice(name)[s // hub_row:e // hub_row].reshape(-1)  # only these rows are read
    else:
        data = fh.get_tensor(name).reshape(-1)[s:e]
    local.view(-1)[a - lo:b - lo].copy_(data)


def load_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    fused: bool = False, fp8: bool = False) -> CausalLM:
    """Build a ``CausalLM`` from a Hugging Face directory on ``device``; names and shapes must match.
    ``fp8``: an FP8 replica (``engines.model.native.fp8.to_fp8``), taking an FP8 checkpoint's bytes as they are."""
    cfg = read_config(directory)
    model = build_model(cfg, device=device, dtype=dtype, fused=fused)
    block = checkpoint_block(cfg)
    if fp8 and block:
        to_fp8(model, block)
    load_weights(model, directory)
    if fp8 and not block:
        to_fp8(model)
    return model


def _write_transformers_config(model, source, d: Path, dtype: torch.dtype) -> None:
    """``config.json`` of a transformers model as transformers writes it (``source``: the config it was made from),
    with the dtype of the weights written beside it and its causal-LM class as the architecture."""
    import copy

    cfg = copy.deepcopy(source)
    cfg.dtype = dtype
    cfg.architectures = [type(model.hf_model).__name__]
    cfg.save_pretrained(str(d))


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def save_pretrained(model: nn.Module, tokenizer, directory: str | Path, state: dict[str, torch.Tensor] | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``model`` (and ``tokenizer``) to ``directory`` in Hugging Face format, in files of at most
    ``max_shard_bytes`` (more than one: with an index). ``state`` replaces the model's own tensors (a
    sharded trainer passes its gathered full tensors, by the model's names). A native ``CausalLM`` is written
    under its family's checkpoint names; a transformers model (``HFCausalLM``) as transformers' own
    ``save_pretrained`` writes it (its names and layout, its config), so ``AutoModelForCausalLM`` loads either."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for old in [*d.glob("*.safetensors"), d / INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous save's shards must not mix with this one's
    hub = hub_state(model, state)
    dtype = next(t.dtype for t in hub.values() if t.is_floating_point())
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in hub.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, names in zip(files, shards, strict=True):
        # clones: views of one stacked tensor share storage, which safetensors refuses to write
        save_file({n: hub[n].cpu().clone() for n in names}, str(d / fname), metadata={"format": "pt"})
        os.chmod(d / fname, 0o666 & ~_UMASK)  # safetensors writes 0600; the other files get the usual mode
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in hub.values())
        weight_map = {n: f for f, names in zip(files, shards, strict=True) for n in names}
        (d / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = model.config
    source = getattr(model, "source_config", None)  # a transformers model (engines.model.hf.backend) saves its own
    if source is not None:
        _write_transformers_config(model, source, d, dtype)
    else:
        (d / "config.json").write_text(json.dumps(cfg.to_hf_dict(dtype), indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (d / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2))
    if tokenizer is not None:
        tokenizer.save(d)
    return d
