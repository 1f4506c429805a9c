"""The run config: YAML validated by a typed schema before any work starts.

Unknown keys and bad values are rejected with the dotted key, what was given and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from rl.config.base import Strict
from rl.config.engines import check_engine
from rl.config.model import Architecture, LoraConfig, MoEArchitecture, PolicyModelConfig, WarmStartConfig  # noqa: F401
from rl.errors import UserError
from sandbox.options import KubernetesOptions, LimitsOptions, SandboxOptions

# the sandbox section is sandbox.options' schema, embedded as is; these are the names rl.config has exported
SandboxConfig, SandboxLimitsConfig, KubernetesSandboxConfig = SandboxOptions, LimitsOptions, KubernetesOptions


class RunConfig(Strict):
    name: str = "run"
    seed: int = 0
    iterations: int = Field(50, ge=1)
    eval_every: int = Field(5, ge=1, description="held-out greedy accuracy and mean reward every N iterations")
    eval_samples: int = Field(4, ge=0, description="held-out accuracy also sampled at the rollout temperature, "
                                                   "averaged over this many samples per prompt (0: greedy only)")
    eval_success: float = Field(1.0, allow_inf_nan=False, description="a held-out response counts as solved "
                                "(accuracy) when its reward is at least this and it ended on its own (not cut at "
                                "max_tokens); for rewards in [0, 1] that are not 0/1, e.g. 0.5")
    best_metric: Literal["accuracy", "eval_reward"] = Field(
        "accuracy", description="the held-out signal best/ is chosen on and the collapse guard watches: accuracy "
                                "(the share solved) or eval_reward (the greedy responses' mean reward)")
    save_every: int = Field(10, ge=1, description="checkpoint every N iterations (and at the end)")
    keep_checkpoints: int = Field(2, ge=1)
    max_minutes: float | None = Field(None, gt=0, description="wall-clock budget of the RL loop (resumes included): "
                                      "after the iteration that reaches it the run saves a checkpoint, its final "
                                      "model and summary, and ends")
    max_env_error_rate: float = Field(0.5, ge=0, le=1, description="stop when a larger share of an iteration's "
                                      "episodes fails in its environment (the first error is named)")
    collapse_guard: bool | None = Field(None, description="roll back to the best evaluated weights (kept in best/ "
                                        "with their trainer state) when the run collapses: the held-out best_metric "
                                        "collapse_drop below the best, or the mean reward halving (rl.loop.health); "
                                        "None: on where the run has held-out metrics; true: refuse a run without")
    collapse_drop: float = Field(0.1, gt=0, le=1, description="held-out best_metric this far below the best so far "
                                 "counts as a collapse (or collapse_drop_relative of the best, if less)")
    collapse_drop_relative: float = Field(
        0.3, gt=0, le=1, description="a collapse is also this share of the best held-out accuracy lost (on a task "
                                     "the model rarely solves, 0.1 is most of it); never less than two standard "
                                     "errors of the evaluation, so noise alone does not roll back")
    max_rollbacks: int = Field(3, ge=0, description="collapses rolled back before the run stops with a message")
    rollback_lr_factor: float = Field(0.5, gt=0, le=1, description="each rollback multiplies the learning rate by "
                                      "this")
    step_timeout_s: float = Field(600, gt=0, description="a worker that does not answer a call of the loop (a "
                                  "rollout, a training step, a weight update, a save) within this many seconds has "
                                  "stalled: it is replaced (an inference engine) or the workers restart from the "
                                  "last checkpoint")
    max_restarts: int = Field(3, ge=0, description="recoveries from worker faults (an inference engine replaced in "
                              "place, the workers restarted from the last checkpoint) before the run stops")
    checkpoint_on_stop: bool = Field(True, description="a stop request (the file stop-requested in the run directory, "
                                     "which the chart's preStop writes when a pod of the run is going away) is "
                                     "answered at once during the rollout phase (the iteration is abandoned and the "
                                     "state it started from saved) or after the training phase (the iteration's "
                                     "checkpoint saved): the file is removed and the run ends with exit status 1, so "
                                     "its retry resumes from that checkpoint exactly (rl/loop/stop.py)")
    export_uri: str | None = Field(None, description="s3://bucket/prefix or gs://bucket/prefix: the final model goes "
                                   "to <uri>/final when the run ends (the credentials the model download uses)")
    export_checkpoints: bool = Field(False, description="with export_uri, every checkpoint also goes to "
                                     "<uri>/checkpoints/iter_N once it is sealed")

    @field_validator("export_uri")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("s3://", "gs://")):
            raise ValueError("must be s3://bucket/prefix or gs://bucket/prefix")
        return v


class ClusterConfig(Strict):
    ray_address: str | None = Field(None, description="None starts a local Ray cluster")
    workers: int = Field(1, ge=1, description="colocated workers; the trainer is sharded over them (FSDP2)")
    threads_per_worker: int | None = Field(None, ge=1, description="torch threads; None = $OMP_NUM_THREADS where "
                                           "the run is started with it, else the CPUs of the worker's pod (its CPU "
                                           "limit) shared by the workers placed there")
    gpus_per_worker: float = Field(0, ge=0, description="GPUs of each colocated worker (its trainer and "
                                   "inference engine share them); 0 = CPU only")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: each worker's trainer and rollout replica share its devices and take "
                                 "turns; disaggregated: the trainers (cluster.workers) and the rollout replicas "
                                 "(cluster.rollout_workers) are separate workers that run at once, the replicas up "
                                 "to algorithm.max_staleness weight versions ahead of the trainer")
    rollout_workers: int | None = Field(None, ge=1, description="disaggregated: rollout replicas, each a worker of "
                                        "its own (None: as many as cluster.workers)")


TaskField = Literal["id", "prompt", "answer", "meta", "messages"]


class RewardEndpointConfig(Strict):
    """A reward model or verifier behind HTTP (env ``endpoint``; docs/environments.md has its request schema)."""

    url: str = Field(pattern="^https?://", description="POST target")
    timeout_s: float = Field(30.0, gt=0, description="per request")
    retries: int = Field(2, ge=0, description="after a connection error, a timeout, 408, 429 or 5xx")
    batch_size: int = Field(16, ge=1, description="responses per request")
    headers: dict[str, str] = Field({}, description="e.g. Authorization")


class RewardJudgeConfig(Strict):
    """An LLM judge over an OpenAI-compatible chat API (env ``judge``; its key: $OPENAI_API_KEY)."""

    base_url: str = Field(pattern="^https?://", description="the API's root, e.g. http://127.0.0.1:8001/v1")
    model: str
    rubric: str | None = Field(None, description="None: a correct, complete, clear answer agreeing with the reference")
    scale: int = Field(10, ge=1, description="the judge scores 0..scale; the reward is score / scale")
    max_tokens: int = Field(512, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    retries: int = Field(2, ge=0)


class RewardConfig(Strict):
    """Where an entry's rewards come from instead of its environment's grading: exactly one of these."""

    function: str | None = Field(None, description="'package.module:fn' or 'path/to/file.py:fn', of one response "
                                 "or of a prompt's K responses (it names responses or completions)")
    endpoint: RewardEndpointConfig | None = None
    judge: RewardJudgeConfig | None = None
    relative: bool = Field(False, description="a group function whose rewards compare a prompt's responses with "
                           "each other (a ranking): held-out evaluation leaves it out; False (TRL's reward "
                           "functions): each response's reward is its own, and a held-out response is scored alone")

    @model_validator(mode="after")
    def _one(self) -> RewardConfig:
        if sum(x is not None for x in (self.function, self.endpoint, self.judge)) != 1:
            raise ValueError("give exactly one of function, endpoint, judge")
        if self.relative and (self.function is None or self.environment()[0] != "group_function"):
            raise ValueError("relative: only a group function (one that takes responses or completions) compares "
                             "responses")
        self.environment()  # a function that does not load is this section's error
        return self

    def environment(self) -> tuple[str, dict[str, Any]]:
        """The reward environment (``function``, ``group_function``, ``endpoint``, ``judge``) and its kwargs."""
        if self.function is not None:
            from envs.reward_function import RewardFunctionError, reward_function_env

            try:  # the function's parameters say whether it rewards one response or a group
                name = reward_function_env(self.function)
                return name, {"function": self.function, **({"relative": True} if self.relative else {})}
            except RewardFunctionError as e:
                raise ValueError(str(e)) from None
        return ("endpoint", self.endpoint.model_dump()) if self.endpoint else \
            ("judge", self.judge.model_dump(exclude_none=True))


class TaskSourceConfig(Strict):
    """The environment that generates an entry's tasks while ``reward`` grades them."""
    name: str
    kwargs: dict[str, Any] = {}


class EnvConfig(Strict):
    name: str = Field("arithmetic", description="the environment: it grades the responses and makes the tasks")
    kwargs: dict[str, Any] = {}
    reward: RewardConfig | None = Field(None, description="grade with a function, an endpoint or a judge: the entry "
                                        "becomes that environment's; a `name` given generates the tasks (tasks_from)")
    tasks_from: TaskSourceConfig | None = Field(None, description="the environment that generates the tasks")
    train_tasks: str | None = Field(None, description="a JSONL or Parquet file (verl's and slime's layouts too), a "
                                    "datasets directory (save_to_disk) or a hub dataset hf://ORG/NAME?split=train&"
                                    "config=NAME; None = generated by the env")
    eval_tasks: str | None = Field(None, description="the held-out tasks, as train_tasks")
    columns: dict[TaskField, str] = Field({}, description="task field -> column: {prompt: question}; a.b: in a struct")
    num_train: int = Field(20000, ge=1)
    num_eval: int = Field(500, ge=1)
    weight: float = Field(1.0, gt=0, description="share of new prompts drawn from this environment in a task mix")
    task_type: str | None = Field(None, description="task type of its tasks (budgets, temperatures, metrics); "
                                                    "None = the environment's own")
    timeout_s: float = Field(120.0, gt=0, description="most seconds one episode may spend in the environment")

    @model_validator(mode="wrap")
    @classmethod
    def _reward_environment(cls, data: Any, handler: Any) -> EnvConfig:
        """An entry with ``reward`` becomes the reward environment's entry (the form config.yaml records)."""
        entry = handler(data)
        if entry.reward is None:
            return entry
        named = isinstance(data, dict) and "name" in data
        if not named and (entry.kwargs or not (entry.train_tasks and entry.eval_tasks)):
            raise ValueError("with reward, the tasks come from train_tasks and eval_tasks (give both) or from the "
                             "environment `name` names (kwargs are its)")
        name, kwargs = entry.reward.environment()
        source = {"name": entry.name, "kwargs": entry.kwargs} if named else None
        return handler({**entry.model_dump(exclude={"reward"}), "name": name, "kwargs": kwargs, "tasks_from": source})


class TemperatureConfig(Strict):
    schedule: Literal["constant", "linear", "cosine", "exponential"] = "constant"
    start: float = Field(1.0, gt=0)
    end: float = Field(1.0, gt=0)


class TaskTypeConfig(Strict):
    """Overrides for one task type (``Env.task_type``, or a task's ``meta.task_type``)."""

    max_tokens: int | None = Field(None, ge=1, description="token budget of a response of this type")
    truncation_penalty: float | None = Field(None, description="reward of a response that hits the budget")
    temperature: TemperatureConfig | None = None


class PartialRolloutConfig(Strict):
    """Partial rollout (report 3.3): a per-iteration token budget; unfinished trajectories wait."""

    token_budget: int | None = Field(None, ge=1, description="tokens generated per iteration (all workers); "
                                                               "None = every trajectory finishes in its iteration")
    max_age: int = Field(2, ge=0, description="iterations a paused trajectory may wait before it is dropped")


class RolloutConfig(Strict):
    prompts_per_iteration: int = Field(64, ge=1, description="prompt groups in flight per iteration")
    samples_per_prompt: int = Field(8, ge=2, description="K of the K1.5 objective")
    max_tokens: int = Field(40, ge=1, description="token budget of a response (default for every task type)")
    truncation_penalty: float = Field(0.0, description="reward of a response that hits the budget")
    temperature: TemperatureConfig = TemperatureConfig()
    task_types: dict[str, TaskTypeConfig] = Field({}, description="per task type budget, penalty, temperature")
    partial: PartialRolloutConfig = PartialRolloutConfig()
    env_workers: int = Field(16, ge=1, description="episodes stepped concurrently (sandboxes, critics)")
    max_turns: int = Field(8, ge=1, description="most model turns of a multi-turn episode (the env may end it "
                                                "sooner); its task type's max_tokens is per turn")
    max_batch: int = Field(512, ge=1, description="most sequences decoded together")
    on_update: Literal["continue", "abort"] = Field(
        "continue", description="disaggregated: a response being generated when new weights arrive continues "
                                "under them (its tokens carry each version, as partial rollout's do) or starts "
                                "again under them (abort; multi-turn episodes always continue)")
    kv_cache_mb: int = Field(512, ge=1, description="KV-cache memory budget of each inference engine (paged: "
                                                    "sequences take blocks as they grow)")
    max_batch_tokens: int = Field(8192, ge=2, description="tokens one engine step computes: a token per decoding "
                                                         "sequence, the rest in prompt chunks")
    attention: Literal["auto", "torch", "flex", "paged", "triton"] = Field(
        "auto", description="paged attention of the native inference engines: torch gathers each sequence's "
                            "blocks; flex runs flex_attention through block masks (compiled on a GPU); paged (CPU) "
                            "decodes through a C++ kernel that reads the blocks in place, built on first use; triton "
                            "(GPU, opt-in, not yet measured on one) runs decode rows and prompt chunks through "
                            "Triton kernels that read them in place; auto: paged on CPU where the kernel builds, "
                            "torch on a GPU")
    decode_steps: int = Field(
        1, ge=1, description="native engines: decode forwards per host read (multi-step decoding; the tokens are "
                             "those of one step at a time). Above 1 the host's planning and recording no longer sit "
                             "between a GPU's steps; a sequence that ends early wastes the rest of its read, and new "
                             "ones wait for it. vLLM schedules its own steps")
    compile: bool = Field(
        False, description="native engines on GPU workers: each decoder layer's forward compiled around the paged "
                           "attention (norms, RoPE, projections and SwiGLU fused; what the decode graphs capture), "
                           "at the first forward of each shape kind, cached on disk for later processes. Not yet "
                           "measured on a GPU; vLLM compiles its own")
    max_seq_len: int | None = Field(
        None, ge=2, description="tokens per sequence (prompt + response) the KV cache is sized for; None = the "
                                "run's longest prompt + largest max_tokens (the model's context when prompts are "
                                "not known up front: multi-turn environments, the policy as critic)")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="weights of the inference engines; None = model.dtype (the trainer's master weights "
                          "are cast per bucket when they differ)")
    fp8: bool = Field(False, description="inference engines hold block-FP8 matrices (128x128 blocks with float32 "
                                         "scales, as DeepSeek-V3 and Kimi K2 ship); the trainers quantise each "
                                         "bucket, half the bytes of bf16 cross the wire")
    sleep_level: Literal[0, 1, 2, "auto"] = Field(
        "auto", description="while training: 1 frees the KV cache, 2 also the inference weights (the update "
                            "refills them), 0 keeps both; auto: 2 where the workers have GPUs, else 1")
    engine: Literal["native", "vllm", "auto"] = Field(
        "auto", description="rollout engine: native (this project's, exact against the trainer), vllm, or auto "
                            "(vLLM where it is installed and a GPU is present, else native); the choice is logged")
    vllm_memory_fraction: float = Field(
        0.2, gt=0, le=1, description="vLLM's gpu_memory_utilization: the share of the device's memory it needs "
                                     "free at start (host memory on its CPU build); it does not size the KV "
                                     "cache, which is rollout.kv_cache_mb as for the native engine")
    tensor_parallel_size: int = Field(
        1, ge=1, description="devices of one rollout replica (vLLM's tensor parallelism; needs rollout.engine: vllm): "
                             "a model too large for one GPU is served across the worker's GPUs "
                             "(cluster.gpus_per_worker must equal it on GPUs); each rank gets the full tensors of "
                             "an update and vLLM's loaders take its shard")
    expert_parallel: bool = Field(
        False, description="a mixture-of-experts replica places whole experts on its tensor-parallel ranks "
                           "(vLLM's enable_expert_parallel) instead of splitting every expert's matrices across them")


class PtxConfig(Strict):
    """PTX loss: token-mean NLL on a curated dataset, mixed into every optimizer step."""

    data: Path | None = Field(None, description="JSONL of chat samples ({messages: [...]} or {prompt, response})")
    coef: float = Field(0.0, ge=0, description="λ_ptx; 0 turns the loss off")
    batch_size: int = Field(32, ge=1, description="samples per optimizer step")


class CriticTrainingConfig(Strict):
    """Closed-loop critic refinement (report 3.2.2): the policy, as critic, judges pairs of this iteration's
    verifiable responses; each judgment is rewarded by its agreement with the verifiable rewards and trained on."""

    enabled: bool = False
    pairs: int = Field(8, ge=1, description="critic prompts (response pairs with different rewards) per iteration")
    samples: int = Field(4, ge=2, description="judgments sampled per critic prompt (K of the K1.5 baseline)")
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    rubrics: list[str] = Field(["core"], description="rubric sets shown to the critic (envs/rubrics/)")


class MismatchConfig(Strict):
    """Train–inference mismatch correction (``rl.algo.mismatch``): each sample reweighted by its ratio
    trainer/sampler."""

    correction: Literal["auto", "none", "tis", "mis"] = Field(
        "auto", description="tis: truncated importance sampling; mis: masked importance sampling; none; auto: tis "
                            "when the rollout engine is vLLM (its kernels differ from the trainer's), else none")
    level: Literal["sequence", "token"] = Field(
        "sequence", description="sequence: one ratio per response; token: per-token ratios (TIS truncates each, "
                                "MIS masks each token out of the loss)")
    cap: float = Field(2.0, gt=1, description="C: TIS truncates ratios at C; MIS keeps ratios within [1/C, C]")


class AlgorithmConfig(Strict):
    objective: Literal["k15", "grpo", "dapo"] = Field(
        "k15", description="k15: Kimi K1.5's squared-residual objective (the report's); grpo: group-normalised "
                           "advantages and a clipped per-token ratio, each response's tokens averaged; dapo: the "
                           "same with clip-higher, one token mean over the minibatch and overlong shaping "
                           "(rl.algo.objectives has the formulas)")
    tau: float = Field(1.0, gt=0, description="τ of the K1.5 objective: the weight of the log-ratio term that holds "
                       "each update near the sampling policy π_old (there is no KL to a reference model). 1.0, the "
                       "cautious end, is what the transfer suite ran on models it was not tuned on; the quick start "
                       "sets 0.2 for its own model, visibly")
    clip_low: float = Field(0.2, gt=0, lt=1, description="grpo/dapo: ε (ε_low), the ratio's lower clip 1 − ε; 0.2 is "
                            "PPO's, GRPO's and DAPO's")
    clip_high: float | None = Field(
        None, gt=0, description="grpo/dapo: ε_high, the upper clip 1 + ε_high; None: clip_low for grpo, 0.28 for dapo "
                                "(DAPO's clip-higher, which keeps unlikely tokens able to gain probability)")
    overlong_buffer: int | None = Field(
        None, ge=0, description="dapo: L_c, the tokens before a response's budget over which its reward loses up to "
                                "1 (0: off); None: a fifth of rollout.max_tokens, DAPO's ratio. Meant for budgets "
                                "far above the answers' length: with answers near max_tokens it teaches brevity "
                                "over correctness (one transfer pair lost its whole gain), so set 0 there")
    max_staleness: int | None = Field(
        None, ge=0, description="cluster.placement disaggregated: a sample is trained only if its oldest token was "
                                "sampled by weights at most this many versions behind the trainer's, and the "
                                "replicas run at most this many iterations ahead; 0 is on-policy (the colocated "
                                "loop's samples); None: 1 (colocated placement: on-policy, unset)")
    routing_replay: Literal["off", "rollout"] = Field(
        "off", description="MoE models: rollout replays in every trainer forward (π_θ, π_old, the reference) the "
                           "experts the rollout engine routed each token to, gates still the trainer's own scores "
                           "(rollout routing replay); the native rollout engine and native trainer only")
    kl_coef: float = Field(0.0, ge=0, description="grpo/dapo: β of GRPO's KL penalty against the reference policy "
                           "(the model the run started from; the trainer holds a second copy of it to score each "
                           "batch); 0, off: DAPO and most recent recipes leave it out, and the clip already bounds "
                           "each step")
    minibatches: int = Field(2, ge=1, description="optimizer steps per rollout batch: 2, the fewest at which the "
                             "τ term (or the clip) acts at all (on the first step π_θ = π_old), and the fewest moves "
                             "away from the sampler per batch of a model the defaults were not tuned on")
    micro_batch_tokens: int = Field(16384, ge=16, description="tokens (prompts + responses) packed into one "
                                    "forward/backward on each worker; a longer sequence gets a pass of its own")
    micro_batch: int | None = Field(None, ge=1, description="most sequences per forward/backward (None: only the "
                                                            "token budget bounds a micro-batch)")
    drop_equal_reward_groups: bool = Field(True, description="leave prompt groups whose K rewards are all equal out "
                                           "of the loss; an iteration with none left takes no optimizer step")
    recompute_old_logprobs: bool | Literal["auto"] = Field(
        "auto", description="the trainer recomputes log π_old before the update instead of taking the sampler's; "
                            "auto: when the trainer or the inference engines compute in bfloat16")
    ptx: PtxConfig = PtxConfig()
    critic_training: CriticTrainingConfig = CriticTrainingConfig()
    mismatch: MismatchConfig = MismatchConfig()

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.ptx.coef > 0 and self.ptx.data is None:
            raise ValueError("ptx.coef > 0 needs ptx.data (a JSONL file of chat samples)")
        if self.kl_coef > 0 and self.objective == "k15":
            raise ValueError("kl_coef > 0 is a penalty of objective grpo or dapo; K1.5's tau holds its update near "
                             "the sampler (set algorithm.objective: grpo)")
        return self


class OptimizerConfig(Strict):
    kind: Literal["muon", "adamw"] = "muon"
    lr: float = Field(1e-4, gt=0, description="for every parameter, in AdamW terms: Muon's update is scaled to "
                      "AdamW's RMS (0.2·√max(rows, cols), as Moonlight does). 1e-4 was the best rate on both model "
                      "sizes of benchmarks.lr_sweep and transfers (benchmarks.transfer); the schema's earlier 5e-4 "
                      "collapsed a Qwen2-format model; pretrained models of billions of parameters want 1e-6 to 1e-5")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay; 0: RL fine-tuning runs for hundreds "
                                "of steps, too few for decay to matter, and decay pulls a pretrained model off its "
                                "weights")
    momentum: float = Field(0.95, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0, description="clip of the global gradient norm before each step: 1.0, "
                                 "the usual, bounds what one bad batch does (Muon's update size is set by its "
                                 "orthogonalisation and lr, not by the gradient's norm)")
    qk_clip_tau: float | None = Field(100.0, gt=0, description="QK-Clip threshold τ_qk on the max attention "
                                                                "logit per head; None = no clipping (still logged)")


class TrainerConfig(Strict):
    param_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="compute dtype of forward/backward; None = model.dtype (gradients are reduced in float32)")
    master_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="master weights and optimizer state; bfloat16 loses most small updates (warned)")
    offload: bool = Field(True, description="move parameters, gradients and optimizer state to host memory "
                                            "while the inference engine runs")
    activation_checkpointing: bool = Field(False, description="keep only each decoder layer's input during the "
                                                              "forward and recompute the rest in the backward")
    attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="training attention over packed sequences: flex_attention block masks (GPU), a dense "
                            "document mask with SDPA (CPU); auto picks by device")
    compile: bool | Literal["auto"] = Field(
        False, description="compile each decoder layer's forward with torch.compile (the attention kernel and MoE "
                           "blocks stay eager), its artifacts cached across processes; auto: on GPU workers, off on "
                           "CPU ones (a CPU compile takes minutes); the native backend without model.lora only. Off "
                           "by default until a GPU check has run it (no GPU has yet)")
    expert_parallel: int = Field(
        1, ge=1, description="expert-parallel size (EP) of an MoE model: each group of this many trainer ranks "
                             "splits every MoE layer's experts between them, tokens travel to their experts by "
                             "all-to-all, and FSDP2 shards the rest over all ranks; must divide the trainer ranks "
                             "and the experts. 1: FSDP2 alone (every rank gathers each layer's experts whole)")

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.master_dtype == "bfloat16" and self.param_dtype == "float32":
            raise ValueError("master_dtype bfloat16 with param_dtype float32: compute cannot be wider than the "
                             "master weights (use master_dtype float32)")
        return self


class CheckpointEngineConfig(Strict):
    bucket_mb: float = Field(16, gt=0)

    @property
    def bucket_bytes(self) -> int:
        return max(256, int(self.bucket_mb * 2**20) // 256 * 256)


class MetricsConfig(Strict):
    prometheus_port: int | None = Field(None, ge=0, le=65535, description="serve /metrics on this port")
    loggers: list[Literal["wandb", "tensorboard", "mlflow"]] = Field(
        [], description="experiment trackers (extra `trackers`): the config, each iteration's metrics (step = "
                        "iteration), curves.png and the summary; wandb runs offline without an API key")
    project: str | None = Field(None, description="wandb project, MLflow experiment; None = run.name")
    run_name: str | None = Field(None, description="the trackers' run name; None = the run directory's name")
    wandb_entity: str | None = Field(None, description="wandb team or user; None = the API key's own")
    mlflow_tracking_uri: str | None = Field(None, description="None = $MLFLOW_TRACKING_URI, else a file store in "
                                                              "the run directory's mlruns/")


class Config(Strict):
    run: RunConfig = RunConfig()
    cluster: ClusterConfig = ClusterConfig()
    model: PolicyModelConfig = PolicyModelConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    env: EnvConfig = EnvConfig()
    envs: list[EnvConfig] = Field([], description="task mix: several environments drawn by weight; "
                                                  "empty = the single `env`")
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    trainer: TrainerConfig = TrainerConfig()
    checkpoint_engine: CheckpointEngineConfig = CheckpointEngineConfig()
    metrics: MetricsConfig = MetricsConfig()
    sandbox: SandboxOptions = Field(default_factory=SandboxOptions)

    @model_validator(mode="after")
    def _check(self) -> Config:
        a = self.warmstart.architecture
        if a.family != "deepseek_v3" and (a.hidden_size % a.num_attention_heads
                                          or a.num_attention_heads % a.num_key_value_heads):
            raise ValueError("warmstart.architecture: hidden_size must divide by num_attention_heads, "
                             "and num_attention_heads by num_key_value_heads")
        tp, gpus = self.rollout.tensor_parallel_size, self.cluster.gpus_per_worker
        if self.rollout.engine != "auto":  # the named engine's declaration (the rest of it: rl.settings.resolve)
            try:
                check_engine(self, self.rollout.engine, "set in rollout.engine")
            except UserError as e:
                raise ValueError(str(e)) from None
        if self.rollout.expert_parallel and tp < 2:
            raise ValueError("rollout.expert_parallel spreads experts over a replica's ranks: it needs "
                             "rollout.tensor_parallel_size of 2 or more")
        if self.rollout.attention == "paged" and gpus > 0:
            raise ValueError("rollout.attention: paged is the CPU decode kernel; with cluster.gpus_per_worker > 0 "
                             "use auto, torch or flex")
        if self.rollout.compile and gpus == 0:
            raise ValueError("rollout.compile: compiled layers are for GPU workers; a CPU replica's linear layers run "
                             "through oneDNN (cluster.gpus_per_worker: 0)")
        if self.rollout.attention == "triton" and gpus == 0:
            raise ValueError("rollout.attention: triton is the GPU decode kernel; with CPU workers "
                             "(cluster.gpus_per_worker: 0) use auto, torch, flex or paged")
        if gpus > 0 and gpus != int(gpus) and (gpus > 1 or self.cluster.workers > 1):
            raise ValueError(f"cluster.gpus_per_worker={gpus:g}: " + (
                "more than one GPU per worker must be a whole number (Ray places whole GPUs above one)" if gpus > 1
                else f"with {self.cluster.workers} workers Ray may place two of them on one GPU, and their trainer "
                     "ranks' NCCL group refuses two ranks on one device") + "; use whole GPUs per worker (or one "
                             "worker on a shared GPU)")
        c = self.cluster
        if self.algorithm.max_staleness is not None and c.placement == "colocated":
            raise ValueError("algorithm.max_staleness counts the weight versions separate rollout workers run ahead "
                             "of the trainer: set cluster.placement: disaggregated (colocated runs are on-policy)")
        if c.rollout_workers is not None and c.placement == "colocated":
            raise ValueError("cluster.rollout_workers: colocated workers hold one replica each (cluster.workers); "
                             "set cluster.placement: disaggregated for rollout workers of their own")
        if c.placement == "disaggregated" and gpus > 0:
            raise ValueError("cluster.placement: disaggregated runs on CPU workers for now: its point-to-point "
                             "transport stages buckets in host memory and sends them over gloo, and NCCL links "
                             "between GPU workers are not built yet; set cluster.gpus_per_worker: 0 or placement "
                             "colocated")
        if tp > 1 and gpus > 0 and gpus != tp:
            raise ValueError(f"rollout.tensor_parallel_size={tp} spans the worker's GPUs: set "
                             f"cluster.gpus_per_worker={tp} (it is {gpus:g})")
        return self

    @property
    def staleness(self) -> int | None:
        """The resolved ``algorithm.max_staleness``: None in colocated placement (on-policy), else k (default 1)."""
        if self.cluster.placement == "colocated":
            return None
        return 1 if self.algorithm.max_staleness is None else self.algorithm.max_staleness

    @property
    def rollout_dtype(self) -> str:
        """The inference engines' weight dtype."""
        return self.rollout.dtype or self.model.dtype

    @property
    def compute_dtype(self) -> str:
        """The trainer's forward/backward dtype."""
        return self.trainer.param_dtype or self.model.dtype

    def warnings(self) -> list[str]:
        """Settings that run but deserve a loud word at start (``rl train``, ``rl check-config``)."""
        out = []
        if self.trainer.master_dtype == "bfloat16":
            out.append("trainer.master_dtype is bfloat16: an update smaller than 1/256 of a weight rounds away, so "
                       "at RL learning rates most weights never change; use float32 master weights")
        if self.algorithm.recompute_old_logprobs is False and "bfloat16" in (self.compute_dtype, self.rollout_dtype):
            out.append("algorithm.recompute_old_logprobs is false with bfloat16 compute: log π_old is the sampler's, "
                       "which differs from the trainer's by about 1e-2 per token; the error enters τ·log(π_θ/π_old)")
        return out

    @property
    def env_entries(self) -> list[EnvConfig]:
        """The environments of the run: the task mix, or the single ``env``."""
        return list(self.envs) or [self.env]


def format_errors(e: ValidationError, source: str, prefix: str = "") -> str:
    """A validation error as the CLI shows it: one line per dotted key (under ``prefix``, e.g. "sandbox")."""
    lines = [f"invalid config {source}:"]
    for err in e.errors():
        key = ".".join(str(p) for p in ([prefix] if prefix else []) + list(err["loc"])) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise UserError(f"override {dotted}: {p} is not a section")
    d[leaf] = value


def parse_config(raw: Any, source: str = "<config>", overrides: list[str] = ()) -> Config:
    """Validate a parsed YAML document plus ``key.sub=value`` overrides."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"invalid config {source}: the top level must be a mapping of sections")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        _set(raw, key, yaml.safe_load(value))
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise UserError(format_errors(e, source)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read and validate a YAML config file."""
    return parse_config(read_yaml(path), str(path), overrides)


def read_yaml(path: str | Path) -> Any:
    """A config file's YAML document, unvalidated; one line when it cannot be read."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} does not exist" + (" (it is a directory)" if p.is_dir() else ""))
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"config file {p} is not text (a YAML file in UTF-8 is expected)") from None
    except OSError as e:
        raise UserError(f"cannot read config file {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UserError(f"config file {p} is not valid YAML: {e}") from None
    return raw


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
