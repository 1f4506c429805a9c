"""The embedded default model: tokenizer, a tiny model (Llama, Qwen3 or Kimi K2 layout), and an SFT warm start.

The result is an ordinary Hugging Face directory, cached under ``$RL_CACHE_DIR`` (default
``~/.cache/rl-colocated``) by a hash of its settings, so later runs reuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from filelock import FileLock
from rich.progress import Progress

from engines.model.io.hf_io import save_pretrained
from engines.model.io.sources import FetchError, cached_dir, fetch_model, parse_source
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import CausalLM, track_max_logits
from engines.model.text.tokenizer import train_tokenizer
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from rl.algo.update import sft_update
from rl.config import Config
from rl.errors import CommandFailed, UserError
from rl.rollout.data import SFT_SEED, task_maker
from rl.seeds import warmstart_seed
from rl.settings import model_arch

FORMAT_VERSION = 2  # bump when the warm-start recipe changes, to invalidate caches


def cache_root() -> Path:
    return Path(os.environ.get("RL_CACHE_DIR", Path.home() / ".cache" / "rl-colocated"))


def model_cache() -> Path:
    """Where model.path's hub repositories and buckets are downloaded: ``$RL_MODEL_CACHE``, else models/ in the
    cache root (``rl fetch-model --cache`` fills the same layout ahead of a run)."""
    return Path(os.environ.get("RL_MODEL_CACHE") or cache_root() / "models")


def model_dir_here(cfg: Config) -> Path | None:
    """model.path as a directory on this machine, without downloading: a local path as given (it may not exist), a
    hub repository's or bucket's complete copy in ``model_cache()``; None when that is not there yet (or no
    model.path)."""
    if cfg.model.path is None:
        return None
    src = parse_source(cfg.model.path)
    return cached_dir(src, model_cache()) if src.remote else Path(src.where)


def warmstart_key(cfg: Config) -> str:
    # the warm start learns the tasks of the first environment of a task mix
    _, kwargs, name = task_maker(cfg.env_entries[0])
    blob = json.dumps([FORMAT_VERSION, name, kwargs, cfg.warmstart.model_dump(mode="json"),
                       cfg.optimizer.qk_clip_tau] + (["chat"] if cfg.model.chat_template else []), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_model(cfg: Config, progress: Progress | None = None) -> Path:
    """The starting model directory: ``model.path`` if given (a remote one downloaded into ``model_cache()``), else
    the cached warm start."""
    if cfg.model.path is not None:
        src = parse_source(cfg.model.path)
        try:  # a hub repository or a bucket: downloaded here once (nothing when rl fetch-model or a run did it)
            log = (lambda line: progress.console.print(line, markup=False)) if progress else None
            path = fetch_model(src, model_cache(), log) if src.remote else Path(src.where)
        except FetchError as e:
            raise CommandFailed(f"model.path: {e}") from None
        model_arch(cfg, path)  # a model neither backend runs is one line (UserError), before anything starts
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"model.path: model directory {path} has no tokenizer.json")
        return path
    target = cache_root() / f"warmstart-{warmstart_key(cfg)}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):  # runs sharing the cache build it once
        if not (target / "config.json").is_file():
            build_warmstart(cfg, target, progress)
    return target


def build_vision(cfg: Config, tasks: list, env, target: Path, progress: Progress | None = None) -> None:
    """The warm start of an environment with images: rl.setup.vision_warmstart's tiny Qwen2-VL by SFT on ``tasks``
    (``warmstart.architecture`` sizes its language model, ``warmstart.vision`` its tower)."""
    from rl.setup.vision_warmstart import build_vision_warm_start, from_config

    try:
        spec = from_config(cfg.warmstart)
    except ValueError as e:  # the recipe's own check, before anything trains
        raise UserError(f"warmstart.architecture: {e}") from None
    bar = progress.add_task("warm start (vision SFT)", total=spec.steps) if progress else None

    def step(row: dict) -> None:
        if progress is not None:
            progress.update(bar, completed=row["step"], description=f"warm start (vision SFT) loss {row['loss']:.3f}")

    build_vision_warm_start(target, spec, env=env, tasks=tasks, log_every=1, progress=step)


def build_warmstart(cfg: Config, target: Path, progress: Progress | None = None) -> None:
    """Train the tokenizer and the tiny model with SFT on reference solutions; save atomically. The SFT
    optimizer is MuonClip with the run's ``optimizer.qk_clip_tau``, as in K2's pre-training, so the model
    RL starts from already keeps its attention logits within τ."""
    ws = cfg.warmstart
    maker, kwargs, name = task_maker(cfg.env_entries[0])
    try:
        tasks = maker.generate_tasks(ws.num_examples, SFT_SEED, **kwargs)
    except NotImplementedError:
        raise UserError(f"environment {name!r} cannot generate warm-start data; set model.path") from None
    if any("solution" not in t.meta for t in tasks[:1]):
        raise UserError(f"environment {name!r} gives no reference solutions; set model.path")
    if any(t.images for t in tasks):  # a task with images: a tiny vision-language model learns them
        build_vision(cfg, tasks, maker(**kwargs), target, progress)
        return
    # one seed for both: torch's and Python's generators are different algorithms, their draws do not correlate
    torch.manual_seed(warmstart_seed(ws.seed))
    rng = random.Random(warmstart_seed(ws.seed))
    tok = train_tokenizer((t.prompt + t.meta["solution"] for t in tasks), ws.vocab_size, ws.tokenizer)
    tok.chat_prompts = cfg.model.chat_template  # SFT on the prompts exactly as the run will render them
    a = ws.architecture
    arch = make_config(a.family, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                       bos_token_id=None, tie_word_embeddings=False, **a.hf_kwargs())
    model = CausalLM(arch)
    tau = cfg.optimizer.qk_clip_tau
    engine = TrainingEngine(model, build_optimizers(model, "muon", ws.lr, 0.0), tok.pad_id, qk_clip=tau is not None,
                            qk_clip_tau=tau)
    track_max_logits(model, tau is not None)
    prompts = [tok.prompt_ids(t) for t in tasks] if tok.chat_prompts else [tok.encode(t.prompt) for t in tasks]
    responses = [[*tok.encode(t.meta["solution"]), tok.eos_id] for t in tasks]
    bar = progress.add_task("warm start (SFT)", total=ws.steps) if progress else None
    for _ in range(ws.steps):
        idx = rng.sample(range(len(tasks)), min(ws.batch_size, len(tasks)))
        m = sft_update(engine, [prompts[i] for i in idx], [responses[i] for i in idx], ws.batch_size)
        if progress is not None:
            progress.update(bar, advance=1, description=f"warm start (SFT) loss {m['loss']:.3f}")
    track_max_logits(model, False)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tok, tmp)
    (tmp / "warmstart.json").write_text(json.dumps(ws.model_dump(mode="json"), indent=2))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
