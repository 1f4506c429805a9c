"""The transfer suite (benchmarks.transfer) in its reduced form: two (model, task) pairs of other families than the
embedded model's, each with its family's tokenizer conventions, run with the schema's defaults for a few
iterations. What the full suite measures at scale, here in small: the defaults do not collapse a model they were
not tuned on (held-out accuracy does not fall, no rollback was needed)."""

from __future__ import annotations

import pytest

from benchmarks.transfer import PAIRS, pair_config
from engines.model.family_tokens import STYLES
from engines.model.hf_io import read_config
from engines.model.tokenizer import TextTokenizer
from rl.config import parse_config
from rl.loop.controller import train
from rl.setup.warmstart import prepare_model

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1}


def _reduced(name: str) -> dict:
    raw = pair_config(name, 3, [])
    raw.pop("extra")
    arch = {**raw["warmstart"]["architecture"], **SMALL}
    if PAIRS[name]["family"] == "mixtral":
        arch["intermediate_size"] = 64
    raw["warmstart"].update(steps=60, num_examples=2000, batch_size=32, vocab_size=400, architecture=arch)
    raw["env"].update(num_train=500, num_eval=40)
    raw["run"].update(eval_every=3, save_every=3, eval_samples=0)
    # a smaller batch than the defaults' 64 x 8 (the budget), everything else as the schema has it
    raw["rollout"] = {"prompts_per_iteration": 8, "samples_per_prompt": 8, "max_batch": 64}
    raw["checkpoint_engine"] = {"bucket_mb": 1}
    return raw


@pytest.mark.parametrize("name", ["qwen2-arith", "mixtral-chain3"])
def test_transfer_pair_with_the_defaults_does_not_collapse(name, ray_cluster, tmp_path):
    cfg = parse_config(_reduced(name))
    model_dir = prepare_model(cfg)
    style = STYLES[PAIRS[name]["tokenizer"]]
    tok = TextTokenizer.load(model_dir)
    # the family's conventions: its end of turn is the EOS the engines stop on, its template renders prompts
    assert tok.hf.convert_ids_to_tokens(tok.eos_id) == style.eos
    assert read_config(model_dir).model_type == PAIRS[name]["family"]
    assert tok.hf.chat_template == style.chat_template
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations"] == 3 and summary["rollbacks"] == 0
    assert summary["final_accuracy"] >= summary["initial_accuracy"] - 0.05, summary
