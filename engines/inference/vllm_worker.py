"""The vLLM worker extension (``worker_extension_cls``): weight updates inside each of vLLM's workers.

vLLM's in-place reload (``model_runner.reload_weights``) must see every weight of an update in one call, so
each worker runs one reload per update in a thread of its own, over an iterator fed bucket by bucket through
``collective_rpc``: ``stream_begin`` starts it, ``stream_feed`` hands it a bucket's (name, tensor) pairs and
returns once the reload has taken them, ``stream_end`` closes (or aborts) it. Only those small calls cross
the process boundary, so the same code serves a replica inside the rollout worker's process (tensor parallel
1) and one whose tensor-parallel ranks are vLLM's own processes: each rank gets the full tensors and vLLM's
weight loaders take its shard.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

import torch

_END = object()  # ends a stream's iterator


class UpdateAbortedError(RuntimeError):
    """Raised inside vLLM's reload to stop a streamed update."""


class _Reload:
    """One in-place reload running in a thread of this worker, its iterator fed from a queue."""

    def __init__(self, worker, version: int) -> None:
        self.version = version
        self.inbox: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()
        self.log: list[tuple[str, int]] = []  # ("delivered" | "taken", bucket), in the order they happened
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(worker,), name=f"vllm-reload-{version}", daemon=True)
        self.thread.start()

    def _pairs(self):
        while (item := self.inbox.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            bucket, pairs = item
            yield from pairs
            # vLLM asks for the next pair only after it has handled the last (and processed the layers it
            # completed): the bucket's tensors are taken
            self.log.append(("taken", bucket))
            self.acks.put(bucket)

    def _run(self, worker) -> None:
        try:
            device = getattr(worker, "device", None)
            if isinstance(device, torch.device) and device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(device)
            with torch.no_grad():
                worker.reload_from(self._pairs())
        except BaseException as e:
            self.error = e
        finally:
            self.acks.put(None)  # wakes a feed that waits for an ack that will not come

    def feed(self, bucket: int, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.log.append(("delivered", bucket))
        self.inbox.put((bucket, pairs))
        if self.acks.get() is None:
            raise RuntimeError(f"vLLM's reload failed at bucket {bucket} of update {self.version}: "
                               f"{type(self.error).__name__}: {self.error}") from self.error

    def end(self, abort: str | None) -> BaseException | None:
        self.inbox.put(_END if abort is None else UpdateAbortedError(abort))
        self.thread.join()
        return self.error


class WeightLoader:
    """Mixed into each vLLM worker: in-place reloads, whole or streamed bucket by bucket."""

    def reload_from(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One in-place reload over ``weights`` in checkpoint names and layout."""
        try:
            self.model_runner.reload_weights(weights_iterator=iter(weights))
        except BaseException:
            # a stream that fails midway leaves its unfinished layers on the meta device with their loaders
            # wrapped, and the next reload would skip re-initialising them: finish them (with whatever they
            # got) so the rollback's reload starts clean
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.vllm_config.model_config)
            raise

    def stream_begin(self, version: int) -> None:
        """Start update ``version``'s reload in this worker (-1: a whole reload, a restore, whose events the
        last streamed update's log does not take)."""
        if getattr(self, "_reload", None) is not None:
            raise RuntimeError(f"update {self._reload.version} is still reloading in this vLLM worker")
        self._reload = _Reload(self, version)
        if version >= 0:
            self._reload_log: list[tuple[str, int]] = self._reload.log

    def stream_feed(self, bucket: int, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Hand the reload a bucket's tensors; returns once it has taken them (raises if it failed)."""
        self._reload.feed(bucket, pairs)

    def stream_end(self, abort: str | None = None) -> str | None:
        """Close the reload (``abort``: make it raise with that message) and wait for it; returns its failure."""
        reload, self._reload = self._reload, None
        if reload is None:
            return None
        error = reload.end(abort)
        return None if error is None else f"{type(error).__name__}: {error}"

    def stream_log(self) -> list[tuple[str, int]]:
        """The last streamed update's ("delivered" | "taken", bucket) events in this worker, in order."""
        return list(getattr(self, "_reload_log", []))
