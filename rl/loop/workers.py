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
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from checkpoint_engine.adapter_sender import update_sender
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.model_sender import ModelSender
from checkpoint_engine.p2p import Endpoint, P2PReceiver, P2PSender, node_name
from checkpoint_engine.sinks import AdapterUpdates, fill_sink, make_sink
from checkpoint_engine.topology import free_port
from checkpoint_engine.transfer import WeightReceiver
from engines.device import peak_memory_bytes, reset_peak_memory
from engines.inference.factory import EngineSettings, build_engine, replica_model
from engines.inference.requests import Completion
from engines.inference.sampling import SamplingParams
from engines.model import sharded
from engines.model.io.hf_io import read_config, read_tensors
from engines.model.layout import hub_state
from engines.model.native.causal_lm import track_max_logits
from engines.model.text.processor import VisionProcessor, is_vision_dir
from engines.training import distributed
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from engines.training.parallel_dims import ParallelDims
from engines.training.policy import after_startup, build_policy, empty_policy, save_policy, served_state
from engines.training.trainer_state import has_trainer_state, load_trainer_state, save_trainer_state
from rl.algo.batches import RankBatch
from rl.algo.update import rl_update
from rl.errors import UserError
from rl.loop.weight_sync import RayPacker, RayReloader
from rl.rollout.turns import serve_turns
from rl.sample import TurnRequest, TurnResult
from rl.settings import TrainerSettings, UpdateSettings

OPTIMIZER_FILE = "optimizer.pt"  # the earlier checkpoint format, still read


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


def apply_run_umask() -> None:
    """Take the umask ``RL_RUN_UMASK`` names (octal; the chart's pods: 0002): a root RDMA worker, which has no
    CAP_DAC_OVERRIDE, and the uid-1000 head then write and delete each other's files in the setgid run directory
    through their common group (the pods' fsGroup)."""
    if umask := os.environ.get("RL_RUN_UMASK"):
        os.umask(int(umask, 8))


class TrainerWorker:
    """Holds one rank of the (sharded) training engine and the sending end of the checkpoint engine."""

    def __init__(self, trainer: TrainerSettings, update: UpdateSettings, threads: int,
                 devices: str | None = None) -> None:
        """``devices``: the GPU of this rank's worker's tensor-parallel replica it computes on (its
        CUDA_VISIBLE_DEVICES: Ray assigned the worker's GPUs to the replica; the worker has a rank on each)."""
        _set_threads(threads)
        apply_run_umask()
        if devices is not None:  # before anything initialises CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
        self.settings, self.update = trainer, update
        self.reloader: RayReloader | None = None
        self.p2p: P2PSender | None = None  # disaggregated: the point-to-point updates' sending end

    def rendezvous(self, local: bool) -> str:
        """The torch.distributed address of this worker (asked of rank 0 only); ``local``: a cluster on one host."""
        ip = "127.0.0.1" if local else _host_ip()
        return f"tcp://{ip}:{free_port()}"

    def _arch(self, model_dir: str):
        """The model in ``model_dir`` as the trainer's backend reads it: the native ``ModelConfig``, or transformers'
        config (``trainer.backend`` "transformers", ``engines.model.hf.backend``)."""
        from engines.model.hf.backend import read_hf_config

        t = self.settings
        return read_hf_config(model_dir, t.trust_remote_code) if t.backend == "transformers" else read_config(model_dir)

    def _replica(self, arch, model_dir: str):
        """An empty replica (meta device) in the rollout engine's layout and dtype, which the weight update is
        planned for: the native engine's fused model, or for vLLM on the transformers backend the checkpoint's own
        names and shapes (vLLM's ``load_weights`` fuses and shards them itself)."""
        from engines.model.hf.backend import empty_hf_model

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
        # precision; replicas get rollout.dtype (cast per bucket); with LoRA the frozen base as engines.training.policy
        self.policy = t.policy
        dims = t.parallel or ParallelDims(workers=world)
        if dims.world != world:
            raise ValueError(f"trainer rank {rank}: the run's layout has {dims.world} ranks, the group {world}")
        model = build_policy(arch, self.policy, dims, device)
        self.model_dir = model_dir
        track_max_logits(model, True)
        model.activation_checkpointing = t.activation_checkpointing
        opts = build_optimizers(model, o.kind, o.lr, o.weight_decay, o.momentum)
        # any id will do for filler: filler positions are masked out of attention and of the loss
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.engine = TrainingEngine(model, opts, pad, o.max_grad_norm, attention=t.attention, qk_clip=True,
                                     qk_clip_tau=o.qk_clip_tau)
        if is_vision_dir(model_dir):  # the trainer expands the samples' image placeholders as the model expects
            self.engine.processor = VisionProcessor.load(model_dir, t.trust_remote_code)
        # GRPO's KL penalty: the reference policy, sharded as the policy is, filled by load_reference
        self.reference: TrainingEngine | None = None
        if t.reference:
            ref = empty_policy(arch, self.policy, dims, device).requires_grad_(False)
            self.reference = TrainingEngine(ref, [], pad, attention=t.attention)
            self.reference.processor = self.engine.processor
        self.sender = ModelSender(model, self._replica(arch, model_dir), t.bucket_bytes)
        # what an update sends: every weight, or a LoRA run's adapters, cast to the replicas' dtype as a full
        # update's weights are; start-up fills the base through the model's plan in either case
        self.updates = update_sender(self.sender, t.bucket_bytes, getattr(torch, t.replica_dtype))
        self.ckpt = CheckpointEngine(rank, world, init_method, t.bucket_bytes, shm_prefix, device=device)
        self._shm_prefix = shm_prefix

    def p2p_endpoint(self, local: bool) -> Endpoint:
        """Open this rank's end of the point-to-point updates (disaggregated); returns where replicas reach it."""
        self.p2p = P2PSender(self.rank, self.settings.bucket_bytes, self._shm_prefix,
                             host="127.0.0.1" if local else _host_ip())
        return self.p2p.endpoint

    def p2p_connect(self, replica: int, node: str, key: str) -> None:
        """Link this rank to replica ``replica`` (running on ``node``), which links to it with ``key`` at the same
        time."""
        assert self.p2p is not None, "p2p_endpoint() first"
        self.p2p.connect(replica, node == self.p2p.endpoint.node, key)

    def weight_plan(self):
        """The bucket plan of the updates and the IPC buffer handles the inference engines map."""
        return self.updates.plan, self.ckpt.ipc_handles()

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
        try:  # updates that carry no base need the replicas filled with it now
            self.updates.check_filled(out["replicas"])
        except ValueError as e:
            raise UserError(str(e)) from None
        after_startup(self.engine.model, self.policy)  # a QLoRA base quantized from the filled one
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

    def serve_catch_up(self, peer: int) -> int:
        """Send this worker's inference engine's weights to worker ``peer``'s restarted one, point to point."""
        return self.ckpt.serve_catch_up(self.sender.plan, peer, RayPacker(self.rollouts[0]))

    def catch_up(self, peer: int) -> int:
        """Fill this worker's restarted inference engine from worker ``peer``'s; returns the version."""
        assert self.reloader is not None
        return self.ckpt.catch_up(self.sender.plan, peer, self.reloader)

    def update_weights(self, version: int, replicas: list[int] | None = None) -> None:
        """Push this rank's part of an update to every inference engine (checkpoint engine): its shard of the
        weights (read from host memory while offloaded: stage 1 is then the H2D copy), or a LoRA run's adapters;
        disaggregated, straight to each replica (``checkpoint_engine.p2p``; to ``replicas`` only where given), which
        receives it meanwhile."""
        if self.p2p is not None:
            self.p2p.targets = replicas
            try:
                self.updates.send(self.p2p, self.engine, version, None)
            finally:
                self.p2p.targets = None
        else:
            self.updates.send(self.ckpt, self.engine, version, self.reloader)

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

    def save(self, directory: str, trainer_state: bool = True) -> None:
        """Weights in Hugging Face format (rank 0 writes the gathered tensors; ``engines.training.policy``) and, with
        ``trainer_state``, every rank's shards of the master weights and optimizer state
        (``engines.training.trainer_state``); collective."""
        with self.engine.onloaded():
            save_policy(self.engine.model, self.policy, directory, self.model_dir)
            if trainer_state:
                save_trainer_state(self.engine.model, self.engine.optimizers, directory)
            if self.world > 1:
                dist.barrier()

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
        with self.engine.onloaded():
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
        with self.engine.onloaded():
            full = served_state(self.engine.model, self.policy, sharded.full_state_dict(self.engine.model),
                                self.model_dir)  # the policy the replicas serve (LoRA: base and adapters merged)
            return {k: v.clone() for k, v in hub_state(self.engine.model, full).items()}

    def close(self) -> None:
        if self.p2p is not None:
            self.p2p.close()
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
        self.p2p: P2PReceiver | None = None  # disaggregated: the point-to-point updates' receiving end

    def prepare_refill(self) -> None:
        """A replacement replica that the trainers fill next: where their updates carry no base (LoRA: a peer's
        weights are merged ones), the base first, from the checkpoint the run started from."""
        if self.receiver is not None and self.receiver.sink.needs_base:
            self.engine.load_weights(read_tensors(self.model_dir).items())

    def attach(self, plan, handles: list, rank_handles: list | None = None,
               adapters: AdapterUpdates | None = None) -> None:
        """Map the checkpoint engine's IPC buffers and take this engine's sink for updates of ``plan``
        (``checkpoint_engine.sinks.make_sink``), checked against its tensors. ``rank_handles``: the handles of every
        trainer rank of this worker (its lead's first), for a replica that loads from the buffers itself (vLLM's
        ``ipc_views``: each of its ranks reads its own GPU's). ``adapters``: the updates carry LoRA adapters."""
        self._ipc = (plan, handles, rank_handles, adapters)
        if self.engine.ipc_views and not self._mapped:  # vLLM on a GPU: its workers load each bucket where it lies
            self.engine.attach_ipc(rank_handles or [handles])
            self._mapped = True
        self.sink = make_sink(self.engine, plan, adapters)
        self.receiver = WeightReceiver(plan, handles, self.sink)

    def p2p_attach(self, plan, adapters: AdapterUpdates | None = None) -> str:
        """Take updates of ``plan`` point to point (disaggregated) into this engine's sink; where its sink loads into a
        spare copy, a complete update waits there for ``commit_update``. Returns this replica's node."""
        self._ipc = (plan, [], None, adapters)
        self.sink = make_sink(self.engine, plan, adapters)
        self.receiver = WeightReceiver(plan, [], self.sink)
        self.receiver.defer_commit = True
        self.p2p = P2PReceiver(plan)
        return node_name()

    def p2p_connect(self, rank: int, endpoint: Endpoint, replica: int, key: str) -> None:
        """Link this replica (``replica``) to trainer rank ``rank``, which links to it with ``key`` at the same time."""
        assert self.p2p is not None, "p2p_attach() first"
        self.p2p.connect(rank, endpoint, replica, key)

    @ray.method(concurrency_group="update")
    def receive_update(self, version: int) -> bool:
        """Take update ``version`` from the trainer ranks while generation goes on (a thread of its own); returns
        whether it waits in the spare copy for ``commit_update`` (else it is served already)."""
        assert self.p2p is not None and self.receiver is not None, "p2p_attach() first"
        self.p2p.receive(self.receiver.plan, version, self.receiver)
        return self.receiver.staged == version

    def commit_update(self, version: int) -> None:
        """Serve the staged update ``version`` from now on (between two generation rounds): the replica's only pause
        for the update."""
        assert self.receiver is not None
        if self.receiver.staged == version:
            self.receiver.commit_staged(version)

    @ray.method(concurrency_group="update")
    def stages_updates(self) -> bool:
        """Whether this replica keeps serving while an update arrives (its sink loads into a spare copy)."""
        return self.receiver is not None and self.receiver.sink.stages

    @ray.method(concurrency_group="update")
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
        if plan is not None:  # whole weights in the checkpoint's layout (also where the updates carry adapters)
            self.receiver.set_plan(plan, fill_sink(self.engine, self.sink))
        else:
            self.receiver.set_plan(self._ipc[0], self.sink)

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

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], seed: int,
                 images: list[tuple] | None = None) -> list[Completion]:
        """Run requests to completion (held-out evaluation); ``images``: each prompt's, when any has some."""
        self._check_consistent()
        return self.engine.generate(prompts, params, seed=seed, images=images)

    def rollout(self, requests: list[TurnRequest], token_budget: int | None
                ) -> tuple[list[TurnResult], dict[str, int], list[int]]:
        """The current turn of new and paused samples, until it ends or ``token_budget`` tokens
        (``rl.rollout.turns.serve_turns``: a request carries only the context this worker does not hold yet, a
        result only the new tokens, tagged with the version of the weights served); the engine's counters over this
        call (prefix-cache tokens found and computed, preemptions, peak KV blocks); and the keys whose context it
        does not hold (then nothing was generated: the driver sends those whole)."""
        self._check_consistent()
        held = self.__dict__.setdefault("_held_contexts", {})  # key -> context kept from the last call
        before = self.engine.stats()
        self.engine.reset_peaks()
        reset_peak_memory(self.engine.device)
        out, missing = serve_turns(self.engine, held, requests, token_budget, self.weights_version())
        after = self.engine.stats()
        counts = {k: after[k] - before[k] for k in ("prefix_hit_tokens", "prefix_miss_tokens", "preemptions")}
        return out, {**counts, "kv_blocks_peak": after["kv_blocks_peak"], "kv_blocks": after["kv_blocks"],
                     "peak_bytes": peak_memory_bytes(self.engine.device) + self.engine.mapped_bytes()}, missing

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's weights under the checkpoint's names; FP8 ones as their bytes (uint8), which is
        how Ray can carry them."""
        return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).clone()
                for k, v in self.engine.served_weights().items()}
