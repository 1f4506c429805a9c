"""The rollout engine interface: what the controller and the checkpoint engine ask of an inference engine.

The controller drives requests (``add_request``/``step``/``pause``/``resume``, or ``generate``), puts the
engine to sleep while the trainer holds the device, and the checkpoint engine writes each update into
the tensors the engine names (``named_tensors``, ``weight_placements``) or hands it a set loaded aside
(``swap_weights``). A catch-up packs the weights a live engine serves (``served_weights``). The native
engine (``engines.inference.native``) implements it; a second engine is a second implementation, not a
branch in the controller.

Contract every implementation keeps:
- log-probs in completions are log softmax(logits / T) of the sampled tokens at the request's
  temperature: the π_old of the K1.5 objective;
- ``pause`` returns every unfinished request with its tokens and log-probs so far (finish_reason None),
  and ``resume`` continues them from those tokens, under whatever weights are loaded by then;
- ``sleep`` refuses while requests are unfinished; after ``sleep(2)`` the weights must be loaded
  again before generating;
- after weights change (in place or swapped), ``weights_loaded`` drops what was computed with the
  old ones (cached prefixes).

How an update from the checkpoint engine reaches the engine is the class's ``weight_update``, declared, never
probed:
- ``"swap"`` (the native engine): the receiver loads every bucket aside, into the tensors ``named_tensors`` and
  ``weight_placements`` address (or a spare set of them), and hands the complete update over at the commit with
  ``swap_weights``; the engine serves the old weights until then, and a failed update never reaches it.
- ``"stream"`` (vLLM): the engine takes the update as it arrives, one bucket at a time, into a load already
  running: ``begin(version)``, one ``feed(version, bucket, tensors)`` per completed bucket (host tensors it may
  keep until the update ends), then ``commit(version, tensors)`` (serve the whole update from now on) or
  ``abort()`` (serve the weights served before it again). ``named_tensors`` is then the host copy the receiver
  fills. These four methods are part of the interface for "stream" engines; a "swap" engine refuses them.
  A stream engine with ``ipc_views`` instead maps the checkpoint engine's IPC buffers itself (``attach_ipc``) and
  loads each bucket where it lies (``feed_views`` in place of ``feed``), keeping no copy of the weights:
  ``abort()`` then leaves it without weights until a complete update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch

from engines.inference.capabilities import EngineCapabilities
from engines.inference.requests import Completion, Progress, TokenLogprob
from engines.inference.sampling import InvalidRequestError, SamplingParams


class RolloutEngine(ABC):
    """An inference engine the controller and the checkpoint engine can drive (see the module docstring)."""

    #: the engine's name in ``rollout.engine``
    kind: str
    #: what it supports: its kind's entry of ``engines.inference.capabilities`` (readable without the engine)
    capabilities: ClassVar[EngineCapabilities]
    #: how a weight update reaches it: loaded aside then ``swap_weights``, or streamed by ``begin``/``feed``/``commit``
    weight_update: ClassVar[Literal["swap", "stream"]]
    #: where the engine computes
    device: torch.device
    #: tokens one sequence may hold, prompt and response together
    max_seq_len: int
    #: tokens sampled over the engine's life: the partial-rollout budget is counted in them
    generated: int
    #: request ids handed out when the caller gives none
    _ids: Iterator[int]
    #: the engine's seed: requests without their own seed derive theirs from it (``request_seed``)
    _seed: int

    # --- requests -------------------------------------------------------------------------

    @abstractmethod
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, prior: Sequence[int] = (),
                    prior_logprobs: Sequence[float] = (), request_id: int | None = None,
                    images: Sequence[Any] = ()) -> int:
        """Queue a request (``prior``: tokens already generated for it; ``images``: one per image placeholder of
        the prompt, on engines with ``capabilities.multimodal_inputs``); raises InvalidRequestError and queues
        nothing when it cannot be served."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is queued or decoding."""

    @abstractmethod
    def step(self) -> list[Completion]:
        """Advance every unfinished request by one engine step; returns those that finished."""

    @abstractmethod
    def pause(self) -> list[Completion]:
        """Stop every unfinished request and return it with its tokens so far (finish_reason None)."""

    @abstractmethod
    def progress(self, since: Mapping[int, int]) -> dict[int, Progress]:
        """What each unfinished request among ``since``'s ids generated from its token ``since[id]`` on (what a
        server streams between steps: only the new tokens, so a long stream costs the same per step)."""

    @abstractmethod
    def prompt_logprobs(self, token_ids: Sequence[int], top: int = 0) -> list[TokenLogprob | None]:
        """Each token's log-probability under the served model given the ones before it (None for the first,
        which has nothing before it), with the ``top`` most likely tokens at each position: a prompt scored, not
        generated from. Raises InvalidRequestError when the tokens cannot be read."""

    def request_seed(self, params: SamplingParams, request_id: int) -> int:
        """The request's own seed, or one derived from the engine's and the request id: the same rule in every
        engine, so a request without a seed draws the same stream whichever engine serves it."""
        return params.seed if params.seed is not None else (self._seed * 1_000_003 + request_id) % 2**63

    def resume(self, partials: Iterable[Completion]) -> list[int]:
        """Continue paused requests from their tokens (after a weight update their prefix is recomputed
        with the new weights); returns their ids."""
        ids = []
        for c in partials:
            if c.finish_reason is not None or c.params is None:
                raise InvalidRequestError(f"request {c.request_id} is not a paused request")
            ids.append(self.add_request(c.prompt_ids, c.params, prior=c.token_ids, prior_logprobs=c.logprobs,
                                        request_id=c.request_id, images=c.images))
        return ids

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 seed: int | None = None, on_finish: Callable[[Completion], None] | None = None,
                 images: Sequence[Sequence[Any]] | None = None) -> list[Completion]:
        """Run prompts to completion, results in the prompts' order. A request that cannot be served gets
        finish_reason "error" and its reason, and the others still run. ``seed`` seeds the requests without
        their own seed by their index in this call (reproducible batches); ``images``: each prompt's images."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        if seed is not None:
            plist = [p if p.seed is not None else replace(p, seed=(seed * 1_000_003 + i) % 2**63)
                     for i, p in enumerate(plist)]
        out: dict[int, Completion] = {}
        order = []
        for n, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            try:
                order.append(self.add_request(prompt, p, images=images[n] if images is not None else ()))
            except InvalidRequestError as e:
                rid = next(self._ids)
                order.append(rid)
                out[rid] = Completion([], [], "error", list(prompt), error=str(e), request_id=rid, params=p)
        while self.has_unfinished():
            for c in self.step():
                out[c.request_id] = c
                if on_finish:
                    on_finish(c)
        return [out[r] for r in order]

    # --- colocation -----------------------------------------------------------------------

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (1), or the KV cache and the weights (2), while the trainer uses the device."""

    @abstractmethod
    def wake_up(self, kv_cache: bool = True) -> None:
        """Take back what ``sleep`` freed (after level 2 the weights must be loaded again); ``kv_cache=False``: the
        weights first, for an update to fill (a second ``wake_up()`` takes the rest back)."""

    @property
    @abstractmethod
    def sleeping(self) -> int:
        """0 when awake, else the level of the last ``sleep``."""

    # --- weights --------------------------------------------------------------------------

    @abstractmethod
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors an update writes into, by the engine's own names (each storage once)."""

    @abstractmethod
    def weight_placements(self) -> dict[str, tuple[str, int]]:
        """Checkpoint tensor name -> (the engine's own tensor holding it, byte offset inside that tensor)."""

    @abstractmethod
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the served weights by their checkpoint names, whatever the engine's layout."""

    @abstractmethod
    def swap_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Serve with ``tensors`` (by the engine's own names), a complete update loaded aside."""

    def merge_adapters(self, adapters: Mapping[str, torch.Tensor], scaling: float, *, keep_base: bool = True) -> None:
        """Serve the base plus LoRA ``adapters`` (by the trainer's names, ``...lora_A.weight`` / ``...lora_B.weight``)
        at ``scaling`` = alpha / rank (``keep_base`` False: merged once for good, no base copy kept); an engine that
        does not take adapter updates refuses in one line."""
        raise NotImplementedError(f"{type(self).__name__} does not take LoRA adapter updates (model.lora)")

    def keep_adapter_base(self) -> None:
        """A LoRA run's replica: keep the base that ``merge_adapters`` merges onto through sleeps and failed updates
        (the adapters' updates carry none)."""
        raise NotImplementedError(f"{type(self).__name__} does not take LoRA adapter updates (model.lora)")

    @abstractmethod
    def weights_loaded(self) -> None:
        """Declare the weights changed and valid: drop what was computed with the old ones."""

    @abstractmethod
    def served_weights(self) -> dict[str, torch.Tensor]:
        """The weights being served, under the checkpoint's names (what a restarted replica catches up to)."""

    # --- a streamed update (weight_update "stream") ---------------------------------------------

    def begin(self, version: int) -> None:
        """Start taking update ``version`` as its buckets arrive."""
        self._not_streaming("begin")

    def feed(self, version: int, bucket: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the tensors bucket ``bucket`` of update ``version`` completed (host tensors, untouched until the
        update ends); a failed load is rolled back, then raised."""
        self._not_streaming("feed")

    def commit(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """End update ``version``: serve ``tensors`` (every weight, the update's) from now on."""
        self._not_streaming("commit")

    def abort(self) -> None:
        """Drop the update streaming in, if any, and serve the weights served before it."""
        self._not_streaming("abort")

    #: a stream engine that loads each bucket from the IPC buffers itself (``attach_ipc``, ``feed_views``)
    ipc_views: bool = False

    def attach_ipc(self, handles_by_rank: list[list[tuple]]) -> list[str]:
        """Map the checkpoint engine's IPC buffers (one list of handles per trainer rank of the worker)."""
        self._not_streaming("attach_ipc")
        return []

    def feed_views(self, version: int, bucket: int, buffer: int, pieces: list, check: tuple[int, int]) -> None:
        """Load bucket ``bucket`` of update ``version`` from IPC buffer ``buffer``, where ``pieces`` say."""
        self._not_streaming("feed_views")

    def _not_streaming(self, method: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes weight updates by {self.weight_update!r}, not by "
                                  f"stream: it has no {method}()")

    # --- counters -------------------------------------------------------------------------

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Life-time counters: prefix-cache tokens found and computed, KV blocks, preemptions, tokens."""

    @abstractmethod
    def reset_peaks(self) -> None:
        """Start a new phase for the peak counters (``stats()["kv_blocks_peak"]``)."""

    @abstractmethod
    def mapped_bytes(self) -> int:
        """Device bytes held outside torch's caching allocator, which its peak counters do not see."""

    def close(self) -> None:
        """Release what the engine holds beyond Python objects (processes, threads); nothing by default."""
        return None
