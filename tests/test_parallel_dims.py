"""``ParallelDims`` owns the trainers' layout: which rank leads which worker, where each rank computes, the mesh FSDP2
shards over; the settings and the cluster ask it instead of reasoning about world sizes."""

import pytest

from engines.training.parallel_dims import ParallelDims
from rl.config import parse_config
from rl.settings import parallel_dims


def test_each_worker_has_a_lead_and_its_ranks_in_order():
    dims = ParallelDims(workers=3, ranks_per_worker=2)
    assert dims.world == 6 and dims.shard_degree == 6 and dims.sharded
    assert [dims.lead(w) for w in range(3)] == [0, 2, 4]
    assert [dims.worker_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [dims.local_index(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [r for r in range(6) if dims.is_lead(r)] == [0, 2, 4]
    assert list(dims.ranks_of(1)) == [2, 3]
    assert dims.mesh_shape() == (("dp_shard",), (6,))
    # expert parallel: consecutive ranks share experts, the grid's rows hold the same ones
    ep = ParallelDims(workers=4, ep=2)
    assert ep.mesh_shape() == (("dp_shard",), (4,)) and ep.expert_replicas == 2
    single = ParallelDims(workers=1)
    assert single.world == 1 and not single.sharded and single.mesh_shape() == (("dp_shard",), (1,))


def test_a_layout_it_cannot_train_is_refused_in_one_line():
    with pytest.raises(ValueError, match="tensor parallel training is not supported yet"):
        ParallelDims(workers=2, tp=2)
    with pytest.raises(ValueError, match="ep=3 does not divide the 2 trainer ranks"):
        ParallelDims(workers=2, ep=3)
    with pytest.raises(ValueError, match="dp_shard=3 must equal the 4 trainer ranks"):
        ParallelDims(workers=2, ranks_per_worker=2, dp_shard=3)
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 trainer ranks"):
        ParallelDims(workers=4).worker_of(4)
    with pytest.raises(ValueError, match="worker 2 is not one of the 2 workers"):
        ParallelDims(workers=2).lead(2)


def test_the_settings_give_a_tensor_parallel_replica_one_rank_per_gpu():
    """A replica spanning 2 GPUs (vLLM tensor parallel) gets a trainer rank on each: 2 workers are 4 ranks."""
    tp = parse_config({"cluster": {"workers": 2, "gpus_per_worker": 2},
                       "rollout": {"engine": "vllm", "tensor_parallel_size": 2}})
    assert parallel_dims(tp) == ParallelDims(workers=2, ranks_per_worker=2)
    assert parallel_dims(parse_config({"cluster": {"workers": 3}})) == ParallelDims(workers=3)
