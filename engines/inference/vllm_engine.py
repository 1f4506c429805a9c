"""vLLM as a rollout engine: the same interface as the native engine (``engines.inference.base``).

vLLM runs inside the rollout worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the worker owns
the engine core, steps it itself (partial rollout needs step-level control) and reaches the model
through ``collective_rpc`` without a process hop. Per-request sampling parameters and seeds, stop
tokens and stop strings map onto vLLM's; log-probs are vLLM's "processed" ones, log softmax(logits / T)
of the sampled token as the native engine reports (with top-k/top-p they are renormalised over the kept
tokens, where the native engine's are not).

Pause and resume: ``pause`` aborts every unfinished request and returns its tokens so far; ``resume``
submits prompt + those tokens as a new prompt for the remaining budget (vLLM's prefix cache finds the
prefix while the weights are unchanged). A resumed request's random stream restarts from a seed
derived from its own and the number of tokens it has, so a resumed run is reproducible, though not
token-for-token the uninterrupted one as with the native engine.

Device and arguments (``engines.inference.vllm_setup``): the device is vLLM's platform's, checked against the one
the run gave the replica (a GPU run with vLLM's CPU build installed stops with one line); on a GPU vLLM captures
decode-only CUDA graphs and runs with sleep mode, on a CPU it runs eager.

Weights: ``load_weights`` takes (name, tensor) pairs in checkpoint names and loads them into vLLM in place,
in one of two ways (``weight_load``, see ``engines.inference.vllm_worker``): ``direct``, through the model's
own ``load_weights`` into the live parameters (vLLM's loaders fuse q/k/v and gate/up; on its CPU build the
layers are re-packed at the end), for dense unquantized models; ``reload``, vLLM's layer-wise in-place
reload, which rebuilds each layer and must see every weight in one call (MoE, latent attention, quantised
layers). ``auto`` picks direct where the model allows it.

Through the checkpoint engine, an update is a stream (``begin``, a feed per bucket, ``commit``, ``abort``, the
receiver's ``WeightStream``), and it reaches vLLM's workers one of two ways:

- ``ipc_views`` (the default on a GPU): each vLLM worker maps the checkpoint engine's IPC buffers of the trainer
  rank on its own GPU (``attach_ipc``) and loads every bucket from device views of it (``feed_views``: only the
  bucket's piece list crosses to the workers). No host round trip and no host copy of the weights: an update
  that fails midway leaves the replica without weights until the next complete one (``consistent`` then stays
  false), a restarted replica is refilled by the trainers rather than copied from a peer, and vLLM starts on
  placeholder weights (``load_format="dummy"``) that the trainers' start-up stream fills.
- host copies (the default on a CPU): the engine keeps a host copy of the weights it serves under checkpoint
  names (``served_weights``), what a restarted replica catches up to and what an aborted update rolls back to;
  ``feed`` hands every vLLM worker the tensors a bucket completed (the receiver's own host copies, never views
  of the IPC buffer: a reload keeps a tensor until its layer is complete) and returns once they have taken
  them. An abort stops the update, then loads the served weights back.

Tensor parallel (``tensor_parallel_size`` > 1): vLLM runs its ranks as processes of its own; with ``ipc_views``
each rank reads the bucket from its own GPU's trainer rank's buffer, otherwise each gets the full tensors through
the engine's process; either way its weight loaders take the rank's shard.

A PEFT LoRA adapter (``adapter``: its directory and rank, ``rl serve --adapter``) is served through vLLM's own
LoRA: ``enable_lora`` with the smallest ``max_lora_rank`` vLLM takes at or above the adapter's, and the adapter's
``LoRARequest`` on every request (tested on the CPU build against peft). Such an engine takes no weight updates.

Sleep (a GPU): level 1 offloads the weights to host memory and frees the KV cache, level 2 frees both; waking
takes two steps where an update comes between (``wake_up(kv_cache=False)``: the weights, which the update fills,
then ``wake_up()``: the KV cache), so the update never needs the KV cache's memory.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines.inference.capabilities import VLLM
from engines.inference.requests import Completion, Progress, TokenLogprob, check_prompt, check_request
from engines.inference.sampling import InvalidRequestError, SamplingParams
from engines.inference.vllm_setup import (
    VllmUnavailableError,
    check_platform,
    engine_args,
    import_vllm,
    platform_device,
    wake_tags,
)
from engines.inference.vllm_weights import VllmWeights
from engines.inference.vllm_worker import UpdateAbortedError
from engines.model.images import decoded

__all__ = ["UpdateAbortedError", "VllmEngine", "VllmUnavailableError", "vllm_available"]


#: The ranks vLLM's ``max_lora_rank`` takes (an adapter of rank r is served with the smallest at least r).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class UnsupportedByVllmError(ValueError):
    """vLLM has no implementation of the model's architecture."""


def vllm_available() -> bool:
    """Whether ``import vllm`` works in this environment."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(kw_only=True)
class _Live:
    """A request inside vLLM: what the caller asked and what came back so far."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    prior: list[int]
    prior_logprobs: list[float]
    images: list = field(default_factory=list)  # decoded, kept for a paused request's resumption
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def completion(self, reason: str | None, stop_reason: int | str | None = None) -> Completion:
        return Completion(self.prior + self.tokens, self.prior_logprobs + self.logprobs, reason, list(self.prompt),
                          stop_reason=stop_reason, request_id=self.rid, params=self.params, images=self.images)


class VllmEngine(VllmWeights):
    """A vLLM ``LLMEngine`` of ``model_dir`` behind the rollout engine interface.

    ``eos_ids`` are the tokens that end a response (the tokenizer's, as the native engine takes them);
    ``kv_cache_bytes`` sizes the KV cache as the native engine's budget does (None: vLLM sizes it from
    ``memory_fraction``, its ``gpu_memory_utilization``, of host memory on a CPU build, less what this
    process already holds, which makes it depend on the process's history); without
    ``tokenizer`` the directory needs none (token ids in and out; stop strings are then refused). ``device``: the
    one the run gave the replica (None: whatever vLLM's platform is); ``graphs``: decode-only CUDA graphs on a
    GPU (None: on); ``ipc_views``: updates load from views of the IPC buffers, no host copy kept (None: on a
    GPU); ``fill_later``: the trainers fill the replica before it serves (vLLM starts on placeholder weights
    where ``ipc_views`` is on, since no host copy needs the checkpoint).
    """

    kind = "vllm"
    capabilities = VLLM
    weight_update = "stream"  # each bucket goes on into a running reload (begin/feed/commit/abort)

    def __init__(self, model_dir: str | Path, eos_ids: Sequence[int], *, max_seq_len: int | None = None,
                 max_num_seqs: int = 256, dtype: str = "auto", seed: int = 0, kv_cache_bytes: int | None = None,
                 memory_fraction: float = 0.2,
                 tensor_parallel_size: int = 1, expert_parallel: bool = False, graphs: bool | None = None,
                 prefix_caching: bool = True, weight_load: str = "auto",
                 tokenizer: bool = True, device: str | None = None, ipc_views: bool | None = None,
                 fill_later: bool = False, adapter: tuple[str, int] | None = None, record_routes: bool = False) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = self._vllm = import_vllm()  # an untested release is refused before it is imported or patched
        if weight_load not in ("auto", "direct", "reload"):
            raise ValueError(f"weight_load must be auto, direct or reload, got {weight_load!r}")
        from engines.inference.vllm_worker import patch_cpu_build

        patch_cpu_build()  # before vLLM builds the model in this process (tensor parallel 1)
        actual = platform_device()
        check_platform(device, actual)
        self.device = torch.device(actual)
        if tensor_parallel_size > 1 and self.device.type == "cpu":
            # vLLM's CPU build pins each rank's threads to a NUMA node of its own by default and refuses when the
            # machine has fewer nodes than ranks; unpinned, the ranks share the cores
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            # an engine started earlier in this process froze vLLM's environment (vllm.envs caches every variable
            # once a service is up), and a frozen "auto" would still bind
            getattr(vllm.envs, "disable_envs_cache", lambda: None)()
        self.tensor_parallel_size = tensor_parallel_size
        self.eos_ids = [int(e) for e in eos_ids]
        self.ipc_views = self.device.type == "cuda" if ipc_views is None else ipc_views
        dummy = fill_later and self.ipc_views
        self.args = engine_args(str(model_dir), device=self.device.type, dtype=dtype, max_seq_len=max_seq_len,
                                max_num_seqs=max_num_seqs, seed=seed, kv_cache_bytes=kv_cache_bytes,
                                memory_fraction=memory_fraction, tensor_parallel_size=tensor_parallel_size,
                                expert_parallel=expert_parallel, prefix_caching=prefix_caching, tokenizer=tokenizer,
                                graphs=graphs is not False, dummy=dummy)
        self._moe_layers: list[int] | None = None  # record_routes: the decoder layers whose routes completions carry
        if record_routes:  # vLLM's own capture (engines.inference.vllm_routes)
            from engines.inference.vllm_routes import OPTION, RUNNER_V2_ENV, routes_unsupported
            from engines.model.io.hf_io import read_config

            why = routes_unsupported(self.device.type)
            if why is not None:
                raise ValueError(f"record_routes: {why}")
            cfg = read_config(model_dir)
            self._moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
            if not self._moe_layers:
                raise ValueError("record_routes: this model has no mixture-of-experts layers to record")
            os.environ[RUNNER_V2_ENV] = "1"
            getattr(vllm.envs, "disable_envs_cache", lambda: None)()
            self.args[OPTION] = True
        self._lora = None  # a PEFT adapter (directory, rank) applied to every request through vLLM's LoRA
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            ranks = [r for r in LORA_RANKS if r >= adapter[1]]
            if not ranks:
                raise ValueError(f"LoRA rank {adapter[1]} is above vLLM's largest ({LORA_RANKS[-1]})")
            self.args.update(enable_lora=True, max_loras=1, max_lora_rank=ranks[0])
            self._lora = LoRARequest(Path(adapter[0]).name or "adapter", 1, str(adapter[0]))
        try:
            self.llm = vllm.LLM(**self.args)
        except Exception as e:
            if "not supported" in str(e) and "rchitecture" in str(e):
                raise UnsupportedByVllmError(f"vLLM does not support this model's architecture ({e}); set "
                                             "rollout.engine: native") from None
            raise
        self.engine = self.llm.llm_engine
        mc = self.engine.model_config
        self.vocab_size, self.context, self.dtype = mc.get_vocab_size(), mc.max_model_len, mc.dtype
        self.max_seq_len = max_seq_len or self.context
        self._seed, self._detokenizes = seed, tokenizer
        self._ids = itertools.count()
        self._live: dict[str, _Live] = {}
        self._finished: list[Completion] = []  # finished while a prompt was scored, returned by the next step
        self._scores = itertools.count()  # ids of scoring requests
        self._sleep_level = 0
        self._asleep: set[str] = set()  # what a sleep freed and no wake_up took back yet: "weights", "kv_cache"
        self._weights_valid = not dummy  # placeholder weights are not served
        self._served: dict[str, torch.Tensor] | None = None  # host copy in checkpoint names, made on demand
        self._base: dict[str, torch.Tensor] | None = None  # LoRA in a run: the base merge_adapters merges from
        self._stream: int | None = None  # the version of the update streaming in, if any
        self.weights_version: int | None = None  # of the last streamed update; None: the start-up checkpoint's
        self.reloads = 0  # loads into vLLM (one per update, whole load or restore), over the engine's life
        self.generated = 0
        self.peak_running = 0
        self.peak_blocks = 0
        # in process, the scheduler's block pool is at hand: KV blocks in use, as the native engine counts them
        core = getattr(self.engine.engine_core, "engine_core", None)
        self._blocks = getattr(getattr(getattr(core, "scheduler", None), "kv_cache_manager", None), "block_pool", None)
        direct = all(self.llm.collective_rpc("direct_load_supported"))
        if weight_load == "direct" and not direct:
            raise ValueError("weight_load direct: this model has layers vLLM must rebuild after loading (MoE, "
                             "latent attention or quantised); use reload or auto")
        self.weight_load = "direct" if weight_load == "auto" and direct else weight_load.replace("auto", "reload")

    # --- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, prior: Sequence[int] = (),
                    prior_logprobs: Sequence[float] = (), request_id: int | None = None,
                    images: Sequence[Any] = ()) -> int:
        """Queue a request (``prior``: tokens already generated for it; ``images``: one per placeholder of the
        prompt's template ids, which vLLM expands itself, as ``engines.model.images.ImageRef`` or PIL images); raises
        InvalidRequestError and queues nothing when it cannot be served."""
        prompt = check_request(prompt_ids, params, prior, prior_logprobs, vocab=self.vocab_size, context=self.context,
                               max_seq_len=self.max_seq_len, detokenizes=self._detokenizes,
                               step_top_logprobs=self.capabilities.step_top_logprobs)
        structured = None
        if params.grammar is not None:  # vLLM compiles the same xgrammar source with its own backend
            source = getattr(params.grammar, "source", None)
            if source is None:
                raise InvalidRequestError(f"{params.grammar!r} has no source vLLM can compile; use the native engine")
            structured = self._vllm.sampling_params.StructuredOutputsParams(**{source[0]: source[1]})
        rid = next(self._ids) if request_id is None else request_id
        if str(rid) in self._live:
            raise InvalidRequestError(f"request id {rid} is already running")
        seed = self.request_seed(params, rid)
        if prior:  # a resumed request: a fresh stream for the rest, reproducible from what it has
            seed = (seed * 1_000_003 + len(prior)) % 2**63
        sp = self._vllm.SamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_tokens - len(prior), seed=seed % 2**31, logprobs=0, stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_ids),
            ignore_eos=True,  # the model's own EOS is among stop_token_ids unless ignore_eos
            detokenize=bool(params.stop),
            # each step's new tokens only: a cumulative output would be re-read whole at every step
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA, structured_outputs=structured)
        request = {"prompt_token_ids": prompt + [int(t) for t in prior]}
        pil = [decoded(im) for im in images]  # an ImageRef decodes here, on the worker
        if pil:
            request["multi_modal_data"] = {"image": pil}
        try:
            self.engine.add_request(str(rid), request, sp, lora_request=self._lora)
        except ValueError as e:  # vLLM's checks of the prompt's images (count, size, a text-only model)
            raise InvalidRequestError(f"request {rid}: {str(e).splitlines()[0]}") from None
        self._live[str(rid)] = _Live(rid=rid, prompt=prompt, params=params, prior=[int(t) for t in prior],
                                     prior_logprobs=[float(x) for x in prior_logprobs], images=pil)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._live or self._finished)

    def step(self) -> list[Completion]:
        """One engine step; returns the requests that finished (and those that finished while a prompt was
        scored)."""
        self._check_awake()
        finished, self._finished = self._finished, []
        self.peak_running = max(self.peak_running, len(self._live))
        outs = self._engine_step()
        if self._blocks is not None:
            self.peak_blocks = max(self.peak_blocks, self._blocks.num_gpu_blocks - self._blocks.get_num_free_blocks())
        return finished + self._record(outs)

    def _engine_step(self) -> list:
        """vLLM's step, on the calling thread with OpenMP's thread count settled first."""
        # OpenMP keeps its thread count per thread, and torch sets a new thread's count lazily, at its first
        # parallel op. vLLM's CPU attention sizes its scheduler metadata before that op and checks the count
        # again in the kernel after it: a step on a fresh thread (a server's loop, a Ray concurrency group) would
        # fail its check ("thread_num 1 vs. 2") whenever torch's count is not the environment's.
        torch.get_num_threads()
        return self.engine.step()

    def _record(self, outs) -> list[Completion]:
        """Add a step's new tokens to their requests; returns those that finished."""
        finished = []
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            c = out.outputs[0]
            self.generated += len(c.token_ids)
            live.tokens += c.token_ids
            live.logprobs += [next(iter(d.values())).logprob for d in (c.logprobs or [])][: len(c.token_ids)]
            if out.finished:
                del self._live[out.request_id]
                reason = "length" if c.finish_reason == "length" else "stop"
                finished.append(live.completion(reason, c.stop_reason if reason == "stop" else None))
                if self._moe_layers is not None:
                    from engines.inference.vllm_routes import moe_routes

                    finished[-1].routed_experts = moe_routes(c.routed_experts, self._moe_layers)
        return finished

    def progress(self, since: Mapping[int, int]) -> dict[int, Progress]:
        """What each unfinished request among ``since``'s ids generated from its token ``since[id]`` on."""
        live = ((s, self._live.get(str(rid)), rid) for rid, s in since.items())  # slices: nothing copied whole
        return {rid: Progress(s, x.prior[s:] + x.tokens[max(s - len(x.prior), 0):], x.prior_logprobs[s:] +
                              x.logprobs[max(s - len(x.prior), 0):]) for s, x, rid in live if x is not None}

    def prompt_logprobs(self, token_ids: Sequence[int], top: int = 0) -> list[TokenLogprob | None]:
        """Each token's log-probability given the ones before it (None for the first) and the ``top`` most likely
        tokens at its position: vLLM's prompt log-probs of a one-token request. The engine steps until it is
        done; requests finishing meanwhile are returned by the next ``step``."""
        self._check_awake()
        ids = check_prompt(token_ids, vocab=self.vocab_size, context=self.context)
        if len(ids) >= self.max_seq_len:  # vLLM scores a prompt with a request that needs room for one token
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; vLLM scores at most {self.max_seq_len - 1} "
                                      f"(max_seq_len {self.max_seq_len} less one)")
        rid = f"score-{next(self._scores)}"
        sp = self._vllm.SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=top, detokenize=False,
                                       output_kind=self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY)
        self.engine.add_request(rid, {"prompt_token_ids": ids}, sp, lora_request=self._lora)
        done = None
        while done is None:
            outs = self._engine_step()
            done = next((o for o in outs if o.request_id == rid and o.finished), None)
            self._finished += self._record(o for o in outs if o.request_id != rid)
        scores: list[TokenLogprob | None] = [None]
        for t, d in zip(ids[1:], done.prompt_logprobs[1:], strict=True):
            best = sorted(((k, v.logprob) for k, v in d.items() if v.rank <= top), key=lambda kv: -kv[1])
            scores.append(TokenLogprob(d[t].logprob, best[:top]))
        return scores

    def pause(self) -> list[Completion]:
        """Stop every unfinished request; returns each with its tokens so far (finish_reason None)."""
        if self._live:
            self.engine.abort_request(list(self._live))
        out = [live.completion(None) for live in self._live.values()]
        self._live.clear()
        return out

    # --- colocation -----------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (1) or the KV cache and the weights (2); on a CPU build vLLM gives no memory
        back (its sleep mode needs CUDA), but the state is kept so the contract holds."""
        if level not in (levels := self.capabilities.sleep_levels):
            raise ValueError(f"sleep level must be {' or '.join(map(str, levels))}, got {level}")
        if self.has_unfinished():
            raise RuntimeError(f"{len(self._live)} requests unfinished; pause() them before sleep()")
        if self.device.type == "cuda":
            self.llm.sleep(level=level)
        self._sleep_level, self._asleep = level, {"weights", "kv_cache"}
        if level == 2:
            self._weights_valid = False

    def wake_up(self, kv_cache: bool = True) -> None:
        """Take back what ``sleep`` freed; ``kv_cache=False``: the weights only (the first step of a two-step
        wake: an update may fill them now, and ``wake_up()`` takes the KV cache back after it)."""
        tags = wake_tags(self._asleep, kv_cache)
        if tags == []:
            return
        if self.device.type == "cuda":
            self.llm.wake_up(tags=tags)
        self._asleep -= set(tags or self._asleep)
        if not self._asleep:
            self._sleep_level = 0

    @property
    def sleeping(self) -> int:
        """The level of the last sleep while anything it freed is still asleep, else 0."""
        return self._sleep_level

    @property
    def asleep(self) -> frozenset[str]:
        """What is still asleep: "weights", "kv_cache" (empty when awake)."""
        return frozenset(self._asleep)

    def close(self) -> None:
        """Stop vLLM's engine core and its worker processes (tensor-parallel ranks). vLLM then resets its
        process-wide distributed state, so another vLLM engine in this process stops working: one per process."""
        self.engine.engine_core.shutdown()

    # --- counters -------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Tokens generated, KV blocks (vLLM's pool) and the most in use, the most requests running at once.
        Prefix-cache and preemption counters stay vLLM's own (its metrics), reported here as 0."""
        blocks = self._blocks.num_gpu_blocks if self._blocks is not None else 0
        return {"prefix_hit_tokens": 0, "prefix_miss_tokens": 0, "preemptions": 0, "kv_blocks": blocks,
                "kv_blocks_peak": self.peak_blocks, "generated_tokens": self.generated,
                "running_peak": self.peak_running}

    def reset_peaks(self) -> None:
        self.peak_running = self.peak_blocks = 0

    def mapped_bytes(self) -> int:
        return 0

    # --- internals ------------------------------------------------------------------------

    def _check_awake(self) -> None:
        if self._stream is not None:  # half of vLLM's layers are being replaced
            raise RuntimeError(f"update {self._stream} is streaming into vLLM; generate after it ends")
        if self._asleep:
            raise RuntimeError(f"inference engine is asleep ({', '.join(sorted(self._asleep))}); call wake_up() first")
        if not self._weights_valid:
            raise RuntimeError("no weights to serve (discarded by sleep(level=2), never loaded, or an update failed "
                               "midway); load weights before generating")
