"""The vLLM worker extension (``worker_extension_cls``): weight updates inside each of vLLM's workers.

Two ways in, chosen per update (``stream_begin``'s ``mode``), both fed bucket by bucket through
``collective_rpc``: ``stream_begin`` starts an update, ``stream_feed`` hands it a bucket's (name, tensor)
pairs and returns once they are taken, ``stream_end`` closes (or aborts) it. Both run inside vLLM's config
scope (``set_current_vllm_config``), as vLLM's own ``reload_weights`` does: layers' loaders and post-load
processing read the current config, and vLLM 0.33 raises where none is set.

Where the bucket comes from, per replica: the engine's process hands each worker the tensors themselves
(``stream_feed``: host tensors, pickled to workers in processes of their own); or each worker reads the bucket
where it lies (``ipc_attach`` once, then ``ipc_feed`` per bucket with the bucket's piece list, a few hundred
bytes): the checkpoint engine's IPC buffer of the trainer rank on this worker's own device (chosen by GPU UUID),
loaded from device views of it (``engines.inference.bucket_views``): no host round trip, and a tensor-parallel
rank reads its own GPU's copy of the bucket instead of receiving full tensors through the engine's process.

- ``direct``: each bucket goes straight into the live parameters through the model's own ``load_weights``
  (its loaders fuse q/k/v and gate/up and take a tensor-parallel rank's shard); at the end the layers are
  re-packed for vLLM's CPU kernels. For models whose layers keep the weights they load: every linear and
  embedding unquantized, no fused-MoE or latent-attention layer (``direct_load_supported``).
- ``reload``: vLLM's layer-wise in-place reload (``model_runner.reload_weights``), which rebuilds each layer
  and runs its post-load processing (quantised, MoE and MLA layers need it). It must see every weight of an
  update in one call, so it runs in a thread of this worker over an iterator the buckets feed.

On vLLM's CPU build a linear layer drops its weight once packed for oneDNN (only a reload could write it
again); this module makes it keep the weight beside the packed copy (``keep_cpu_weights``), at the cost of
the linear weights' bytes once more in host memory. vLLM 0.32 packs a fused-MoE layer's experts for its CPU kernel
only at the first load, and a reload copied the new experts unpacked into the packed tensors: this module makes
the reload pack them (``repack_cpu_experts_on_update``), and loads after the reload what a model's loader copies
around vLLM's weight loaders (``LOADED_AROUND_LOADERS``: gpt-oss's experts and sinks), which the reload loses.

Only small calls cross the process boundary, so the same code serves a replica inside the rollout worker's process
(tensor parallel 1) and one whose tensor-parallel ranks are vLLM's own processes: each rank gets the full tensors.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from engines.device import ipc_device, map_ipc, visible_uuids
from engines.inference.bucket_views import BucketAssembler, PieceRef
from engines.inference.vllm_setup import check_vllm_version

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
        with torch.no_grad(), vllm_config_scope(self.worker):
            self.worker.model_runner.get_model().load_weights(iter(pairs))
        self.log.append(("taken", bucket))

    def end(self, abort: str | None) -> BaseException | None:
        if abort is None:  # an aborted update is written over by the caller's restore, which repacks then
            with vllm_config_scope(self.worker):
                _repack(self.worker.model_runner.get_model())
        return None


@contextmanager
def vllm_config_scope(worker):
    """vLLM's config of ``worker`` as the current one, as vLLM's own worker sets it around a reload."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        yield


class WeightLoader:
    """Mixed into each vLLM worker: in-place reloads, whole or streamed bucket by bucket."""

    def reload_from(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One in-place reload over ``weights`` in checkpoint names and layout (those its model's loader copies
        around vLLM's weight loaders, ``LOADED_AROUND_LOADERS``, loaded into the live tensors after it)."""
        model = self.model_runner.get_model()
        around = _loaded_around_loaders(model)
        later: list[tuple[str, torch.Tensor]] = []

        def reloaded():
            for name, t in weights:
                if any(part in name for part in around):
                    later.append((name, t))
                else:
                    yield name, t

        with vllm_config_scope(self):
            try:
                self.model_runner.reload_weights(weights_iterator=reloaded())
                if later:
                    model.load_weights(iter(later))
                    _pack_cpu_experts(model)
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

    def ipc_attach(self, handles_by_rank: list[list[tuple]]) -> str:
        """Map the IPC buffers this worker loads from: of the trainer ranks' ``handles_by_rank`` (one list per
        rank of the replica's worker), those on this worker's own GPU (by UUID); on a CPU, shared memory, the
        list of this worker's rank (the last where there are fewer). Returns where they are, for the record."""
        mine = _own_handles(handles_by_rank, self._device_uuid(), self._rank())
        self._ipc = [map_ipc(h) for h in mine]
        self._assembler = BucketAssembler()
        return ipc_device(mine[0]) or f"shm:{mine[0][1]}"

    def ipc_feed(self, bucket: int, buffer: int, pieces: list[PieceRef], check: tuple[int, int]) -> None:
        """Load bucket ``bucket`` from this worker's IPC buffer ``buffer`` (``pieces``: where each tensor's bytes
        are); ``check``: (used bytes, checksum) the engine's process read in its own copy of the bucket, which a
        rank reading another GPU's copy verifies. Returns once every tensor is loaded and no kernel reads the
        buffer any more (the sender may then write the next bucket but one into it)."""
        buf = self._ipc[buffer]
        used, want = check
        if self._rank() > 0 and int(buf[:used].view(torch.int64).sum()) != want:
            raise RuntimeError(f"bucket {bucket} in this GPU's IPC buffer {buffer} differs from the one the engine "
                               "verified (a trainer rank's copy that was overwritten or never arrived)")
        # a direct load copies out of the views before it returns; a reload keeps tensors until their layer is
        # whole, past this bucket, so it gets copies of its own (device to device)
        pairs = self._assembler.take(buf, pieces, own=isinstance(self._reload, _Reload))
        try:
            self._reload.feed(bucket, pairs)
        finally:
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)

    def ipc_held_bytes(self) -> int:
        """Device bytes held for tensors split across buckets that are still missing pieces."""
        return self._assembler.held_bytes() if getattr(self, "_assembler", None) is not None else 0

    def _device_uuid(self) -> str | None:
        device = getattr(self, "device", None)
        if not isinstance(device, torch.device) or device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        return visible_uuids()[index]

    def _rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def stream_end(self, abort: str | None = None) -> str | None:
        """Close the reload (``abort``: make it raise with that message) and wait for it; returns its failure."""
        reload, self._reload = self._reload, None
        if getattr(self, "_assembler", None) is not None:
            self._assembler.clear()
        if reload is None:
            return None
        error = reload.end(abort)
        return None if error is None else f"{type(error).__name__}: {error}"

    def stream_log(self) -> list[tuple[str, int]]:
        """The last streamed update's ("delivered" | "taken", bucket) events in this worker, in order."""
        return list(getattr(self, "_reload_log", []))


def _own_handles(handles_by_rank: list[list[tuple]], uuid: str | None, rank: int) -> list[tuple]:
    """The IPC handles a worker loads from (see ``WeightLoader.ipc_attach``)."""
    if uuid is None:
        return handles_by_rank[min(rank, len(handles_by_rank) - 1)]
    for handles in handles_by_rank:
        if ipc_device(handles[0]) == uuid:
            return handles
    where = ", ".join(str(ipc_device(h[0])) for h in handles_by_rank)
    raise RuntimeError(f"no trainer rank of this worker has its IPC buffers on this vLLM rank's GPU {uuid} (they "
                       f"are on {where}): each rank of a tensor-parallel replica needs a trainer rank on its GPU")


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


#: model class -> parts of the checkpoint names its loader copies straight into the parameters, around their weight
#: loaders (vLLM 0.32's gpt-oss: the fused experts, their biases, the attention sinks). Under the layer-wise reload
#: those parameters are placeholders on the meta device, so the copies are lost and the layers keep their old tensors
#: (vLLM logs "Failed to load weights"): on vLLM's CPU build they are loaded after the reload into the live tensors,
#: and the experts packed again.
LOADED_AROUND_LOADERS: dict[str, tuple[str, ...]] = {"GptOssForCausalLM": (".sinks", ".mlp.experts.")}


def _loaded_around_loaders(model: torch.nn.Module) -> tuple[str, ...]:
    """``LOADED_AROUND_LOADERS`` of ``model`` on vLLM's CPU build (elsewhere its kernels may keep the experts in
    a layout of their own, which a direct copy would miss: not handled)."""
    from vllm.platforms import current_platform

    return LOADED_AROUND_LOADERS.get(type(model).__name__, ()) if current_platform.is_cpu() else ()


def _pack_cpu_experts(model: torch.nn.Module) -> None:
    """Pack for vLLM's CPU fused-MoE kernel the experts just copied, unpacked, into every MoE layer's live tensors
    (layers whose intermediate size the kernel pads are not handled: their copies would not fit)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    with torch.no_grad():
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
                kernel.fused_experts.process_weights_after_loading(module)


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


def repack_cpu_experts_on_update() -> None:
    """On vLLM's CPU build, make an unquantized fused-MoE layer pack its experts for the CPU kernel again when an
    update reloads them. vLLM packs them (``CPUUnquantizedExperts.process_weights_after_loading``) only when the
    layer's kernel is first built; on an update its MoE method skips that step, and the layer-wise reload copies the
    new weights, unpacked, into the packed tensors the kernel reads in its own layout. Idempotent; nothing to do on
    other platforms."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.utils import is_weights_pre_processed
    from vllm.platforms import current_platform

    method = UnquantizedFusedMoEMethod
    if not current_platform.is_cpu() or getattr(method, "_repacks_cpu_experts", False):
        return
    vllms_own = method.process_weights_after_loading

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        update = self.moe_kernel is not None  # vLLM's own test for "the kernel is set up: skip the packing"
        vllms_own(self, layer)
        experts = None if self.moe_kernel is None else self.moe_kernel.fused_experts
        if update and isinstance(experts, CPUUnquantizedExperts) and not is_weights_pre_processed():
            # pads and packs the layer's (materialised, model-layout) weights; the reload then copies them into
            # the kernel's tensors, which have the packed shape
            experts.process_weights_after_loading(layer)

    method.process_weights_after_loading = process_weights_after_loading
    method._repacks_cpu_experts = True


def patch_cpu_build() -> None:
    """What an update needs of vLLM's CPU build: linear weights kept beside their packed copies, fused-MoE experts
    packed again after a reload. Call before vLLM builds the model; idempotent. Refuses an untested vLLM first
    (``engines.inference.vllm_setup.check_vllm_version``): the patches are written against its internals."""
    check_vllm_version()
    keep_cpu_weights()
    repack_cpu_experts_on_update()


if "vllm" in sys.modules:  # imported by vLLM as a worker's extension: before the worker loads its model
    patch_cpu_build()
