"""The routing replay benchmark at toy sizes: its records carry every field, a replayed forward runs exactly the
recorded experts, and replay leaves the trainer no further from the rollout than routing itself does."""

from __future__ import annotations

import pytest

from benchmarks.routing_replay import FAMILIES, measure, table

TOY = dict(sequences=8, samples=2, prompt_len=8, max_tokens=12, experts=8, top_k=2, expert_width=8, layers=2,
           hidden=32, vocab=64, context=32)
FIELDS = {"family", "experts", "top_k", "moe_layers", "sequences", "generated_tokens", "rollout_dtype",
          "trainer_dtype", "logprob_diff_no_replay", "logprob_diff_replay", "logprob_diff_dense", "route_mismatch",
          "route_mismatch_by_layer", "route_mismatch_under_replay", "replay_used_mismatch", "router_entropy",
          "replay_over_dense_mean", "no_replay_over_dense_mean", "threads", "seconds"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_runs_the_recorded_experts_and_does_not_widen_the_gap(family):
    rec = measure(family, **TOY)
    assert FIELDS <= rec.keys()
    assert rec["family"] == family and rec["sequences"] == 8 and rec["generated_tokens"] == 8 * 12
    assert rec["rollout_dtype"] == "bfloat16" and rec["trainer_dtype"] == "float32"
    assert len(rec["route_mismatch_by_layer"]) == rec["moe_layers"]
    for key in ("logprob_diff_no_replay", "logprob_diff_replay", "logprob_diff_dense"):
        assert 0 <= rec[key]["mean"] <= rec[key]["max"]
    # under replay the experts run are the recorded ones, by construction
    assert rec["replay_used_mismatch"] == 0
    assert 0 <= rec["route_mismatch_under_replay"] <= 1 and 0 <= rec["route_mismatch"] <= 1
    # equal when no route flips (the same forward); lower when some do
    assert rec["logprob_diff_replay"]["mean"] <= rec["logprob_diff_no_replay"]["mean"]
    lines = table([rec]).splitlines()
    assert len(lines) == 3 and lines[2].startswith(family)
