"""Shared fixtures: a tiny model and tokenizer made by the project, a warm-start cache per
session, and one local Ray cluster for the tests that need workers."""

from __future__ import annotations

import os

# Tests run side by side (pytest-xdist) on a few cores, on models of a few thousand parameters: one torch thread
# per Ray worker (rl.loop.placement.worker_threads reads it) and per process started from a test, instead of every
# process spinning on all cores, which made two test processes slower together than one after the other. `make
# test` sets it before Python starts, so that the test processes' own threads (vLLM's engine loop) have it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's CPU build would otherwise pin its threads to every core, in each test process alike
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
# Without a GPU the Triton kernels under test run in Triton's interpreter. It must be chosen before anything imports
# triton (its language functions are made then), so it is set here, first, for every test process.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from engines.model.native.arch import ModelConfig
from engines.model.native.causal_lm import CausalLM
from engines.model.text.tokenizer import train_tokenizer
from envs.arithmetic import ArithmeticEnv


@pytest.fixture(scope="session")
def tokenizer():
    tasks = ArithmeticEnv.generate_tasks(500, seed=11)
    return train_tokenizer([t.prompt + t.meta["solution"] for t in tasks], vocab_size=400)


def tiny_config(vocab_size: int, **kw) -> ModelConfig:
    args = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                eos_token_id=1, pad_token_id=0)
    args.update(kw)
    return ModelConfig(**args)


def sharp_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """A model of ``cfg`` with larger matrices than the init (N(0, 0.2)), so that logits are far from uniform
    and errors would show."""
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return model


@pytest.fixture
def tiny_model(tokenizer):
    return sharp_model(tiny_config(tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory, worker_id):
    """One cache for the whole test run: pytest-xdist's processes share it (a warm start is built once, under its
    lock, whichever process needs it first)."""
    root = tmp_path_factory.getbasetemp()
    cache = (root if worker_id == "master" else root.parent) / "cache"
    cache.mkdir(exist_ok=True)
    os.environ["RL_CACHE_DIR"] = str(cache)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernel_built():
    """The CPU decode kernel built once, before any test starts engines in other processes (which then load it;
    a worker killed by a fault test while building would leave the build's lock behind)."""
    from engines.inference import cpu_kernel

    cpu_kernel.available()


@pytest.fixture(scope="session")
def ray_cluster():
    import logging

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


_keys = iter(range(10**9))


def make_sample(group: int, prompt: list[int], response: list[int], logprobs: list[float], reward: float,
                temperature: float = 1.0, loss_mask: list[int] | None = None, multi_turn: bool | None = None):
    """A finished ``rl.sample.Sample`` with the fields the trainer reads (a fresh key each)."""
    from engines.inference.sampling import SamplingParams
    from rl.algo.schedules import Schedule
    from rl.sample import Sample, TaskType

    kind = TaskType("text", max(len(response), 1), 0.0, Schedule("constant", temperature, temperature, 1))
    return Sample(next(_keys), group, 0, kind, list(prompt), SamplingParams(temperature, max(len(response), 1)), 0,
                  list(response), list(logprobs), loss_mask=loss_mask,
                  multi_turn=loss_mask is not None if multi_turn is None else multi_turn, status="finished",
                  reward=reward)


def train_on(cluster, samples, seed: int = 0) -> list[dict]:
    """One policy update of ``samples`` on a ``rl.loop.cluster.Cluster`` (planned as the controller plans it)."""
    from rl.algo.batches import plan_update

    batches = plan_update(samples, cluster.settings.update, len(cluster.trainers), seed)
    return cluster.trainers.train(batches) if batches else []


@pytest.fixture(scope="session")
def served_judge(tmp_path_factory):
    """`rl serve`'s server of a tiny judge trained here (tests/served_judge.py), on a thread, with every chat
    completion it answered kept: trained and started once for the judge's tests and the run it rewards."""
    from tests.served_judge import serve_judge

    with serve_judge(tmp_path_factory.mktemp("judge") / "judge") as judge:
        yield judge


@pytest.fixture(scope="module")
def torch_muon_kernels():
    """ShardedMuon runs torch's bfloat16 kernels, in this process and in the ranks it spawns, for tests whose
    reference is torch.optim.Muon (a CPU without bfloat16 GEMMs would otherwise emulate them: tests/test_muon_ns.py)."""
    from engines.training.muon import BF16_KERNELS_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BF16_KERNELS_ENV, "1")
        yield


@pytest.fixture(scope="session")
def reward_file(tmp_path_factory):
    """A reward function file, ``PATH:digits``: the share of digits in a response, which differs between random
    responses (so groups train) without any right answer."""
    path = tmp_path_factory.mktemp("reward") / "digit_share.py"
    path.write_text("def digits(response):\n    return sum(c.isdigit() for c in response) / max(len(response), 1)\n")
    return path


@pytest.fixture(scope="session")
def model_dir():
    """The warm-started tiny model of test_run's TINY (cached on disk), for runs whose tasks come as lists or files
    and so take model.path."""
    import json

    from rl.config import parse_config
    from rl.setup.warmstart import prepare_model
    from tests.test_run import TINY

    return prepare_model(parse_config(json.loads(json.dumps(TINY))))
