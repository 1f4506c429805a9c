"""The two engines of one colocated worker, each in its own process (a Ray actor).

Both actors of a worker sit in the same placement-group bundle, so they share its devices; the
weights cross from the trainer process to the inference process only through the checkpoint
engine's shared IPC buffers. The trainers of all workers form one torch.distributed group: FSDP2
shards the model over it and the checkpoint engine broadcasts each rank's shard over it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.model_sender import ModelSender, plan_adapter_update
from checkpoint_engine.topology import free_port
from checkpoint_engine.transfer import WeightReceiver
from engines.device import peak_memory_bytes, reset_peak_memory
from engines.inference.factory import EngineSettings, build_engine, replica_model
from engines.inference.requests import Completion
from engines.inference.sampling import SamplingParams
from engines.model import sharded
from engines.model.causal_lm import build_model, track_max_logits
from engines.model.hf_io import read_config, read_tensors, save_pretrained
from engines.model.layout import hub_state
from engines.model.lora import (
    ADAPTER_DIR,
    LoraSpec,
    adapter_state,
    apply_lora,
    init_adapters,
    is_adapter,
    merged_state,
    save_adapters,
)
from engines.model.lora_quant import exact_base, quantize_base, quantized_weights
from engines.training import distributed
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from engines.training.trainer_state import has_trainer_state, load_trainer_state, save_trainer_state
from rl.algo.batches import RankBatch
from rl.algo.update import rl_update
from rl.errors import UserError
from rl.loop.weight_sync import RayPacker, RayReloader
from rl.rollout.partial import advance
from rl.sample import Sample
from rl.settings import TrainerSettings, UpdateSettings

OPTIMIZER_FILE = "optimizer.pt"  # the earlier checkpoint format, still read
LORA_SEED = 0  # LoRA's A matrices: the same draw on every rank and in every run (B starts at zero)


def _set_threads(threads: int) -> None:
    torch.set_num_threads(max(1, threads))


def worker_device(device: str, gpus: float) -> str:
    """``device`` ("cuda" when the run gives its workers ``gpus``, else "cpu") as this worker can use it: a worker
    given GPUs that cannot use them stops the run instead of training on the host while holding them."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"cluster.gpus_per_worker={gpus:g} but CUDA is not available in this worker (torch "
                        f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'}): the node's driver may "
                        "be older than this CUDA needs, or the pod lacks the NVIDIA runtime")
    return device


def _host_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TrainerWorker:
    """Holds one rank of the (sharded) training engine and the sending end of the checkpoint engine."""

    def __init__(self, trainer: TrainerSettings, update: UpdateSettings, threads: int,
                 devices: str | None = None) -> None:
        """``devices``: the GPU of this rank's worker's tensor-parallel replica it computes on (its
        CUDA_VISIBLE_DEVICES: Ray assigned the worker's GPUs to the replica; the worker has a rank on each)."""
        _set_threads(threads)
        if devices is not None:  # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        self.settings, self.update = trainer, update
        self.reloader: RayReloader | None = None

    def rendezvous(self, local: bool) -> str:
        """The torch.distributed address of this worker (asked of rank 0 only); ``local``: a cluster on one host."""
        ip = "127.0.0.1" if local else _host_ip()
        return f"tcp://{ip}:{free_port()}"

    def _arch(self, model_dir: str):
        """The model in ``model_dir`` as the trainer's backend reads it: the native ``ModelConfig``, or transformers'
        config (``trainer.backend`` "transformers", ``engines.model.hf_backend``)."""
        from engines.model.hf_backend import read_hf_config

        t = self.settings
        return read_hf_config(model_dir, t.trust_remote_code) if t.backend == "transformers" else read_config(model_dir)

    def _model(self, arch, shard: bool, device: str, lora: LoraSpec | None = None):
        """An empty model of ``arch`` in the master dtype, sharded over the group when ``shard`` (FSDP2, compute in
        the compute dtype), for ``startup`` (or the reference's read) to fill. The transformers backend builds
        transformers' own model (``HFCausalLM``) under the same contract. ``lora`` (sharded only): the adapters
        go on before sharding, so FSDP2 shards them with the frozen base and reduces their gradients alone; they
        are drawn once sharded, A alike on every rank (each keeps its rows)."""
        from engines.model.hf_backend import empty_hf_model, materialize

        t = self.settings
        dtype = getattr(torch, t.master_dtype)
        if t.backend == "transformers":
            model = empty_hf_model(arch, dtype, t.trust_remote_code)
            if not shard:
                materialize(model, device)
        else:
            model = build_model(arch, device="meta" if shard else device, dtype=dtype)
        if not shard:
            return model
        if lora is not None:
            apply_lora(model, lora, dtype)  # on meta: the adapters' shapes
        model = distributed.shard_model(model, param_dtype=t.compute_dtype, device=device)
        if lora is not None:
            init_adapters(model, lora, torch.Generator(device=device).manual_seed(LORA_SEED))
        return model

    def _replica(self, arch, model_dir: str):
        """An empty replica (meta device) in the rollout engine's layout and dtype, which the weight update is
        planned for: the native engine's fused model, or for vLLM on the transformers backend the checkpoint's own
        names and shapes (vLLM's ``load_weights`` fuses and shards them itself)."""
        from engines.model.hf_backend import empty_hf_model

        t = self.settings
        if t.backend == "transformers" and t.rollout_engine != "native":
            return empty_hf_model(arch, getattr(torch, t.replica_dtype), t.trust_remote_code)
        native = read_config(model_dir) if t.backend == "transformers" else arch
        return replica_model(native, t.replica_dtype, t.replica_fp8, device="meta")

    def setup(self, model_dir: str, rank: int, world: int, init_method: str, shm_prefix: str) -> None:
        """Join the group, build the model on the meta device and shard it (``startup`` fills it), build
        the optimizers and the checkpoint engine."""
        t, o = self.settings, self.settings.optimizer
        self.rank, self.world = rank, world
        device = worker_device(t.device, t.gpus)
        distributed.init_distributed(rank, world, init_method, device=device)
        arch = self._arch(model_dir)
        # master weights (and optimizer state) in trainer.master_dtype, compute in bf16 through FSDP's mixed
        # precision; replicas get rollout.dtype (cast per bucket)
        # LoRA on one rank needs no FSDP for mixed precision: its frozen model is kept in the compute dtype
        shard = world > 1 or (t.compute_dtype != t.master_dtype and t.lora is None)
        model = self._model(arch, shard, device, t.lora)
        if t.lora is not None and not shard:  # frozen base, adapters in the master dtype
            master, served = getattr(torch, t.master_dtype), getattr(torch, t.replica_dtype)
            if t.compute_dtype != t.master_dtype:  # the checkpoint's dtype (lora_run_checks): nothing is rounded
                model.to(getattr(torch, t.compute_dtype))
            # else the adapted projections' base is kept as the replicas serve it, the checkpoint's own dtype (start-up
            # refuses a LoRA run whose replicas do not load the checkpoint as it is): narrower than the master
            # dtype loses nothing and halves most of the model's bytes
            apply_lora(model, t.lora, master, torch.Generator(device=device).manual_seed(LORA_SEED),
                       base_dtype=served if served.itemsize < master.itemsize else None)
        self.model_dir = model_dir
        track_max_logits(model, True)
        model.activation_checkpointing = t.activation_checkpointing
        opts = build_optimizers(model, o.kind, o.lr, o.weight_decay, o.momentum)
        # any id will do for filler: filler positions are masked out of attention and of the loss
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.engine = TrainingEngine(model, opts, pad, o.max_grad_norm, attention=t.attention, qk_clip=True,
                                     qk_clip_tau=o.qk_clip_tau)
        # GRPO's KL penalty: the reference policy, sharded as the policy is, filled by load_reference
        self.reference: TrainingEngine | None = None
        if t.reference:
            self.reference = TrainingEngine(self._model(arch, shard, device).requires_grad_(False), [], pad,
                                            attention=t.attention)
        self.sender = ModelSender(model, self._replica(arch, model_dir), t.bucket_bytes)
        # a LoRA run's updates carry the adapters only, cast to the replicas' dtype as a full update's weights are
        # (half the bytes of float32 for bfloat16 replicas); start-up fills the base through the model's plan
        self.adapter_plan = None if t.lora is None else \
            plan_adapter_update(adapter_state(model), t.bucket_bytes, getattr(torch, t.replica_dtype))
        self.ckpt = CheckpointEngine(rank, world, init_method, t.bucket_bytes, shm_prefix, device=device)

    def weight_plan(self):
        """The bucket plan and the IPC buffer handles the inference engines map."""
        return self.adapter_plan or self.sender.plan, self.ckpt.ipc_handles()

    def share_replica(self, ranks_per_worker: int) -> None:
        """This rank's worker's replica loads from every rank's IPC buffers (a tensor-parallel vLLM replica, each
        rank from its own GPU's): the worker's ranks wait for its loads together (collective)."""
        self.ckpt.share_replica(ranks_per_worker)

    def startup_plan(self, model_dir: str):
        """The plan of reading ``model_dir`` at start-up, and whether the inference engines load it too."""
        return self.sender.startup_plan(model_dir, self.world)

    def startup(self, model_dir: str) -> dict:
        """Read the checkpoint once across all trainers (each file by one of them): it fills every
        trainer's shard, and the inference engines when they hold its dtypes (collective). Returns
        whether they did ("replicas") and the tensors this trainer read per file ("reads")."""
        out = self.sender.startup(self.ckpt, model_dir, self.reloader)
        if self.adapter_plan is not None and not out["replicas"]:
            raise UserError("model.lora: the rollout engine must load the checkpoint as it is (rollout.dtype = the "
                            "checkpoint's dtype, no FP8): a LoRA run's updates carry the adapters, not the base")
        lora = self.settings.lora
        if lora is not None and lora.quantize_base is not None:  # QLoRA: from the filled base, once
            quantize_base(self.engine.model, lora.quantize_base)
        return out

    def load_reference(self, model_dir: str) -> None:
        """Fill the reference policy (kl_coef) from ``model_dir``, the model the run started from, in one collective
        read as ``startup`` does; the inference engines are not touched."""
        assert self.reference is not None
        replica = self._replica(self._arch(model_dir), model_dir)
        ModelSender(self.reference.model, replica, self.settings.bucket_bytes).startup(self.ckpt, model_dir, None)

    def connect(self, rollouts: list) -> None:
        """The local inference engines that this worker's checkpoint engine updates."""
        self.rollouts, self.reloader = rollouts, RayReloader(rollouts)

    def _no_lora_catch_up(self) -> None:
        if self.adapter_plan is not None:
            raise RuntimeError("model.lora: a restarted inference engine cannot catch up from a peer's merged "
                               "weights yet; resume the run from its last checkpoint (rl train --resume)")

    def serve_catch_up(self, peer: int) -> int:
        """Send this worker's inference engine's weights to worker ``peer``'s restarted one, point to point."""
        self._no_lora_catch_up()
        return self.ckpt.serve_catch_up(self.sender.plan, peer, RayPacker(self.rollouts[0]))

    def catch_up(self, peer: int) -> int:
        """Fill this worker's restarted inference engine from worker ``peer``'s; returns the version."""
        assert self.reloader is not None
        self._no_lora_catch_up()
        return self.ckpt.catch_up(self.sender.plan, peer, self.reloader)

    def update_weights(self, version: int) -> None:
        """Push this rank's shard of the weights to every inference engine (checkpoint engine).

        While offloaded the shards are read from host memory: stage 1 is then the H2D copy. A LoRA run sends
        the adapters only, gathered whole on every rank (megabytes; rank 0 sends them)."""
        if self.adapter_plan is not None:
            with self._onloaded():
                adapters = {n: t.reshape(-1) for n, t in adapter_state(self.engine.model, full=True).items()}
                self.ckpt.update(self.adapter_plan, adapters, version, self.reloader)
            return
        shards = self.engine.host_shards() if self.engine.offloaded else sharded.local_shards(self.engine.model)
        tensors, offsets = self.sender.sources(shards)
        self.ckpt.update(self.sender.plan, tensors, version, self.reloader, offsets=offsets)

    def train(self, batch: RankBatch) -> Iterator[dict[str, float]]:
        """Run this rank's share of the policy update (K1.5, GRPO or DAPO; + PTX); yields each step's metrics,
        reduced over all ranks, as it completes."""
        reset_peak_memory(self.engine.device)
        yield from rl_update(self.engine, batch, self.update, reference=self.reference)

    def peak_memory(self) -> int:
        """Peak bytes of this process since its last ``train`` began (device memory on a GPU, RSS on CPU)."""
        return peak_memory_bytes(self.engine.device)

    def offload(self) -> dict:
        """Parameters, gradients and optimizer state to host memory while the inference engine runs (and the
        reference policy's parameters, where there is one)."""
        if not self.settings.offload or self.engine.offloaded:
            return {}
        if self.reference is not None and not self.reference.offloaded:
            self.reference.offload()
        return self.engine.offload()

    def onload(self) -> dict:
        if self.reference is not None and self.reference.offloaded:
            self.reference.onload()
        return self.engine.onload() if self.engine.offloaded else {}

    @contextmanager
    def _onloaded(self):
        """The trainer's tensors in place for the duration (an offloaded tensor has no storage)."""
        was = self.engine.offloaded
        if was:
            self.engine.onload()
        try:
            yield
        finally:
            if was:
                self.engine.offload()

    def save(self, directory: str, trainer_state: bool = True) -> None:
        """Weights in Hugging Face format (rank 0 writes the gathered tensors) and, with ``trainer_state``, every
        rank's shards of the master weights and optimizer state (``engines.training.trainer_state``); collective."""
        with self._onloaded():
            state = sharded.full_state_dict(self.engine.model)
            if self.rank == 0:
                lora = self.settings.lora
                if lora is not None:  # the directory loads as the trained policy; adapter/ goes on the base with PEFT
                    adapters = {n: v for n, v in state.items() if is_adapter(n)}  # gathered whole
                    save_adapters(lora, adapters, Path(directory) / ADAPTER_DIR, base_model=self.model_dir)
                    state = self._merged(state)
                save_pretrained(self.engine.model, None, directory, state=state)
            del state
            if trainer_state:
                save_trainer_state(self.engine.model, self.engine.optimizers, directory)
            if self.world > 1:
                dist.barrier()

    def _merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A LoRA model's full ``state`` as the policy the replicas serve: base plus adapters merged, the base of a
        quantized projection (QLoRA) read from the checkpoint the run started from, as the replicas keep it."""
        quantized = quantized_weights(self.engine.model)
        if quantized:
            state = exact_base(state, quantized, read_tensors(self.model_dir, quantized))
        return merged_state(state, self.settings.lora.scaling)

    def scale_lr(self, factor: float) -> float:
        """Multiply every optimizer's learning rate by ``factor`` (a rollback); returns the first group's new rate."""
        for opt in self.engine.optimizers:
            for group in opt.param_groups:
                group["lr"] = float(group["lr"]) * factor
        return float(self.engine.optimizers[0].param_groups[0]["lr"])

    def load_state(self, directory: str) -> None:
        """Master weights and optimizer state from a checkpoint, whatever the worker count that saved it;
        collective. A checkpoint of the earlier format (one ``optimizer.pt`` of per-rank states) needs the
        same worker count and restores the optimizer only (its weights are the directory's)."""
        with self._onloaded():
            if has_trainer_state(directory):
                load_trainer_state(self.engine.model, self.engine.optimizers, directory)
                return
            saved = torch.load(Path(directory) / OPTIMIZER_FILE, weights_only=False)
            if saved.get("world") != self.world:
                raise ValueError(f"{directory}: optimizer state was saved by {saved.get('world')} workers; this "
                                 f"run has {self.world} (set cluster.workers to {saved.get('world')} to resume)")
            # torch.load's storages are not resizable, which offloading needs: give the state its own memory
            self.engine.load_state_dict(tree_map_only(torch.Tensor, torch.clone, saved["ranks"][self.rank]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under the checkpoint's names (collective when sharded)."""
        with self._onloaded():
            full = sharded.full_state_dict(self.engine.model)
            if self.settings.lora is not None:  # the policy the replicas serve: base and adapters merged
                full = self._merged(full)
            return {k: v.clone() for k, v in hub_state(self.engine.model, full).items()}

    def close(self) -> None:
        self.ckpt.close()


class RolloutWorker:
    """Holds the inference engine and the receiving end of the checkpoint engine."""

    def __init__(self, engine: EngineSettings, threads: int, gpus: float = 0) -> None:
        """``engine``: the replica (``engines.inference.factory``); on the ``gpus`` Ray gave this worker's bundle
        (shared with its trainer), empty: the trainers' start-up read fills it (or their first update does)."""
        _set_threads(threads)
        worker_device(engine.device, gpus)
        self.engine = build_engine(engine)
        self.model_dir = engine.model_dir
        self.receiver: WeightReceiver | None = None
        self._ipc: tuple | None = None
        self._mapped = False  # the engine mapped the IPC buffers itself (ipc_views)

    def load_base(self) -> None:
        """A LoRA run's replacement replica: the base from the checkpoint the run started from, which the
        adapters' next update merges onto (a peer's weights are merged ones, and the updates carry no base)."""
        self.engine.load_weights(read_tensors(self.model_dir).items())

    def attach(self, plan, handles: list, rank_handles: list | None = None, lora_scaling: float | None = None) -> None:
        """Map the checkpoint engine's IPC buffers; checks the plan against this engine's tensors. ``rank_handles``:
        the handles of every trainer rank of this worker (its lead's first), for a replica that loads from the
        buffers itself (vLLM's ``ipc_views``: each of its ranks reads its own GPU's). ``lora_scaling``: the plan
        carries LoRA adapters, loaded aside and merged into the base this engine keeps (alpha / rank)."""
        self._ipc = (plan, handles, rank_handles, lora_scaling)
        if lora_scaling is not None:
            self.engine.keep_adapter_base()  # the updates carry no base: a level-2 sleep keeps it on the host
            dev = self.engine.device
            staged = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device=dev)
                      for n, t in plan.tensors.items()}
            self.receiver = WeightReceiver(plan, handles, staged,
                                           on_commit=lambda a: self.engine.merge_adapters(a, lora_scaling))
            return
        self.receiver = self._weights_receiver(plan, handles, rank_handles)

    def _weights_receiver(self, plan, handles: list, rank_handles: list | None) -> WeightReceiver:
        """The receiver of whole weights (an update's, or a LoRA run's start-up fill) for this engine's kind."""
        if self.engine.ipc_views:  # vLLM on a GPU: its workers load each bucket where it lies
            if not self._mapped:
                self.engine.attach_ipc(rank_handles or [handles])
                self._mapped = True
            return WeightReceiver(plan, handles, self.engine.named_tensors(), stream=self.engine, views=True)
        if self.engine.weight_update == "stream":  # vLLM: each bucket goes on into its running reload
            return WeightReceiver(plan, handles, self.engine.named_tensors(), stream=self.engine)
        return WeightReceiver(plan, handles, self.engine.named_tensors(), on_commit=self.engine.swap_weights,
                              placements=self.engine.weight_placements() or None)

    def weights_version(self) -> int:
        """The version of the weights this replica holds (its receiver's: updates since the run began)."""
        return 0 if self.receiver is None or self.receiver.version is None else self.receiver.version

    def adopt_version(self, version: int) -> None:
        """The weights the start-up read of a checkpoint loaded are that checkpoint's ``version`` (a resumed run)."""
        assert self.receiver is not None, "attach() first"
        self.receiver.version = version

    def use_plan(self, plan=None) -> None:
        """Load the buckets of ``plan`` from now on (the start-up's), or again those of the updates (None)."""
        assert self.receiver is not None and self._ipc is not None, "attach() first"
        if self._ipc[3] is not None:  # LoRA: the start-up fills the base, the updates' receiver stages adapters
            version = self.receiver.version
            if plan is not None:
                self._updates, self.receiver = self.receiver, self._weights_receiver(plan, self._ipc[1], self._ipc[2])
            else:
                self.receiver = self._updates
            self.receiver.version = version
            return
        self.receiver.set_plan(plan if plan is not None else self._ipc[0])

    def visible_devices(self) -> str | None:
        """The GPUs Ray gave this worker (CUDA_VISIBLE_DEVICES), which its trainer shares."""
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def pack_bucket(self, bucket: int, buffer: int) -> int:
        """Write bucket ``bucket`` of the weights this engine serves into IPC buffer ``buffer`` (a restarted
        replica catches up from it); returns their version."""
        assert self.receiver is not None, "attach() before pack_bucket()"
        return self.receiver.pack(bucket, buffer)

    def sleep(self, level: int) -> None:
        """Free the KV cache (1) and the weights (2) while the trainer uses the device."""
        if level:
            self.engine.sleep(level)
            if level == 2:  # its spare copy goes too; a new one is made at wake-up, holding the same version
                self._version, self.receiver = self.weights_version(), None

    def wake_up(self, kv_cache: bool = True) -> None:
        """Reallocate (``kv_cache=False``: the weights only, which the update that follows fills; a second call
        takes the KV cache back); after a level-2 sleep the next weight update refills the weights."""
        if self.engine.sleeping:
            self.engine.wake_up(kv_cache)
            if self.receiver is None and self._ipc is not None:
                self.attach(*self._ipc)
                self.receiver.version = self._version

    def load_bucket(self, bucket: int, buffer: int, version: int) -> None:
        assert self.receiver is not None, "attach() before load_bucket()"
        self.receiver.load(bucket, buffer, version)

    def abort_update(self, version: int) -> bool:
        """The update failed on the trainer side: go back to the previous weights."""
        return self.receiver is None or self.receiver.rollback()

    def _check_consistent(self) -> None:
        if self.receiver is not None and not self.receiver.consistent:
            raise RuntimeError("weights are partly updated (an update failed midway and could not be rolled "
                               "back); refusing to generate until a complete update arrives")

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], seed: int) -> list[Completion]:
        """Run requests to completion (held-out evaluation)."""
        self._check_consistent()
        return self.engine.generate(prompts, params, seed=seed)

    def rollout(self, samples: list[Sample], token_budget: int | None) -> tuple[list[Sample], dict[str, int]]:
        """The current turn of new and paused samples, until it ends or ``token_budget`` tokens
        (``rl.rollout.partial.advance``; the new tokens tagged with the version of the weights served), and the
        engine's counters over this call (prefix-cache tokens found and computed, preemptions, peak KV blocks)."""
        self._check_consistent()
        before = self.engine.stats()
        self.engine.reset_peaks()
        reset_peak_memory(self.engine.device)
        out = advance(self.engine, samples, token_budget, self.weights_version())
        after = self.engine.stats()
        counts = {k: after[k] - before[k] for k in ("prefix_hit_tokens", "prefix_miss_tokens", "preemptions")}
        return out, {**counts, "kv_blocks_peak": after["kv_blocks_peak"], "kv_blocks": after["kv_blocks"],
                     "peak_bytes": peak_memory_bytes(self.engine.device) + self.engine.mapped_bytes()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's weights under the checkpoint's names; FP8 ones as their bytes (uint8), which is
        how Ray can carry them."""
        return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).clone()
                for k, v in self.engine.served_weights().items()}
