"""A colocated RL smoke without Ray: a trainer and the native inference engine in two processes on one device,
joined by the checkpoint engine's IPC buffers (CUDA IPC on a GPU, POSIX shared memory on a CPU).

    python -m benchmarks.colocated_smoke --device cuda --model qwen3-0.6b --json   # on a GPU (gpu_check's step)
    python -m benchmarks.colocated_smoke --device cpu --model demo --json          # the same phases on a CPU

This process holds the inference engine and its ``WeightReceiver``; a spawned child holds the trainer (a
``TrainingEngine`` with float32 master weights and AdamW) and the checkpoint engine, as a rollout worker and a
trainer rank share a GPU in a run. Phases, each timed, with the device's peak memory in each process:

    fill     the trainer sends its masters (cast to the replica's dtype) into the empty replica (update 1)
    generate the engine samples responses
    sleep    the engine frees its KV cache (and at level 2 its weights)
    step     the trainer onloads, takes one policy-gradient step on the sampled responses, offloads
    wake     the engine takes back its weights (level 2: the KV cache after the update, the two-step wake)
    update   the new masters reach the replica (update 2)
    generate again, with the new weights

The record says whether every replica tensor equals the trainer's master cast to the replica's dtype, bitwise,
after each update (``replica_equals_cast_master``), and that the step changed the weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time

import torch

from benchmarks.harness.ranks import PipeReloader, answer_load, stop_child
from benchmarks.timing import say
from checkpoint_engine.buckets import plan_buckets, spec_of
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.sinks import whole_sink
from checkpoint_engine.topology import free_port
from checkpoint_engine.transfer import WeightReceiver
from engines.device import peak_memory_bytes, reset_peak_memory
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.layout import model_tensors
from engines.model.native.arch import ModelConfig
from engines.model.native.causal_lm import CausalLM
from engines.training.engine import TrainingEngine

BUCKET_BYTES = 64 << 20


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha1(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


def _trainer_main(conn, cfg: ModelConfig, device: str, dtype: str, init: str, name: str, seed: int) -> None:
    """The trainer's process: masters, optimizer, checkpoint engine; answers ("step" | "update") orders, offloaded
    to host memory between them on a GPU."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    model = CausalLM(cfg).to(dev)
    train = TrainingEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], pad_id=0)
    replica_dtype = getattr(torch, dtype)
    # each storage once, as the engine lists its tensors: a tied output head is the embedding
    specs = [spec_of(n, torch.empty(0, dtype=replica_dtype).new_empty(t.shape))
             for n, t in model_tensors(model).items()]
    plan = plan_buckets(specs, BUCKET_BYTES)
    ckpt = CheckpointEngine(0, 1, init, BUCKET_BYTES, name, device=device)
    offload = dev.type == "cuda"  # on a CPU both share RAM, and the run's trainer stays put there too
    conn.send(("ready", plan, ckpt.ipc_handles()))
    try:
        while (msg := conn.recv())[0] != "stop":
            reset_peak_memory(dev)
            t0 = time.perf_counter()
            if msg[0] == "step":  # one policy-gradient step: raise the log-probability of the sampled responses
                _, prompts, responses, rewards = msg
                if train.offloaded:
                    train.onload()
                s = train.score(prompts, responses, 1.0)
                adv = torch.tensor(rewards, dtype=torch.float32, device=dev)[:, None]
                loss = -(s.logprobs * s.mask * adv).sum() / s.mask.sum()
                loss.backward()
                loss = loss.detach()
                norm = train.step()
                if offload:
                    train.offload()
                conn.send(("stepped", time.perf_counter() - t0, peak_memory_bytes(dev), loss.item(), norm))
            else:  # "fill" or "update": the masters (onloaded for the send) into the replica
                _, version = msg
                if train.offloaded:
                    train.onload()
                masters = {n: t.detach() for n, t in model_tensors(model).items()}
                ckpt.update(plan, masters, version, PipeReloader(conn))
                if offload:
                    train.offload()
                elapsed, peak = time.perf_counter() - t0, peak_memory_bytes(dev)
                # the check, outside the timing: hashing every tensor on the host took 1.9 s of the first GPU run's
                # "update" (0.6 B shape, 2026-11-28 lease)
                if train.offloaded:
                    train.onload()
                cast = _digests({n: t.to(replica_dtype) for n, t in model_tensors(model).items()})
                if offload:
                    train.offload()
                conn.send(("sent", elapsed, peak, cast))
    finally:
        ckpt.close()


class _Trainer:
    """The trainer's process, seen from the engine's."""

    def __init__(self, cfg: ModelConfig, device: str, dtype: str, seed: int, timeout_s: float) -> None:
        self.name, self.timeout_s = f"smoke-{os.getpid()}-{free_port()}", timeout_s
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_trainer_main, daemon=True, args=(
            child, cfg, device, dtype, f"tcp://127.0.0.1:{free_port()}", self.name, seed))
        self.proc.start()
        _, self.plan, self.handles = self.recv("ready")

    def recv(self, kind: str) -> tuple:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the trainer process said nothing for {self.timeout_s} s")
        msg = self.conn.recv()
        if msg[0] != kind:
            raise RuntimeError(f"trainer process: expected {kind!r}, got {msg[:2]!r}")
        return msg

    def send_weights(self, receiver: WeightReceiver, version: int) -> tuple:
        """Update ``version`` into ``receiver``: (trainer seconds, trainer peak bytes, cast masters' digests)."""
        self.conn.send(("update", version))
        while True:
            if not self.conn.poll(self.timeout_s):
                raise TimeoutError(f"update {version}: the trainer process said nothing for {self.timeout_s} s")
            msg = self.conn.recv()
            if msg[0] == "load":
                answer_load(receiver, self.conn, msg)
            elif msg[0] == "abort":
                self.conn.send(("aborted", receiver.rollback()))
            elif msg[0] == "sent":
                return msg[1:]
            else:
                raise RuntimeError(f"trainer process: {msg[:2]!r}")

    def close(self) -> None:
        stop_child(self.conn, self.proc, self.name)


def run(model_name: str | ModelConfig = "demo", device: str = "cpu", dtype: str = "float32", sleep_level: int = 2,
        prompts: int = 8, samples: int = 2, max_tokens: int = 32, seed: int = 0, timeout_s: float = 100) -> dict:
    """The smoke's record (see the module)."""
    from benchmarks.rollout import MODELS

    cfg = MODELS[model_name] if isinstance(model_name, str) else model_name
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:  # set_device and the trainer's IPC handles need the ordinal
            dev = torch.device("cuda", torch.cuda.current_device())
            device = str(dev)
        torch.cuda.set_device(dev)
    phases: dict[str, float] = {}
    peaks: dict[str, int] = {}

    def timed(phase: str, fn, *args):
        reset_peak_memory(dev)
        t0 = time.perf_counter()
        out = fn(*args)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        phases[phase] = round(phases.get(phase, 0.0) + time.perf_counter() - t0, 3)
        peaks[phase] = max(peaks.get(phase, 0), peak_memory_bytes(dev))
        say("colocated_smoke", f"{phase}: {time.perf_counter() - t0:.3f} s")  # a run cut at its limit shows where
        # (fill and update: wall time with the bitwise check; the record keeps the trainer's seconds without it)
        return out

    trainer = _Trainer(cfg, device, dtype, seed, timeout_s)
    say("colocated_smoke", "trainer process ready")
    try:
        replica = CausalLM(cfg).to(dev, getattr(torch, dtype))  # its values are the trainer's after the fill
        engine = InferenceEngine(replica, eos_id=None, pad_id=0, max_seq_len=64 + max_tokens,
                                 kv_cache_bytes=64 << 20, max_num_seqs=prompts * samples,
                                 cuda_graphs=dev.type == "cuda")
        receiver = WeightReceiver(trainer.plan, trainer.handles, whole_sink(engine))
        say("colocated_smoke", "engine and receiver ready")
        equal = []
        fill_s, _, cast = timed("fill", trainer.send_weights, receiver, 1)
        phases["fill"] = round(fill_s, 3)  # the trainer's seconds: onload, send, offload (not the check)
        equal.append(_digests(model_tensors(replica)) == cast)
        g = torch.Generator().manual_seed(seed)
        batch = [torch.randint(2, cfg.vocab_size, (int(torch.randint(4, 32, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(prompts) for _ in range(samples)]
        params = [SamplingParams(1.0, max_tokens, seed=seed + i, ignore_eos=True) for i in range(len(batch))]
        outs = timed("generate", engine.generate, batch, params)
        timed("sleep", engine.sleep, sleep_level)
        rewards = [1.0 if sum(o.token_ids) % 2 else -1.0 for o in outs]  # any signal moves the weights
        trainer.conn.send(("step", batch, [o.token_ids for o in outs], rewards))
        _, step_s, step_peak, loss, grad_norm = trainer.recv("stepped")
        say("colocated_smoke", f"step: {step_s:.3f} s (the first step compiles)")
        phases["step"], peaks["step_trainer"] = round(step_s, 3), step_peak
        timed("wake", engine.wake_up, sleep_level < 2)  # level 2: weights only, the KV cache after the update
        before = _digests(model_tensors(replica))
        update_s, update_peak, cast = timed("update", trainer.send_weights, receiver, 2)
        phases["update"] = round(update_s, 3)
        peaks["update_trainer"] = update_peak
        if sleep_level == 2:
            timed("wake", engine.wake_up)
        equal.append(_digests(model_tensors(replica)) == cast)
        changed = before != cast
        outs2 = timed("generate_after", engine.generate, batch, params)
    finally:
        trainer.close()
    name = model_name if isinstance(model_name, str) else cfg.model_type
    return {"benchmark": "colocated_smoke", "model": name, "device": device, "dtype": dtype,
            "sleep_level": sleep_level, "sequences": len(batch), "tokens": sum(len(o.token_ids) for o in outs2),
            "phase_s": phases, "peak_bytes": peaks, "loss": round(loss, 6), "grad_norm": round(grad_norm, 6),
            "weights_changed": changed, "replica_equals_cast_master": all(equal),
            "weights_version": receiver.version}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="a shape of benchmarks.rollout.MODELS (random weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the replica's dtype")
    ap.add_argument("--sleep-level", type=int, default=2, choices=[1, 2])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print only the JSON record")
    a = ap.parse_args(argv)
    rec = run(a.model, a.device, a.dtype, a.sleep_level, a.prompts, a.samples, a.max_tokens)
    print(json.dumps(rec))
    if not a.json:
        print(f"colocated smoke: replica equals the cast master: {rec['replica_equals_cast_master']}; "
              f"phases {rec['phase_s']}", file=sys.stderr)
    return rec


if __name__ == "__main__":
    main()
