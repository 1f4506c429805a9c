"""The weights side of the vLLM rollout engine (``engines.inference.vllm_engine``): whole loads in place, the
checkpoint engine's streamed updates (host copies fed bucket by bucket, or views of the IPC buffers), LoRA adapters
merged onto a kept base, and the host copy a restarted peer catches up to and an aborted update rolls back to (see
``vllm_engine``'s module docstring for how each reaches vLLM's workers).

``VllmWeights`` is the base of ``VllmEngine``: it expects the engine's ``llm`` (vLLM's ``LLM``), ``engine``, ``device``,
``dtype``, ``ipc_views``, ``tensor_parallel_size``, ``weight_load`` and the state ``VllmEngine.__init__`` sets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from engines.inference.base import RolloutEngine
from engines.inference.bucket_views import PieceRef
from engines.model.io.hf_io import checkpoint_index, read_tensors


class VersionMismatchError(RuntimeError):
    """A weight update's version is not the one streaming, or older than the one served."""


RELOAD_CHUNK_BYTES = 256 << 20  # a whole-model load reaches vLLM's workers in pieces of this size


def _chunks(pairs: Iterable[tuple[str, torch.Tensor]]):
    """``pairs`` in lists of about RELOAD_CHUNK_BYTES (what one ``stream_feed`` carries to the workers)."""
    chunk, size = [], 0
    for name, t in pairs:
        chunk.append((name, t))
        size += t.numel() * t.element_size()
        if size >= RELOAD_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class VllmWeights(RolloutEngine):
    """The weights of a vLLM replica: loads, streamed updates, LoRA merges, the served host copy."""

    # --- weights --------------------------------------------------------------------------

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors an update covers, in checkpoint names: the host copy of the served weights, which an update
        lands in a second such copy of and goes on into vLLM from (vLLM's own tensors cannot be written in place
        byte by byte: fused, sharded, re-packed for its kernels); with ``ipc_views``, their shapes and dtypes only
        (meta tensors, read from the checkpoint's headers), for the receiver to check its plan against."""
        if not self.ipc_views:
            return self.served_weights()
        index = checkpoint_index(self.engine.model_config.model)
        return {name: torch.empty(shape, dtype=self.dtype, device="meta") for name, (_, shape, _) in index.items()}

    def weight_placements(self) -> dict[str, tuple[str, int]]:
        """Every checkpoint tensor is its own named tensor (no fused layout on this side)."""
        return {name: (name, 0) for name in self.named_tensors()}

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load every weight in place, from pairs in checkpoint names (a stream: consumed once, in order).
        If the stream fails midway, the weights served before are loaded back (without a host copy the replica
        is left without weights) and the error re-raised."""
        kept: dict[str, torch.Tensor] = {}

        def keep(pairs):
            for name, t in pairs:
                if not self.ipc_views:
                    kept[name] = t.detach().to("cpu", self.dtype, copy=True)  # the caller may reuse its buffer
                yield name, t

        self._reload(keep(tensors))
        self._served, self.weights_version = (None if self.ipc_views else kept), version

    def swap_weights(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Serve with ``tensors`` (checkpoint names, host memory the engine may keep)."""
        self._reload(iter(tensors.items()))
        self._served, self.weights_version = (None if self.ipc_views else dict(tensors)), version

    def keep_adapter_base(self) -> None:
        """This replica serves base + LoRA adapters merged on receipt (``merge_adapters``); its base is the
        checkpoint it started from, read into host memory at the first merge."""
        if self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapter updates reach a vLLM replica of one rank (tensor_parallel_size 1): the "
                             "merged weights go to its workers through this process")

    def merge_adapters(self, adapters: Mapping[str, torch.Tensor], scaling: float, *, keep_base: bool = True) -> None:
        """Serve the base plus LoRA ``adapters`` (the trainer's names, as the native engine's ``merge_adapters``
        takes them): each adapted weight W0 + s·B·A, computed on the replica's device from a host copy of the base
        (pinned on a GPU) and loaded through vLLM's own loaders, as a whole update's tensors are; where a level-2
        sleep or a failed update left vLLM without weights, every other weight is loaded from that copy too. vLLM's
        own LoRA is not used: it wraps the layers the loaders write and adds its kernels to every decode step.
        The base copy is kept whatever ``keep_base`` says (it lives in host memory)."""
        from engines.device import host_buffer
        from engines.model.lora.adapters import AdapterMerger, adapter_pairs, merge_adapters_into

        if self._base is None:  # every weight: a level-2 sleep leaves vLLM none, and the updates carry no base
            ckpt = read_tensors(self.engine.model_config.model)
            self._base = AdapterMerger(ckpt, list(ckpt), host_buffer, self.dtype, self.device.type == "cuda").base
        base = self._base
        missing = sorted(set(adapter_pairs(adapters)) - set(base))
        if missing:
            raise ValueError(f"LoRA update: the checkpoint has no weight {missing[0]}")

        def merged():
            yield from merge_adapters_into(adapters, scaling, base, lambda name: torch.empty(
                base[name].shape, dtype=self.dtype, device=self.device))
            if not self._weights_valid:  # the rest of the weights as well, from the base
                adapted = adapter_pairs(adapters)
                yield from ((name, t) for name, t in base.items() if name not in adapted)

        if self.ipc_views:
            self._reload(merged())
            return
        loaded = dict(self.served_weights())  # the host copy: what a failed load restores, then the new one

        def kept():
            for name, t in merged():
                loaded[name] = t.to("cpu", copy=True)
                yield name, t

        self._reload(kept())
        self._served = loaded

    def _reload(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._no_adapter()
        if self._stream is not None:
            raise RuntimeError(f"update {self._stream} is streaming into vLLM; commit or abort it first")
        previous = None if self.ipc_views else self.served_weights()
        try:
            self._reload_all(pairs)
        except BaseException:
            self._restore(previous)
            raise
        self.weights_loaded()

    def _reload_all(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One load in every vLLM worker over ``pairs``, fed in chunks; raises what failed."""
        self.reloads += 1
        self.llm.collective_rpc("stream_begin", args=(-1, self.weight_load))
        try:
            for i, chunk in enumerate(_chunks(pairs)):
                self.llm.collective_rpc("stream_feed", args=(i, chunk))
        except BaseException as e:
            self.llm.collective_rpc("stream_end", args=(f"reload failed: {e}",))
            raise
        error = next((e for e in self.llm.collective_rpc("stream_end") if e is not None), None)
        if error is not None:
            raise RuntimeError(f"vLLM's {self.weight_load} load failed: {error}")

    def _restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Load ``previous`` back; None (no host copy): the replica has no valid weights until a complete update."""
        if previous is None:
            self._weights_valid = False
            return
        self._reload_all(previous.items())
        self.weights_loaded()

    # --- a streamed update (the checkpoint engine receiver's WeightStream) ----------------------

    def attach_ipc(self, handles_by_rank: list[list[tuple]]) -> list[str]:
        """Have each vLLM worker map the checkpoint engine's IPC buffers it loads from (``ipc_views``): of the
        trainer ranks' handles (one list per rank of this worker, the lead's first), those on its own GPU.
        Returns where each worker's buffers are (a GPU's UUID, or the shared-memory name)."""
        if not self.ipc_views:
            raise RuntimeError("this replica takes updates through host copies (ipc_views is off)")
        self.ipc_sources = list(self.llm.collective_rpc("ipc_attach", args=(handles_by_rank,)))
        return self.ipc_sources

    def begin(self, version: int) -> None:
        """Start update ``version`` in each vLLM worker (a reload's iterator, or direct loads, fed by the buckets)."""
        self._no_adapter()
        if self._stream is not None:
            raise VersionMismatchError(f"update {self._stream} is streaming into vLLM; update {version} "
                                       "cannot start before it commits or aborts")
        if self.weights_version is not None and version < self.weights_version:
            raise VersionMismatchError(f"update {version} is older than the served weights' {self.weights_version}")
        if "weights" in self._asleep:
            raise RuntimeError("vLLM's weights are asleep: wake_up(kv_cache=False) before an update fills them")
        if not self.ipc_views:
            self.served_weights()  # what an abort restores must exist before vLLM's weights change
        self.reloads += 1
        self.llm.collective_rpc("stream_begin", args=(version, self.weight_load))
        self._stream = version

    def feed(self, version: int, bucket: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Give vLLM the tensors bucket ``bucket`` completed (host tensors that stay untouched until the update
        ends); returns once every vLLM worker has taken them. A failed load is rolled back, then raised."""
        self._streaming(version)
        try:
            self.llm.collective_rpc("stream_feed", args=(bucket, list(tensors.items())))
        except BaseException:
            self.abort()
            raise

    def feed_views(self, version: int, bucket: int, buffer: int, pieces: list[PieceRef],
                   check: tuple[int, int]) -> None:
        """Have every vLLM worker load bucket ``bucket`` of update ``version`` from its own IPC buffer ``buffer``
        (``pieces``: where each tensor's bytes lie; ``check``: the bucket's used bytes and checksum); returns once
        they are done reading it. A failed load aborts the update, then raises."""
        self._streaming(version)
        try:
            self.llm.collective_rpc("ipc_feed", args=(bucket, buffer, pieces, check))
        except BaseException:
            self.abort()
            raise

    def commit(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """End update ``version``: vLLM finishes loading and serves ``tensors`` (the update's host copy; with
        ``ipc_views`` nothing is kept)."""
        self._streaming(version)
        self._stream = None
        error = next((e for e in self.llm.collective_rpc("stream_end") if e is not None), None)
        if error is not None:
            self._restore(None if self.ipc_views else self.served_weights())
            raise RuntimeError(f"vLLM's {self.weight_load} load of update {version} failed: {error}")
        self._served, self.weights_version = (None if self.ipc_views else dict(tensors)), version
        self.weights_loaded()

    def abort(self) -> None:
        """Stop the update streaming in (if any) and serve the weights served before it again (without a host
        copy: serve nothing until a complete update)."""
        version, self._stream = self._stream, None
        if version is None:
            return
        self.llm.collective_rpc("stream_end", args=(f"update {version} aborted",))
        self._restore(None if self.ipc_views else self.served_weights())

    @property
    def stream_log(self) -> list[tuple[str, int]]:
        """The last streamed update's ("delivered" | "taken", bucket) events in the first vLLM worker, in order:
        "taken" once it has loaded every tensor the bucket completed (a reload: and asks for more)."""
        return [tuple(e) for e in self.llm.collective_rpc("stream_log")[0]]

    def _streaming(self, version: int) -> None:
        if self._stream is None:
            raise VersionMismatchError(f"no update is streaming into vLLM (bucket of update {version})")
        if version != self._stream:
            raise VersionMismatchError(f"a bucket of update {version} reached vLLM while update "
                                       f"{self._stream} is streaming in")

    def weights_loaded(self) -> None:
        """Drop what was computed with the old weights: vLLM's prefix cache, and the vision encoder's outputs a
        vision-language model keeps per image (a later prompt with the same image would reuse them)."""
        self._weights_valid = True
        self.engine.reset_prefix_cache()
        if self.engine.model_config.is_multimodal_model:
            self.engine.reset_encoder_cache()

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The served weights under checkpoint names: the last update's, or the checkpoint vLLM started from."""
        if self.ipc_views:
            raise RuntimeError("this vLLM replica keeps no host copy of its weights (it loads updates from the "
                               "IPC buffers on its device): a restarted replica is refilled by the trainers")
        if self._served is None:
            on_disk = read_tensors(self.engine.model_config.model)
            self._served = {k: v.to(self.dtype) for k, v in on_disk.items()}
        return self._served

    def _no_adapter(self) -> None:
        if self._lora is not None:  # vLLM's LoRA wraps the layers the loaders would write
            raise RuntimeError("this vLLM engine serves a LoRA adapter; its weights take no updates")

