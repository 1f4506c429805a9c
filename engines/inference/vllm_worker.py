"""The vLLM worker extension (``worker_extension_cls``): weight updates inside each of vLLM's workers.

Two ways in, chosen per update (``stream_begin``'s ``mode``), both fed bucket by bucket through
``collective_rpc``: ``stream_begin`` starts an update, ``stream_feed`` hands it a bucket's (name, tensor)
pairs and returns once they are taken, ``stream_end`` closes (or aborts) it.

- ``direct``: each bucket goes straight into the live parameters through the model's own ``load_weights``
  (its loaders fuse q/k/v and gate/up and take a tensor-parallel rank's shard); at the end the layers are
  re-packed for vLLM's CPU kernels. For models whose layers keep the weights they load: every linear and
  embedding unquantized, no fused-MoE or latent-attention layer (``direct_load_supported``).
- ``reload``: vLLM's layer-wise in-place reload (``model_runner.reload_weights``), which rebuilds each layer
  and runs its post-load processing (quantised, MoE and MLA layers need it). It must see every weight of an
  update in one call, so it runs in a thread of this worker over an iterator the buckets feed.

On vLLM's CPU build a linear layer drops its weight once packed for oneDNN (only a reload could write it
again); this module makes it keep the weight beside the packed copy (``keep_cpu_weights``), at the cost of
the linear weights' bytes once more in host memory. Only small calls cross the process boundary, so the
same code serves a replica inside the rollout worker's process (tensor parallel 1) and one whose
tensor-parallel ranks are vLLM's own processes: each rank gets the full tensors.
"""

from __future__ import annotations

import queue
import sys
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


class _Direct:
    """One update loaded straight into the live parameters, bucket by bucket (see the module's docstring)."""

    def __init__(self, worker, version: int) -> None:
        self.worker, self.version = worker, version
        self.log: list[tuple[str, int]] = []

    def feed(self, bucket: int, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.log.append(("delivered", bucket))
        with torch.no_grad():
            self.worker.model_runner.get_model().load_weights(iter(pairs))
        self.log.append(("taken", bucket))

    def end(self, abort: str | None) -> BaseException | None:
        if abort is None:  # an aborted update is written over by the caller's restore, which repacks then
            _repack(self.worker.model_runner.get_model())
        return None


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

    def direct_load_supported(self) -> bool:
        """Whether this worker's model can take an update through ``load_weights`` into its live parameters
        (see the module's docstring); otherwise only vLLM's layer-wise reload can."""
        return direct_load_supported(self.model_runner.get_model())

    def stream_begin(self, version: int, mode: str = "reload") -> None:
        """Start update ``version`` in this worker, ``mode`` "direct" or "reload" (-1: a whole load, a
        restore, whose events the last streamed update's log does not take)."""
        if getattr(self, "_reload", None) is not None:
            raise RuntimeError(f"update {self._reload.version} is still loading in this vLLM worker")
        if mode not in ("direct", "reload"):
            raise ValueError(f"weight load mode must be 'direct' or 'reload', got {mode!r}")
        self._reload = _Direct(self, version) if mode == "direct" else _Reload(self, version)
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


def _unquantized_methods() -> tuple[type, ...]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def direct_load_supported(model: torch.nn.Module) -> bool:
    """True when every layer of ``model`` with a quantisation method is a plain linear or embedding holding
    its weight, and none is a fused-MoE or latent-attention layer (their post-load processing makes copies
    that only a reload rebuilds)."""
    plain = _unquantized_methods()
    for module in model.modules():
        kind = type(module).__name__
        if "MoE" in kind or "MLA" in kind:
            return False
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(method, plain) or weight is None or weight.numel() == 0:
            return False
    return True


def _repack(model: torch.nn.Module) -> None:
    """Rebuild the packed copies vLLM's CPU kernels compute with from the weights just loaded (on a GPU
    an unquantized layer computes with its weight itself: nothing to do)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    plain = _unquantized_methods()
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, plain):
                method.process_weights_after_loading(module)


def keep_cpu_weights() -> None:
    """On vLLM's CPU build, make linear layers keep their weight beside the packed copy their kernel uses
    (vLLM frees it), so an update can be loaded into it directly and re-packed. Idempotent; nothing to do
    on other platforms."""
    from vllm.model_executor.layers import linear
    from vllm.platforms import current_platform

    method = linear.UnquantizedLinearMethod
    if not current_platform.is_cpu() or getattr(method, "_keeps_cpu_weights", False):
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    vllms_own = method.process_weights_after_loading

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return vllms_own(self, layer)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

    method.process_weights_after_loading = process_weights_after_loading
    method._keeps_cpu_weights = True


if "vllm" in sys.modules:  # imported by vLLM as a worker's extension: before the worker loads its model
    keep_cpu_weights()
