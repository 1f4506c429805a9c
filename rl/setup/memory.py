"""Memory per worker of a run, estimated before anything is allocated (``rl check-config``, ``rl train``), and
the per-GPU memory plan of training + inference colocation for large models (``rl memory-plan``).

Counts what the colocated worker holds: the trainer's shard (master weights, gradients and optimizer state, 1/workers
of each under FSDP2), the decoder layer FSDP gathers in the compute dtype, the activations of one micro-batch
(``algorithm.micro_batch_tokens`` packed tokens: with ``trainer.activation_checkpointing`` each layer's input and one
layer's working set, otherwise every layer's working set) and the chunked log-probability blocks; the inference
engine's full replica in the rollout dtype and its paged KV cache (``rollout.kv_cache_mb``, all of it, in blocks; how
many sequences it holds depends on their lengths, at worst ``max_seq_len`` tokens each). Activations are an estimate
from the layer shapes (the tensors each layer keeps for its backward), not a measurement. With
``trainer.expert_parallel`` e > 1 each group of e ranks splits every MoE layer's E experts (E/e apiece to compute),
and the ranks / e ranks computing the same ones store them sharded, whole experts (``stored_experts``: about E/ranks
each; a rank holds 1/ranks of the rest); FSDP gathers the layers without their experts, and the all-to-all buffers
and the experts each MoE layer gathers and keeps for its backward come instead. On a GPU the phases take turns
(``trainer.offload`` moves the trainer to host memory while the engine generates, ``rollout.sleep_level`` frees the
cache, and at 2 the replica, while the trainer steps), so the peak is the larger phase; on CPU everything shares RAM.

A vLLM replica has rows of its own (``vllm_rows``): the CUDA graph pool of its decode-only graphs (one decode step's
working set at the largest captured batch; it is not part of vLLM's sleep mode and stays resident while the trainer
steps), the working set of its largest forward (a prefill of ``max_num_batched_tokens``, and the sampler's float32
logits), host copies of the weights where it takes updates through them (two full copies, the served one and the
update's, none with IPC views), and, with IPC views, the device bytes of tensors split across buckets while an update
streams in (about one bucket per trainer rank). With vLLM the weight update is a phase of its own: the replica, that
staging, the checkpoint engine's three buckets and, unless the wake is two-step (level 2), the KV cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engines.inference.capabilities import capabilities_of
from engines.inference.factory import EngineSettings
from engines.inference.kv_cache import BLOCK_SIZE, bytes_per_slot, bytes_per_token, gather_bytes, paged_pool
from engines.model.hf.spec import ModelDescription
from engines.model.lora.adapters import LoraSpec
from engines.model.lora.quant import BYTES_PER_WEIGHT
from engines.model.native.arch import ModelConfig
from engines.model.sharded import chunk_rows
from rl.config import Config, parse_config
from rl.errors import UserError
from rl.settings import RunSettings, check_expert_parallel, parallel_dims, resolve, sleep_level

GiB = 2**30


@dataclass(kw_only=True)
class ModelShape:
    """What the memory arithmetic needs of a model, counted on the meta device (free for any size)."""

    params: int
    muon_params: int
    largest_layer: int          # parameters of the largest decoder layer (what FSDP gathers at once)
    largest_layer_experts: int  # of which routed experts (what expert parallelism would leave sharded)
    root_params: int            # embeddings, output head, final norm (the root FSDP unit)
    layers: int
    hidden: int
    vocab: int
    layer_activations: int      # elements one layer keeps per token for its backward (largest layer)
    adapter_params: int = 0     # LoRA: the adapters' parameters (``params`` is then the frozen base)
    adapter_muon_params: int = 0  # of which Muon would take (the factors of rank 2 and more)
    adapted_params: int = 0     # LoRA: the frozen weights of the adapted projections (kept in the serving dtype)
    expert_params: int = 0      # routed experts of every MoE layer (of ``params``): what expert parallelism splits
    expert_muon_params: int = 0  # of which Muon takes (the stacked expert matrices)
    largest_dense_part: int = 0  # the largest decoder layer without its routed experts (what FSDP gathers under EP)
    num_experts: int = 0        # routed experts per MoE layer
    top_k: int = 0              # experts each token visits (its rows the all-to-alls carry under EP)

    @classmethod
    def of(cls, arch: ModelConfig | ModelDescription, lora: LoraSpec | None = None) -> ModelShape:
        """The shape of a native architecture, or of a transformers model (``engines.model.hf.spec.describe``),
        both counted on the meta device; with ``lora`` its adapters are counted apart from the frozen base."""
        from engines.model.hf.backend import empty_hf_model
        from engines.model.hf.spec import decoder_layers
        from engines.model.native.causal_lm import build_model
        from engines.training.param_roles import muon_params

        if isinstance(arch, ModelDescription):
            model = empty_hf_model(arch.hf_config)  # parameters on meta: only the rotary tables are computed
        else:
            model = build_model(arch, device="meta")  # shapes only: a 1 T-parameter config costs nothing here
        adapters = 0, 0, 0
        if lora is not None:
            from engines.model.lora.adapters import apply_lora

            paths = apply_lora(model, lora)  # on meta: the adapters' shapes only
            trainable = [p for p in model.parameters() if p.requires_grad]
            muon = muon_params(model)
            adapters = (sum(p.numel() for p in trainable), sum(p.numel() for p in trainable if id(p) in muon),
                        sum(model.get_submodule(p).weight.numel() for p in paths))
        params = [p for p in model.parameters() if not p.requires_grad] if lora is not None else \
            list(model.parameters())
        muon = muon_params(model)
        per_layer = [(sum(p.numel() for p in layer.parameters()),
                      sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}"))
                     for layer in decoder_layers(model)]
        largest = max(per_layer)
        # routed experts by name, as in per_layer (".shared_experts." does not match: shared experts are dense)
        experts = [p for n, p in model.named_parameters() if ".experts." in f".{n}"]
        return cls(params=sum(p.numel() for p in params), muon_params=sum(p.numel() for p in params if id(p) in muon),
                   largest_layer=largest[0], largest_layer_experts=largest[1], layers=arch.num_hidden_layers,
                   root_params=sum(p.numel() for p in params) - sum(n for n, _ in per_layer),
                   hidden=arch.hidden_size, vocab=arch.vocab_size, largest_dense_part=max(n - e for n, e in per_layer),
                   layer_activations=max(layer_activations(arch, i) for i in range(arch.num_hidden_layers)),
                   adapter_params=adapters[0], adapter_muon_params=adapters[1], adapted_params=adapters[2],
                   expert_params=sum(p.numel() for p in experts), num_experts=arch.num_experts if arch.is_moe else 0,
                   expert_muon_params=sum(p.numel() for p in experts if id(p) in muon),
                   top_k=arch.num_experts_per_tok if arch.is_moe else 0)


def check_expert_layout(arch: ModelConfig | ModelDescription, ep: int, ranks: int, lora: bool = False) -> None:
    """Refuse ``--expert-parallel`` ``ep`` for ``arch`` on ``ranks`` trainer ranks in one line (ValueError), by the
    rules a run's ``trainer.expert_parallel`` meets (``rl.settings.check_expert_parallel``)."""
    if ep < 1:
        raise ValueError(f"--expert-parallel must be at least 1, got {ep}")
    if ep == 1:
        return
    if lora:
        raise ValueError("--expert-parallel: LoRA trains adapters on a frozen base; use 1 with --lora")
    cfg = parse_config({"cluster": {"workers": ranks}, "trainer": {"expert_parallel": ep}})
    hf = isinstance(arch, ModelDescription)
    try:
        check_expert_parallel(cfg, arch, arch.largest_layer_experts > 0 if hf else arch.is_moe,
                              "transformers" if hf else "native")
    except UserError as e:  # the same rule, named as the flag that set it
        raise ValueError(str(e).replace("trainer.expert_parallel", "--expert-parallel")) from None


def layer_activations(arch: ModelConfig | ModelDescription, layer: int) -> int:
    """Elements decoder layer ``layer`` keeps per token for its backward: the normalised inputs of its two
    blocks, q/k/v and the attention output (and MLA's latents), the SwiGLU's gate, up and product (once per
    routed expert a token visits, plus the shared experts), the residual stream, the router's scores."""
    d = arch.hidden_size
    if arch.is_mla:
        h = arch.num_attention_heads
        qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        latents = arch.kv_lora_rank + arch.qk_rope_head_dim + (arch.q_lora_rank or 0)
        attn = h * qk * 2 + h * arch.v_head_dim * 2 + latents
    else:
        hd = arch.head_dim
        attn = arch.num_attention_heads * hd * 2 + arch.num_key_value_heads * hd * 2
    if arch.is_moe_layer(layer):
        inter = arch.moe_intermediate_size or arch.intermediate_size
        mlp = 3 * inter * (arch.num_experts_per_tok + arch.n_shared_experts) + arch.num_experts
    else:
        mlp = 3 * arch.intermediate_size
    return 3 * d + attn + mlp


def activation_bytes(shape: ModelShape, tokens: int, compute_bytes: int, checkpointing: bool) -> int:
    """Activations of one micro-batch of ``tokens`` packed tokens through the model, forward to backward."""
    one_layer = tokens * shape.layer_activations * compute_bytes
    if checkpointing:  # each layer's input, and one layer recomputed at a time (twice: its gradients too)
        return shape.layers * tokens * shape.hidden * compute_bytes + 2 * one_layer
    return shape.layers * one_layer


def logprob_bytes(tokens: int, vocab: int) -> int:
    """The chunked log-probabilities' float32 blocks (the backward holds two of [tokens, chunk] at once)."""
    from engines.model.logprobs import vocab_chunk

    return 2 * tokens * vocab_chunk(tokens, vocab) * 4


@dataclass
class VllmRows:
    """What a vLLM replica holds beyond its weights and KV cache, per device (see the module)."""

    graphs: int = 0        # the decode graphs' pool, resident in every phase
    forward: int = 0       # its largest forward's working set (the rollout phase)
    host_copies: int = 0   # host copies of the weights (no IPC views): the served copy and the update's
    staging: int = 0       # device bytes of split tensors while an update streams in (IPC views)


def forward_bytes(arch: ModelConfig, tokens: int, rows: int, dtype_bytes: int, tp: int = 1) -> int:
    """One inference forward of ``tokens`` tokens, ``rows`` of which are sampled: the residual stream and a layer's
    largest intermediate (the MLP's gate, up and their product, or q/k/v and the attention output; a tensor-parallel
    rank holds 1/``tp`` of them), and the sampled rows' logits in the model's dtype and twice in float32 (vLLM's
    sampler and its processed log-probs)."""
    if arch.is_moe:
        experts = arch.num_experts_per_tok + arch.n_shared_experts  # the experts a token visits
        inter = (arch.moe_intermediate_size or arch.intermediate_size) * experts
    else:
        inter = arch.intermediate_size
    if arch.is_mla:
        attn = arch.num_attention_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim + arch.v_head_dim) * 2
    else:
        attn = (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    per_token = 2 * arch.hidden_size + -(-max(3 * inter, attn) // tp)
    return tokens * per_token * dtype_bytes + rows * arch.vocab_size * (dtype_bytes + 8)


def vllm_rows(arch: ModelConfig, params: int, cfg: Config, engine: EngineSettings, trainer_ranks: int) -> VllmRows:
    """The rows of a vLLM replica of ``arch`` (``params`` parameters) as ``engine`` describes it (see the module),
    per device, updated by ``trainer_ranks`` trainer ranks."""
    b = _itemsize(engine.dtype)
    tp = engine.tensor_parallel_size
    full = params * b  # the whole replica: host copies are in checkpoint names, unsharded
    gpu = engine.device == "cuda"
    prefill = max(8192, engine.max_seq_len or 0)  # vLLM's max_num_batched_tokens (engines.inference.vllm_setup)
    largest = arch.vocab_size * arch.hidden_size * b  # the embedding, a tensor larger than most buckets
    bucket = cfg.checkpoint_engine.bucket_bytes
    split = max(largest if largest > bucket else 0, bucket * trainer_ranks if trainer_ranks > 1 else 0)
    staging = min(full // tp, split)
    return VllmRows(graphs=forward_bytes(arch, engine.max_num_seqs, engine.max_num_seqs, b, tp) if gpu else 0,
                    forward=forward_bytes(arch, prefill, engine.max_num_seqs, b, tp),
                    host_copies=0 if engine.ipc_views else 2 * full,
                    staging=staging if engine.ipc_views else 0)


@dataclass(kw_only=True)
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
    activations: int = 0   # one micro-batch's activations, the gathered layer and the log-prob blocks
    host_pinned: int = 0   # GPU: page-locked host memory (offloaded trainer, sleeping replica, rollback journal)
    decode_work: int = 0   # the torch attention path's gathered keys/values and scores of the widest decode step
    checkpoint: int = 0    # one checkpoint on disk (model and trainer state)
    run_dir: int = 0       # the run directory at its fullest (see run_dir_bytes)
    engine: str = "native"  # the rollout engine counted ("auto": not resolved, counted as native)
    vllm: VllmRows | None = None  # a vLLM replica's own rows (None: the native engine)
    adapters: int = 0      # LoRA adapters' parameters (gradients and optimizer state are theirs alone)
    #: disaggregated placement: bytes of one worker of each role ("trainer worker", "rollout worker"), each a
    #: process of its own (None: colocated, both roles in one worker)
    roles: dict[str, int] | None = None
    expert_parallel: int = 1  # trainer.expert_parallel: the routed experts split over ep, stored over trainer_ranks
    trainer_ranks: int = 1
    experts: int = 0       # routed experts per MoE layer

    def table(self) -> str:
        rows = [("parameters", f"{self.params / 1e6:,.1f} M")]
        if self.adapters:
            rows.append(("LoRA adapters (trained)", f"{self.adapters / 1e6:,.3f} M"))
        ep = self.expert_parallel
        shard = "shard" if ep == 1 else f"shard: experts {stored_experts(self.experts, ep, self.trainer_ranks)} of " \
            f"{self.experts} per layer, the rest 1/{self.trainer_ranks}"
        rows += [(f"trainer weights ({shard}" + (", frozen base + adapters)" if self.adapters else ")"),
                  _gib(self.trainer_weights)),
                 (f"trainer gradients ({shard})", _gib(self.trainer_grads)),
                 (f"optimizer state ({shard})", _gib(self.optimizer)),
                 ("activations (one micro-batch, est.)", _gib(self.activations)),
                 ("inference replica", _gib(self.replica)),
                 (f"KV cache ({self.kv_sequences} seqs x {self.max_seq_len} tokens)", _gib(self.kv_cache)),
                 ("decode attention working set", _gib(self.decode_work))]
        if self.vllm is not None:
            v = self.vllm
            rows += [("vLLM CUDA graph pool (stays while asleep, est.)", _gib(v.graphs)),
                     ("vLLM largest forward (est.)", _gib(v.forward)),
                     ("vLLM update staging on the device (split tensors)", _gib(v.staging)),
                     ("vLLM host copies of the weights (no IPC views)", _gib(v.host_copies))]
        if self.roles:
            rows += [(f"disaggregated: per {role}, CPU", _gib(n)) for role, n in self.roles.items()]
        rows += [("peak per worker, GPU phases", _gib(self.device_peak)),
                ("pinned host memory per worker, GPU", _gib(self.host_pinned)),
                ("total per worker, CPU", _gib(self.host_total))]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v:>12}" for k, v in rows)


def _gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB"


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def trainer_bytes(shape: ModelShape, ranks: int, master_dtype: str, optimizer: str, base_dtype: str | None = None,
                  frozen_dtype: str | None = None, expert_parallel: int = 1) -> tuple[int, int, int]:
    """(master weights, gradients, optimizer state) per rank of an FSDP2 trainer over ``ranks``. With LoRA
    (``shape.adapter_params``) the weights are the adapted projections' frozen weights in ``base_dtype`` (the
    serving dtype, or QLoRA's "nf4"/"int8"), the rest of the frozen model in ``frozen_dtype`` (default the master
    dtype; the compute dtype when a LoRA run computes in another), the adapters in the master dtype, and only
    they have gradients and optimizer state. With ``expert_parallel`` e > 1 a rank stores whole routed experts,
    ``stored_experts`` of each MoE layer's at most (what a plan must hold), and 1/``ranks`` of the rest."""
    master = _itemsize(master_dtype)
    shard = lambda b: -(-b // ranks)  # noqa: E731
    lora = shape.adapter_params > 0
    if expert_parallel > 1:
        if lora:
            raise ValueError("expert parallel trains the whole model; LoRA trains adapters on a frozen base")
        dense, dense_muon = shape.params - shape.expert_params, shape.muon_params - shape.expert_muon_params
        share, n = stored_experts(shape.num_experts, expert_parallel, ranks), shape.num_experts
        split = lambda d, e: shard(d) + -(-e * share // n)  # noqa: E731
        weights = split(dense * master, shape.expert_params * master)
        return weights, weights, split(_states(dense, dense_muon, optimizer) * master,
                                       _states(shape.expert_params, shape.expert_muon_params, optimizer) * master)
    n, n_muon = (shape.adapter_params, shape.adapter_muon_params) if lora else (shape.params, shape.muon_params)
    states = _states(n, n_muon, optimizer)
    # QLoRA: base_dtype "nf4" or "int8", bytes per weight rather than a dtype
    adapted = -int(-shape.adapted_params * BYTES_PER_WEIGHT[base_dtype]) if base_dtype in BYTES_PER_WEIGHT else \
        shape.adapted_params * _itemsize(base_dtype or master_dtype)
    frozen = adapted + (shape.params - shape.adapted_params) * _itemsize(frozen_dtype or master_dtype)
    weights = frozen + n * master if lora else n * master
    return shard(weights), shard(n * master), shard(states * master)


def stored_experts(experts: int, expert_parallel: int, ranks: int) -> int:
    """The most of a MoE layer's ``experts`` a rank stores (``torch.chunk`` of E/e over ranks/e: ⌈E/ranks⌉)."""
    return chunk_rows(experts // expert_parallel, ranks // expert_parallel)[0]


def _states(n: int, n_muon: int, optimizer: str) -> int:
    """Optimizer state elements of ``n`` parameters, ``n_muon`` of them Muon's: Muon keeps one momentum per
    element, AdamW two moments."""
    return n_muon * 1 + (n - n_muon) * 2 if optimizer == "muon" else n * 2


def run_dir_bytes(shape: ModelShape, model_dtype: str, master_dtype: str, optimizer: str,
                  keep_checkpoints: int) -> tuple[int, int]:
    """(one checkpoint, the run directory at its fullest), in bytes. A checkpoint holds the model in its own dtype
    (Hugging Face safetensors) and the trainer's whole state (master weights and optimizer state, every rank's
    shard); the run directory holds ``keep_checkpoints`` of them, one more while the next is written, ``best/`` (a
    checkpoint) and ``final/`` (the model alone)."""
    weights, grads, opt = trainer_bytes(shape, 1, master_dtype, optimizer)
    model = shape.params * _itemsize(model_dtype)
    # LoRA: a checkpoint holds the adapters (PEFT's file, the model's dtype) and their trainer state; the base is
    # the model the run started from; final/ is the merged model
    checkpoint = shape.adapter_params * _itemsize(model_dtype) + grads + opt if shape.adapter_params else \
        model + weights + opt
    return checkpoint, (keep_checkpoints + 2) * checkpoint + model


def training_working_set(shape: ModelShape, tokens: int, compute_dtype: str, checkpointing: bool, sharded: bool,
                         expert_parallel: int = 1, master_dtype: str | None = None, ranks: int = 1) -> int:
    """Activations, the log-prob blocks, and (sharded) what FSDP gathers in the compute dtype: the root and two
    decoder layers (one computing, the next prefetched). With ``expert_parallel`` e > 1 over ``ranks`` ranks FSDP
    gathers the layers without their routed experts (``expert_working_set`` has what the experts add)."""
    cb = _itemsize(compute_dtype)
    work = activation_bytes(shape, tokens, cb, checkpointing) + logprob_bytes(tokens, shape.vocab)
    if expert_parallel > 1:
        gathered = (2 * shape.largest_dense_part + shape.root_params) * cb
        return work + gathered + expert_working_set(shape, tokens, compute_dtype, checkpointing, expert_parallel,
                                                    master_dtype or compute_dtype, ranks)
    gathered = (2 * shape.largest_layer + shape.root_params) * cb if sharded else 0
    return work + gathered


def expert_working_set(shape: ModelShape, tokens: int, compute_dtype: str, checkpointing: bool,
                       expert_parallel: int, master_dtype: str, ranks: int) -> int:
    """What expert parallelism e over ``ranks`` ranks adds to a rank's training working set: the all-to-alls of
    ``tokens`` tokens, the E/e experts each MoE layer computes as its backward keeps them, one layer's gather."""
    if ranks % expert_parallel:
        raise ValueError(f"expert parallel {expert_parallel} does not divide {ranks} ranks")
    cb, mb = _itemsize(compute_dtype), _itemsize(master_dtype)
    # dispatch and combine: tokens x top_k rows each way, about as many received as sent (balanced routing)
    exchange = 2 * tokens * shape.top_k * shape.hidden * cb
    n, r = shape.num_experts, ranks // expert_parallel
    computed, one = n // expert_parallel, shape.largest_layer_experts // n  # one expert of one layer
    # kept per MoE layer: the computed experts' compute-dtype casts; with no cast the gathered master-dtype experts
    # themselves (r = 1: the stored parameters, nothing extra); one layer's at a time when the layers are recomputed
    # (activation checkpointing), every MoE layer's otherwise
    kept = cb if master_dtype != compute_dtype else mb if r > 1 else 0
    layers = 1 if checkpointing else shape.expert_params // shape.largest_layer_experts
    # one layer's gather in flight, in the master dtype: the gathered experts and the all-gather's padded r shares
    # (forward), or their gradients and the reduce-scatter's padded input (backward, as large)
    flight = (computed + r * stored_experts(n, expert_parallel, ranks)) * one * mb if r > 1 else 0
    return exchange + computed * one * layers * kept + flight


def estimate(cfg: Config, arch: ModelConfig | ModelDescription, max_seq_len: int,
             engine: EngineSettings | None = None, lora: LoraSpec | None = None) -> MemoryEstimate:
    """Bytes per worker of a run of ``cfg`` on a model of ``arch`` with KV caches of ``max_seq_len`` tokens (per GPU
    where a worker's replica spans several: each holds a trainer rank and a replica rank). ``engine``: the run's
    replica as resolved (``rl.settings``); without it the config is read as written, "auto" counted as the native
    engine's torch attention path (the largest decode working set). ``lora``: the run's adapters as resolved
    (``TrainerSettings.lora``): gradients and optimizer state of the adapters only, the base in the rollout dtype."""
    shape = ModelShape.of(arch, lora)
    # trainer ranks: one per worker, or one per GPU of a worker whose replica spans its GPUs (rl.loop.cluster)
    dims = parallel_dims(cfg)
    workers, ep = dims.world, dims.ep
    if ep > 1:  # refused as rl.settings refuses it, in one line (callers may not have resolved the settings)
        check_expert_parallel(cfg, arch, shape.expert_params > 0,
                              "transformers" if isinstance(arch, ModelDescription) else "native")
    compute_dtype, rollout_dtype_name = cfg.compute_dtype, cfg.rollout_dtype
    opt_kind = cfg.model.lora.optimizer if lora is not None and cfg.model.lora is not None else cfg.optimizer.kind
    sharded = workers > 1 or (compute_dtype != cfg.trainer.master_dtype and lora is None)
    # LoRA on one rank keeps its adapted weights in the serving dtype, and the whole frozen model in the compute dtype
    # when that is not the master's; sharded (FSDP2) the frozen base is in the master dtype (rl.loop.workers)
    lora_mixed = lora is not None and compute_dtype != cfg.trainer.master_dtype
    base, frozen = (None, None) if sharded else \
        (compute_dtype, compute_dtype) if lora_mixed else (rollout_dtype_name, None)
    if lora is not None and lora.quantize_base is not None:  # QLoRA (one rank): the adapted weights quantized
        base = lora.quantize_base
    weights, grads, opt = trainer_bytes(shape, workers, cfg.trainer.master_dtype, opt_kind, base, frozen, ep)
    work = training_working_set(shape, cfg.algorithm.micro_batch_tokens, compute_dtype,
                                cfg.trainer.activation_checkpointing, sharded, ep, cfg.trainer.master_dtype, workers)
    # per device: a tensor-parallel replica's ranks hold a shard each (and a KV cache of rollout.kv_cache_mb each)
    replica = shape.params * _itemsize(rollout_dtype_name) // cfg.rollout.tensor_parallel_size
    rollout_dtype = getattr(torch, rollout_dtype_name)
    per_seq = bytes_per_slot(arch, max_seq_len, rollout_dtype)
    _, kv = paged_pool(arch, cfg.rollout.kv_cache_mb << 20, rollout_dtype)  # the engine takes the whole budget
    seqs = min(cfg.rollout.max_batch, kv // per_seq)  # sequences of the full max_seq_len it holds at least
    # a KL penalty's reference policy: a second copy of the master weights' shard, offloaded with the trainer
    trainer = weights + grads + opt + (weights if cfg.algorithm.kl_coef > 0 else 0)
    level, decode = sleep_level(cfg)[0], 0
    kind = engine.kind if engine is not None else cfg.rollout.engine
    attention = engine.attention if engine is not None else cfg.rollout.attention
    if kind == "vllm" and engine is None:  # as written: resolved the way rl.settings would on these workers
        engine = _vllm_settings(cfg, max_seq_len)
    vllm = vllm_rows(arch, shape.params, cfg, engine, workers) if kind == "vllm" and engine is not None else None
    # flex and the CPU kernel read the pool in place, and vLLM reads its own; unresolved, auto is counted as torch
    if attention in ("auto", "torch") and kind != "vllm":
        # every row is gathered at the widest one's length, which the pool also bounds; each row holds a block
        tokens = kv // bytes_per_token(arch, rollout_dtype)
        width, rows = min(max_seq_len, tokens), min(cfg.rollout.max_batch, max(1, tokens // BLOCK_SIZE))
        if cfg.cluster.gpus_per_worker > 0:  # a captured step's width is a power of two (cuda_graphs.bucket)
            width = max(64, 1 << (max(width, 1) - 1).bit_length())
        decode = gather_bytes(arch, rows, width, rollout_dtype)
    resident = 0 if cfg.trainer.offload else trainer
    graphs = vllm.graphs if vllm is not None else 0  # vLLM's sleep mode does not free its graph pool
    rollout_phase = replica + kv + decode + resident + (graphs + vllm.forward if vllm is not None else 0)
    train_phase = trainer + work + (replica if level < 2 else 0) + (kv if level == 0 else 0) + graphs
    # a vLLM update: the replica, the split tensors, the checkpoint engine's H2D and two IPC buffers, and the KV cache
    # unless the wake is two-step (level 2: it comes back after the update)
    update_phase = replica + vllm.staging + 3 * cfg.checkpoint_engine.bucket_bytes + resident + graphs + \
        (kv if level < 2 else 0) if vllm is not None else 0
    # on a GPU these wait in page-locked host memory (engines.device.host_buffer, exact sizes): the trainer while
    # offloaded, the replica while asleep at level 1, and the native engine's rollback journal, as large as the replica
    # (vLLM keeps none: its host copies, where it has them, are pageable); a LoRA replica also keeps its base there, to
    # merge the adapters from (at most the whole replica: level 2)
    base_copy = replica if shape.adapter_params else 0
    pinned = (trainer if cfg.trainer.offload else 0) + (replica if level == 1 else 0) + \
        (replica if vllm is None else 0) + base_copy
    copies = vllm.host_copies if vllm is not None else 0
    checkpoint, run_dir = run_dir_bytes(shape, cfg.model.dtype, cfg.trainer.master_dtype, opt_kind,
                                        cfg.run.keep_checkpoints)
    roles = None
    if cfg.cluster.placement == "disaggregated":
        # each role a process of its own: the trainer with its two point-to-point slots; the replica with the spare
        # copy an update loads into while it serves (vLLM: its host copies), its KV cache and two receive buffers
        slots = 2 * cfg.checkpoint_engine.bucket_bytes
        roles = {"trainer worker": trainer + work + slots,
                 "rollout worker": replica + (copies if vllm is not None else replica) + kv + decode + slots}
    return MemoryEstimate(params=shape.params, trainer_weights=weights, trainer_grads=grads, optimizer=opt,
                          replica=replica, kv_cache=kv, kv_sequences=seqs, kv_per_sequence=per_seq,
                          max_seq_len=max_seq_len, device_peak=max(rollout_phase, train_phase, update_phase),
                          host_total=trainer + work + replica + kv + decode + copies + base_copy +
                          (vllm.forward if vllm is not None else 0),
                          activations=work, host_pinned=pinned if cfg.cluster.gpus_per_worker > 0 else 0,
                          decode_work=decode, checkpoint=checkpoint, run_dir=run_dir, engine=kind, vllm=vllm,
                          adapters=shape.adapter_params, roles=roles, expert_parallel=ep, trainer_ranks=workers,
                          experts=shape.num_experts)


def _vllm_settings(cfg: Config, max_seq_len: int) -> EngineSettings:
    """The vLLM replica ``cfg`` describes, where the caller has no resolved settings (as ``rl.settings`` would
    make them: IPC views on GPU workers)."""
    r, gpu = cfg.rollout, cfg.cluster.gpus_per_worker > 0
    return EngineSettings(kind="vllm", model_dir="", device="cuda" if gpu else "cpu", dtype=cfg.rollout_dtype,
                          fp8=False, max_seq_len=max_seq_len, max_num_seqs=r.max_batch,
                          kv_cache_bytes=r.kv_cache_mb << 20, max_batch_tokens=r.max_batch_tokens, attention="torch",
                          seed=0, tensor_parallel_size=r.tensor_parallel_size, expert_parallel=r.expert_parallel,
                          memory_fraction=r.vllm_memory_fraction, ipc_views=capabilities_of("vllm").ipc_views and gpu)


def estimate_run(cfg: Config) -> tuple[MemoryEstimate, RunSettings]:
    """The estimate for ``cfg`` as ``rl train`` would start it: the model of ``model.path`` (or the warm
    start's architecture) and the KV length the run's prompts need (see ``rollout.max_seq_len``); and the run's
    settings as resolved for it."""
    from pathlib import Path

    from engines.model.io.hf_io import ModelDirError
    from engines.model.native.arch import make_config
    from engines.model.text.tokenizer import TextTokenizer
    from rl.rollout.data import load_task_sets, rollout_seq_len
    from rl.settings import model_arch
    from rl.setup.warmstart import cache_root, model_dir_here, warmstart_key

    model_dir = model_dir_here(cfg)
    if cfg.model.path is not None and model_dir is None:
        raise UserError(f"model.path: {cfg.model.path} is not on this machine yet (the run fetches it at start)")
    model_dir = model_dir or cache_root() / f"warmstart-{warmstart_key(cfg)}"
    why = None
    try:
        if cfg.model.path is None and not (Path(model_dir) / "config.json").is_file():
            raise ModelDirError(f"{model_dir}: the warm start is not built yet")
        arch, why = model_arch(cfg, model_dir)  # the backend model.backend resolves to, and why
    except ModelDirError:
        a = cfg.warmstart.architecture  # not built yet: its architecture, and the model's context as KV length
        arch = make_config(a.family, vocab_size=cfg.warmstart.vocab_size, bos_token_id=None, eos_token_id=None,
                           pad_token_id=None, **a.hf_kwargs())
        seq = cfg.rollout.max_seq_len or arch.max_position_embeddings
    else:
        seq = cfg.rollout.max_seq_len
        if seq is None and (Path(model_dir) / "tokenizer.json").is_file():
            tok = TextTokenizer.load(model_dir, cfg.model.chat_template)
            seq = rollout_seq_len(cfg, load_task_sets(cfg), tok, arch.max_position_embeddings)
        seq = seq or arch.max_position_embeddings
    settings = resolve(cfg, arch, str(model_dir), seq, why)
    return estimate(cfg, arch, seq, settings.rollout.engine, settings.trainer.lora), settings


def _ram() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
    return _ram() // cfg.cluster.workers, "RAM"


def check_fits(cfg: Config, est: MemoryEstimate) -> None:
    """Refuse a run that cannot fit, naming the setting to change."""
    if est.kv_sequences < 1:
        raise UserError(f"rollout.kv_cache_mb: {cfg.rollout.kv_cache_mb} MiB holds no sequence of "
                        f"{est.max_seq_len} tokens ({_gib(est.kv_per_sequence)} each); raise "
                        "rollout.kv_cache_mb or lower rollout.max_seq_len")
    # the pinned buffers live on this machine only when it runs the GPU workers itself
    if est.host_pinned and cfg.cluster.ray_address is None and torch.cuda.is_available():
        ram = _ram() // cfg.cluster.workers
        if est.host_pinned > ram:
            raise UserError(f"a worker pins about {_gib(est.host_pinned)} of host memory (offloaded trainer, "
                            f"sleeping replica, rollback journal) but has {_gib(ram)} of RAM; set "
                            "trainer.offload: false or rollout.sleep_level: 2, or use fewer workers per machine")
    if est.roles and cfg.cluster.ray_address is None and cfg.cluster.gpus_per_worker == 0:
        _check_roles_fit(cfg, est.roles)
        return
    have = available_per_worker(cfg)
    if have is None:
        return
    limit, what = have
    if cfg.cluster.gpus_per_worker > 0 and est.engine == "vllm":
        _check_vllm_start(cfg, est, limit // cfg.cluster.gpus_per_worker)
    if (per := parallel_dims(cfg).ranks_per_worker) > 1:  # the estimate is of one GPU of the worker's
        limit, what = limit // per, "memory on each of its GPUs"
    need = est.device_peak if cfg.cluster.gpus_per_worker > 0 else est.host_total
    if need <= limit:
        return
    shards = "cluster.workers (shards the trainer" + (", whole experts over all the ranks too)"
                                                      if est.expert_parallel > 1 else ")")
    parts = {"rollout.kv_cache_mb": est.kv_cache, "rollout.dtype": est.replica,
             shards: est.trainer_weights + est.trainer_grads + est.optimizer,
             "rollout.attention (flex and paged read the cache in place; torch gathers it)": est.decode_work}
    knob = max(parts, key=parts.get)
    raise UserError(f"a worker needs about {_gib(need)} but has {_gib(limit)} of {what}; the largest part is "
                    f"{_gib(parts[knob])} set by {knob} (activations come on top)")


def _check_roles_fit(cfg: Config, roles: dict[str, int]) -> None:
    """A disaggregated run on this machine: its trainer and rollout workers together within its RAM."""
    c = cfg.cluster
    count = {"trainer worker": c.workers, "rollout worker": c.rollout_workers or c.workers}
    need, ram = sum(count[r] * n for r, n in roles.items()), _ram()
    if need > ram:
        parts = " + ".join(f"{count[r]} {r}s x {_gib(n)}" for r, n in roles.items())
        raise UserError(f"cluster.placement: disaggregated needs about {_gib(need)} of RAM ({parts}) but this "
                        f"machine has {_gib(ram)}; lower cluster.rollout_workers or cluster.workers, or "
                        "rollout.kv_cache_mb")


def kv_shortfall(cfg: Config, est: MemoryEstimate) -> str | None:
    """A warning (None: none) when each worker's KV cache holds under half the sequences it may decode at once: its
    share of an iteration's prompts x samples, at most ``rollout.max_batch``, each as long as ``max_seq_len`` at
    worst. The rest wait (or are preempted and computed again), and the rollout runs at a fraction of its speed."""
    r = cfg.rollout
    share = -(-r.prompts_per_iteration * r.samples_per_prompt // cfg.cluster.workers)
    running = min(r.max_batch, share)
    if 2 * est.kv_sequences >= running:
        return None
    need = -(-running * est.kv_per_sequence // 2**20)
    return (f"rollout.kv_cache_mb: {r.kv_cache_mb} MiB holds {est.kv_sequences} sequences of {est.max_seq_len} tokens, "
            f"but each of the {cfg.cluster.workers} workers decodes up to {running} at once "
            f"({r.prompts_per_iteration} prompts x {r.samples_per_prompt} samples over {cfg.cluster.workers} workers, "
            f"at most rollout.max_batch): the rest wait; raise rollout.kv_cache_mb toward {need} MiB, lower "
            "rollout.prompts_per_iteration or rollout.max_batch, or add workers")


def _check_vllm_start(cfg: Config, est: MemoryEstimate, per_gpu: int) -> None:
    """vLLM refuses to start unless ``gpu_memory_utilization`` of the GPU is free then; a replica started (or
    replaced) while the run is rolling out shares its first GPU with the trainer, resident unless offloaded."""
    fraction = cfg.rollout.vllm_memory_fraction
    resident = 0 if cfg.trainer.offload else est.trainer_weights + est.trainer_grads + est.optimizer
    free = per_gpu - resident
    if fraction * per_gpu > free:
        raise UserError(f"rollout.vllm_memory_fraction: {fraction} asks vLLM to find {_gib(int(fraction * per_gpu))} "
                        f"free on a GPU of {_gib(per_gpu)} when it starts, but the trainer holds {_gib(resident)} "
                        f"there (trainer.offload: false); set it to at most {free / per_gpu:.2f} or offload the "
                        "trainer")
