"""Memory per worker of a run, estimated before anything is allocated (``rl check-config``, ``rl train``).

Counts what the colocated worker holds: the trainer's shard (weights, gradients and optimizer state,
1/workers of each under FSDP2), the inference engine's full replica in the rollout dtype, and its
paged KV cache (``rollout.kv_cache_mb``, all of it, in blocks; how many sequences it holds depends
on their lengths, at worst ``max_seq_len`` tokens each).
Activations are not counted: they depend on ``algorithm.micro_batch`` and sequence lengths and are
freed between micro-batches. On a GPU the phases take turns (``trainer.offload`` moves the trainer to
host memory while the engine generates, ``rollout.sleep_level`` frees the cache, and at 2 the
replica, while the trainer steps), so the peak is the larger phase; on CPU everything shares RAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engines.arch import ModelConfig
from engines.kv_cache import BLOCK_SIZE, bytes_per_slot, bytes_per_token
from rl.config import Config
from rl.errors import UserError

GiB = 2**30


@dataclass
class MemoryEstimate:
    params: int
    trainer_weights: int
    trainer_grads: int
    optimizer: int
    replica: int
    kv_cache: int
    kv_sequences: int
    kv_per_sequence: int
    max_seq_len: int
    device_peak: int   # GPU: the larger of the rollout and the training phase
    host_total: int    # CPU: everything at once

    def table(self) -> str:
        rows = [("parameters", f"{self.params / 1e6:,.1f} M"),
                ("trainer weights (shard)", _gib(self.trainer_weights)),
                ("trainer gradients (shard)", _gib(self.trainer_grads)),
                ("optimizer state (shard)", _gib(self.optimizer)),
                ("inference replica", _gib(self.replica)),
                (f"KV cache ({self.kv_sequences} seqs x {self.max_seq_len} tokens)", _gib(self.kv_cache)),
                ("peak per worker, GPU phases", _gib(self.device_peak)),
                ("total per worker, CPU", _gib(self.host_total))]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v:>12}" for k, v in rows)


def _gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB"


def estimate(cfg: Config, arch: ModelConfig, max_seq_len: int) -> MemoryEstimate:
    """Bytes per worker of a run of ``cfg`` on a model of ``arch`` with KV caches of ``max_seq_len`` tokens."""
    from engines.model import build_model
    from rl.optim import muon_params

    model = build_model(arch, device="meta")  # shapes only: a 1 T-parameter config costs nothing here
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    muon = muon_params(model)
    n_muon = sum(p.numel() for p in params if id(p) in muon)
    workers = cfg.cluster.workers
    master = getattr(torch, cfg.model.dtype).itemsize
    # Muon keeps one momentum per element, AdamW two moments, both in the master dtype
    states = n_muon * 1 + (n - n_muon) * 2 if cfg.optimizer.kind == "muon" else n * 2
    shard = lambda b: -(-b // workers)  # noqa: E731
    weights, grads, opt = shard(n * master), shard(n * master), shard(states * master)
    replica = n * getattr(torch, cfg.rollout_dtype).itemsize
    rollout_dtype = getattr(torch, cfg.rollout_dtype)
    per_seq = bytes_per_slot(arch, max_seq_len, rollout_dtype)
    per_block = bytes_per_token(arch, rollout_dtype) * BLOCK_SIZE
    kv = (cfg.rollout.kv_cache_mb << 20) // per_block * per_block  # the engine takes the whole budget
    seqs = min(cfg.rollout.max_batch, kv // per_seq)  # sequences of the full max_seq_len it holds at least
    trainer = weights + grads + opt
    level = cfg.rollout.sleep_level
    rollout_phase = replica + kv + (0 if cfg.trainer.offload else trainer)
    train_phase = trainer + (replica if level < 2 else 0) + (kv if level == 0 else 0)
    return MemoryEstimate(n, weights, grads, opt, replica, kv, seqs, per_seq, max_seq_len,
                          max(rollout_phase, train_phase), trainer + replica + kv)


def estimate_run(cfg: Config) -> MemoryEstimate:
    """The estimate for ``cfg`` as ``rl train`` would start it: the model of ``model.path`` (or the warm
    start's architecture) and the KV length the run's prompts need (see ``rollout.max_seq_len``)."""
    from pathlib import Path

    from engines.arch import make_config
    from engines.hf_io import ModelDirError, read_config
    from engines.tokenizer import TextTokenizer
    from rl.data import load_task_sets, rollout_seq_len
    from rl.warmstart import cache_root, warmstart_key

    model_dir = cfg.model.path or cache_root() / f"warmstart-{warmstart_key(cfg)}"
    try:
        arch = read_config(model_dir)
    except ModelDirError as e:
        if cfg.model.path is not None:
            raise UserError(f"model.path: {e}") from None
        a = cfg.warmstart.architecture  # not built yet: its architecture, and the model's context as KV length
        arch = make_config(a.family, vocab_size=cfg.warmstart.vocab_size, bos_token_id=None, eos_token_id=None,
                           pad_token_id=None, **a.hf_kwargs())
        return estimate(cfg, arch, cfg.rollout.max_seq_len or arch.max_position_embeddings)
    seq = cfg.rollout.max_seq_len
    if seq is None and (Path(model_dir) / "tokenizer.json").is_file():
        tok = TextTokenizer.load(model_dir, cfg.model.chat_template)
        seq = rollout_seq_len(cfg, load_task_sets(cfg), tok, arch.max_position_embeddings)
    return estimate(cfg, arch, seq or arch.max_position_embeddings)


def available_per_worker(cfg: Config) -> tuple[int, str] | None:
    """(bytes, what) one worker may use on this machine, or None where it cannot be known (a remote cluster,
    GPU workers on a machine without one)."""
    if cfg.cluster.ray_address is not None:
        return None
    if cfg.cluster.gpus_per_worker > 0:
        if not torch.cuda.is_available():
            return None
        total = torch.cuda.get_device_properties(0).total_memory
        return int(total * cfg.cluster.gpus_per_worker), "GPU memory"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // cfg.cluster.workers, "RAM"


def check_fits(cfg: Config, est: MemoryEstimate) -> None:
    """Refuse a run that cannot fit, naming the setting to change."""
    if est.kv_sequences < 1:
        raise UserError(f"rollout.kv_cache_mb: {cfg.rollout.kv_cache_mb} MiB holds no sequence of "
                        f"{est.max_seq_len} tokens ({_gib(est.kv_per_sequence)} each); raise "
                        "rollout.kv_cache_mb or lower rollout.max_seq_len")
    have = available_per_worker(cfg)
    if have is None:
        return
    limit, what = have
    need = est.device_peak if cfg.cluster.gpus_per_worker > 0 else est.host_total
    if need <= limit:
        return
    parts = {"rollout.kv_cache_mb": est.kv_cache, "rollout.dtype": est.replica,
             "cluster.workers (shards the trainer)": est.trainer_weights + est.trainer_grads + est.optimizer}
    knob = max(parts, key=parts.get)
    raise UserError(f"a worker needs about {_gib(need)} but has {_gib(limit)} of {what}; the largest part is "
                    f"{_gib(parts[knob])} set by {knob} (activations come on top)")
