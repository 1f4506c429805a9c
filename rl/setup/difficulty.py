"""Prompt-set curation by difficulty (report 3.2.1): keep the prompts the current model solves sometimes.

Each training prompt is sampled ``k`` times with the current model (its task type's budget and starting
temperature); pass@k-style statistics come from the environment's rewards. Prompts solved always
are too easy to teach anything, prompts never solved give K1.5 no signal: only those with a pass
rate in ``[min_pass, max_pass]`` are kept, with their pass rate in ``meta.pass_rate``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from engines.inference.factory import EngineSettings, build_engine, decode_attention
from engines.inference.sampling import SamplingParams
from engines.model.text.tokenizer import TextTokenizer
from envs import Task
from envs.tasks import save_tasks
from rl.config import Config
from rl.errors import UserError
from rl.rollout.data import load_task_sets, type_name
from rl.rollout.episodes import EpisodeRunner, scored_alone, solved
from rl.seeds import difficulty_seed
from rl.settings import task_types
from rl.setup.warmstart import prepare_model


def pass_rates(cfg: Config, model_dir: Path, tasks: list[Task], entries: list, k: int, seed: int = 0,
               batch: int = 64) -> list[float]:
    """Fraction of ``k`` samples of each task whose reward is 1, with the model in ``model_dir``."""
    torch.manual_seed(difficulty_seed(seed, batch=-1))  # any random init while the model loads
    tok = TextTokenizer.load(model_dir, cfg.model.chat_template)
    r = cfg.rollout
    settings = EngineSettings(kind="native", model_dir=str(model_dir), device="cpu", dtype=cfg.rollout_dtype, fp8=False,
                              max_seq_len=None, max_num_seqs=r.max_batch, kv_cache_bytes=r.kv_cache_mb << 20,
                              max_batch_tokens=r.max_batch_tokens, attention=decode_attention(r.attention, "cpu"),
                              seed=seed)
    engine = build_engine(settings, load_checkpoint=True)
    runner, types = EpisodeRunner(cfg), task_types(cfg)
    rates = []
    try:
        for lo in range(0, len(tasks), batch):
            chunk = list(zip(tasks[lo:lo + batch], entries[lo:lo + batch], strict=True))
            prompts, params, jobs_meta = [], [], []
            for task, entry in chunk:
                kind = types.get(type_name(task, entry))
                ids = tok.prompt_ids(task)
                for _ in range(k):
                    prompts.append(ids)
                    params.append(SamplingParams(kind.temperature.at(0), kind.max_tokens))
                    jobs_meta.append((entry, task))
            outs = engine.generate(prompts, params, seed=difficulty_seed(seed, lo // batch))
            results = runner.map([(e, t, tok.decode(c.token_ids)) for (e, t), c in zip(jobs_meta, outs, strict=True)])
            for i in range(len(chunk)):
                group = zip(results[i * k:(i + 1) * k], outs[i * k:(i + 1) * k], strict=True)
                rates.append(sum(solved(r, c, cfg.run.eval_success) for r, c in group) / k)
    finally:
        runner.close()
    return rates


def filter_by_difficulty(cfg: Config, out: Path, k: int = 8, min_pass: float = 0.125, max_pass: float = 0.875,
                         limit: int | None = None, seed: int = 0) -> dict:
    """Write the run's training prompts with a pass rate in [min_pass, max_pass] to ``out`` (JSONL or Parquet)."""
    if not 0 <= min_pass <= max_pass <= 1:
        raise UserError(f"need 0 <= min_pass ({min_pass}) <= max_pass ({max_pass}) <= 1")
    sets = load_task_sets(cfg)
    idx = [i for i in range(len(sets.train)) if scored_alone(sets.train_entry(i))][:limit]
    tasks, entries = [sets.train[i] for i in idx], [sets.train_entry(i) for i in idx]
    rates = pass_rates(cfg, prepare_model(cfg), tasks, entries, k, seed)
    kept = [replace(t, meta={**t.meta, "pass_rate": r}) for t, r in zip(tasks, rates, strict=True)
            if min_pass <= r <= max_pass]
    save_tasks(kept, out)
    return {"prompts": len(tasks), "kept": len(kept), "too_easy": sum(r > max_pass for r in rates),
            "too_hard": sum(r < min_pass for r in rates), "k": k, "out": str(out)}
