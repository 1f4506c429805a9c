"""Distributed checkpoints of the trainer (torch.distributed.checkpoint): each rank writes its own shards,
and a checkpoint resumes on another number of ranks with every tensor intact.

One process trains and saves, two FSDP2 ranks (gloo) load that and also train and save their own, three
ranks load the two ranks' checkpoint, and one process loads it too; every load is compared with the
full tensors the saver held, then takes the same next step.
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from engines.model.native.causal_lm import CausalLM
from engines.model.sharded import full_state_dict
from engines.training.distributed import init_distributed, shard_model
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from engines.training.trainer_state import (
    TrainerStateError,
    collect_shard_sums,
    load_trainer_state,
    save_trainer_state,
)
from tests.conftest import tiny_config
from tests.ranks import rank_body, run_ranks

VOCAB = 37  # odd: embedding rows split unevenly over 2 and 3 ranks


def _engine(sharded: bool) -> TrainingEngine:
    torch.manual_seed(0)
    model = CausalLM(tiny_config(VOCAB))
    if sharded:
        model = shard_model(model)
    return TrainingEngine(model, build_optimizers(model, "muon", 1e-2, 0.1), pad_id=0)


def _step(engine: TrainingEngine, seed: int, rank: int = 0, world: int = 1) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    responses = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    n = sum(map(len, responses))
    lp, _ = engine.response_logprobs(prompts[rank::world], responses[rank::world], 1.0)
    (-lp.sum() / n).backward()
    engine.step()


def _full(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """Every weight and optimizer-state tensor, whole (collective when sharded)."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out = {f"w/{k}": v.clone() for k, v in full_state_dict(engine.model).items()}
    for opt in engine.optimizers:
        for p, st in opt.state.items():
            for k, v in st.items():
                out[f"opt/{names[id(p)]}/{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def _ranks_main(rank: int, world: int, port: int, out: str, source: str) -> None:
    torch.set_num_threads(1)
    with rank_body(rank, out):
        init_distributed(rank, world, f"tcp://127.0.0.1:{port}", timeout_s=120)
        res = {}
        engine = _engine(sharded=True)
        load_trainer_state(engine.model, engine.optimizers, Path(out) / source)
        res["loaded"] = _full(engine)
        _step(engine, seed=9, rank=rank, world=world)
        res["next"] = _full(engine)
        if world == 2:  # train from scratch and save its own checkpoint for the 3-rank and 1-process loads
            engine = _engine(sharded=True)
            _step(engine, seed=1, rank=rank, world=world)
            _step(engine, seed=2, rank=rank, world=world)
            save_trainer_state(engine.model, engine.optimizers, Path(out) / "two")
            res["saved"] = _full(engine)
        torch.save(res, Path(out) / f"rank{rank}.pt")


def _check_collect(saved: Path, scratch: Path) -> None:
    """collect_shard_sums on a copy of a 2-rank trainer state: a rank that did not finish (no record), a shard
    missing or cut short are named; the whole one gives each file's size and SHA-256 (computed here, independently)
    and its records are gone."""
    def copy(name: str) -> Path:
        shutil.copytree(saved, scratch / name)
        return scratch / name

    shutil.rmtree(scratch, ignore_errors=True)
    (copy("no-record") / "trainer" / "__1.sums.json").unlink()
    (copy("missing") / "trainer" / "__1_0.distcp").unlink()
    with open(copy("short") / "trainer" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    for name, why in (("no-record", r"trainer/__1_0.distcp has no record of being written whole .* 1 rank\(s\) did"),
                      ("missing", r"trainer/__1_0.distcp is missing; its rank wrote [\d,]+ and the index needs"),
                      ("short", r"trainer/__0_0.distcp is 100 bytes; its rank wrote")):
        with pytest.raises(TrainerStateError, match=why):
            collect_shard_sums(scratch / name)
    whole = copy("whole")
    sums = collect_shard_sums(whole)
    want = {f"trainer/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp")}
    assert set(sums) == want and {p.name for p in (whole / "trainer").iterdir()} == {n[8:] for n in want}
    for rel, rec in sums.items():
        data = (whole / rel).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_trainer_state_resumes_on_another_number_of_ranks(tmp_path):
    # one process trains and saves: one file of shards
    single = _engine(sharded=False)
    _step(single, seed=1)
    _step(single, seed=2)
    save_trainer_state(single.model, single.optimizers, tmp_path / "one")
    saved_one = _full(single)
    # the shards and the index; the rank's record of what it wrote (sizes, SHA-256) beside them
    assert {p.name for p in (tmp_path / "one" / "trainer").iterdir()} == {".metadata", "__0_0.distcp", "__0.sums.json"}
    assert any(k.endswith("momentum_buffer") for k in saved_one) and any(k.endswith("exp_avg") for k in saved_one)

    two = run_ranks(_ranks_main, tmp_path, "one", world=2)
    for r in two:  # 1 -> 2 ranks: every tensor back whole
        _assert_equal(r["loaded"], saved_one)
    # each of the two ranks wrote its own shard file, and its record of it
    assert {p.name for p in (tmp_path / "two" / "trainer").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                          "__0.sums.json", "__1.sums.json"}
    _check_collect(tmp_path / "two", tmp_path / "bad")
    saved_two = two[0]["saved"]
    _assert_equal(two[1]["saved"], saved_two)

    for p in tmp_path.glob("rank*.pt"):
        p.unlink()
    three = run_ranks(_ranks_main, tmp_path, "two", world=3)
    for r in three:  # 2 -> 3 ranks
        _assert_equal(r["loaded"], saved_two)

    alone = _engine(sharded=False)  # 2 -> 1 process, unsharded
    load_trainer_state(alone.model, alone.optimizers, tmp_path / "two")
    _assert_equal(_full(alone), saved_two)
    # the same next step from the resharded state: equal up to the order of the ranks' gradient sums, which
    # Muon's bfloat16 Newton–Schulz can turn into one bfloat16 step of its update (lr·0.2·√64 · 2⁻⁸ ≈ 6e-5)
    _step(alone, seed=9)
    _step(single, seed=9)
    for ranked, whole in ((three[0]["next"], _full(alone)), (two[0]["next"], _full(single))):
        for k, v in whole.items():
            tol = 4e-4 if k.startswith("w/model.layers.") else 1e-6
            torch.testing.assert_close(ranked[k], v, atol=tol, rtol=1e-5, msg=k)
