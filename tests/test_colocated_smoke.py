"""benchmarks.colocated_smoke on a CPU: the trainer and the native engine in two processes joined by the checkpoint
engine's shared-memory IPC buffers (CUDA IPC on a GPU), through fill, generate, sleep, step, wake, update, generate."""

from __future__ import annotations

import dataclasses

from benchmarks.colocated_smoke import run
from benchmarks.rollout import MODELS


def test_a_colocated_step_reaches_the_replica_as_the_cast_master_bitwise():
    """A bfloat16 replica of float32 masters: after the start-up fill and after the step's update the replica equals
    the master cast to bfloat16 (digests of every tensor, taken in the trainer's process), the step changed the
    weights, and every phase was timed."""
    rec = run("demo", "cpu", "bfloat16", sleep_level=2, prompts=2, samples=2, max_tokens=8)
    assert rec["replica_equals_cast_master"] is True and rec["weights_changed"] is True
    assert rec["weights_version"] == 2 and rec["tokens"] == 4 * 8
    assert set(rec["phase_s"]) == {"fill", "generate", "sleep", "step", "wake", "update", "generate_after"}
    assert rec["peak_bytes"]["step_trainer"] > 0



def test_a_tied_output_head_crosses_once():
    """A model whose output head is its embedding (Qwen3-0.6B's, the GPU check's shape): the engine holds no head of
    its own, so the plan lists each storage once and the replica still equals the cast master."""
    cfg = dataclasses.replace(MODELS["demo"], tie_word_embeddings=True)
    rec = run(cfg, "cpu", "bfloat16", sleep_level=2, prompts=2, samples=2, max_tokens=8)
    assert rec["replica_equals_cast_master"] is True and rec["weights_changed"] is True
